"""The warm process's program: ``python -m flows.servers.warm_process HOME`` (``flows.warm.start_in_background``).

A module of its own because it joins the two sides, which do not import each other:
``flows.servers.warm`` serves requests, and each forked child runs ``flows.cli.main`` on its caller's
arguments.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from flows.cli import main
from flows.servers.warm import serve

if __name__ == "__main__":
    serve(Path(sys.argv[1]), main)
    sys.stderr.flush()
    os._exit(0)  # nothing left to save: skip freeing what torch and the rest loaded (seconds)
