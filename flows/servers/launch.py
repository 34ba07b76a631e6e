"""``posttrain run`` as a program: every start-up acceleration behind one call, ``run_program``.

A run's wall time on a small machine is dominated by what happens before and after its stages:
importing MLflow, Prefect, torch and transformers, and the interpreter freeing them at exit. The
program (the console script, ``python -m flows.cli``; never an in-process caller such as the tests)
goes through ``run_program``, which
- pauses garbage collection until the first stage's work starts (flows/servers/startup.py);
- hands the run to this home's warm process when one holds the imports (flows/servers/warm.py): it
  forks, runs the command there and returns its status;
- else runs the command here, and leaves without the interpreter's teardown (``SkipTeardownAtExit``);
- starts the next run's warm process for this home in the background.
The Prefect API server a run needs starts early in ``flows.cli.run_from_cli`` (``early_start``), so
that its start-up overlaps the plan's: that is the server's, not the program's.
"""

from __future__ import annotations

import os
import sys
from typing import Callable


def run_program(argv: list[str], command: Callable[[], int]) -> int:
    """Run ``command`` (``posttrain run`` with ``argv``) as a fast-starting program; its exit status."""
    from flows.servers import startup

    startup.pause()  # until the first stage's work starts; what is imported from here on is never collected
    from flows.recording.home import posttrain_home
    from flows.servers import warm

    home, environment = posttrain_home(), dict(os.environ)
    if warm.enabled() and (status := warm.run_warm(home, argv)) is not None:
        return status
    at_exit = SkipTeardownAtExit()
    at_exit.status = command()
    if warm.enabled() and home.is_dir():  # the next run of this home skips the imports this one paid for
        warm.start_in_background(home, environment)
    return at_exit.status


class SkipTeardownAtExit:
    """Ends the process without the interpreter's teardown, once everything else at exit has run.

    After a run, freeing what torch, transformers, MLflow and Prefect loaded (modules, C++
    destructors) took 2.5 to 2.8 s of the process's wall time on a loaded 2-core machine: half a
    stage's worth on ``--only``. Registered before the command runs, this hook runs after every
    atexit hook registered later (MLflow's and Prefect's flushes, logging's), and the threads
    are already joined then; it closes logging and finalizers registered before it, flushes
    stdout and stderr, and leaves with ``os._exit(status)``. Until ``status`` is set (the
    command returned) it does nothing: an uncaught error exits as usual, traceback and all.
    """

    def __init__(self):
        import atexit

        self.status: int | None = None
        atexit.register(self)

    def __call__(self) -> None:
        import logging
        import os
        import weakref

        if self.status is None:
            return
        logging.shutdown()
        weakref.finalize._exitfunc()  # weakref.finalize(atexit=True) objects, had it registered before us
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(self.status)
