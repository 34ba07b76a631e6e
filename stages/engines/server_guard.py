"""``python -m stages.engines.server_guard PARENT -- COMMAND...``: COMMAND, its process group taken down with PARENT."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

POLL_S = 0.5


def main(argv: list[str]) -> int:
    parent, separator, *command = argv
    if separator != "--" or not command:
        raise SystemExit("usage: python -m stages.engines.server_guard PARENT_PID -- COMMAND...")
    child = subprocess.Popen(command)
    # a SIGTERM or Ctrl-C reaches the whole group (the stage sends it with killpg): the server shuts down by
    # itself and the guard leaves with it (ignored only after the start: an ignored signal is inherited)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        code = child.poll()
        if code is not None:
            return code
        if os.getppid() != int(parent):  # the stage is gone: nothing will stop the server but us
            os.killpg(os.getpgrp(), signal.SIGKILL)
        time.sleep(POLL_S)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
