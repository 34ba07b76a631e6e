"""`posttrain run` as a program ends without the interpreter's teardown, and loses nothing to it.

A real Python process, real atexit hooks, real logging file handler; nothing mocked."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import atexit, logging, logging.handlers, sys, weakref
    from pathlib import Path
    from flows.servers.launch import SkipTeardownAtExit

    out = Path(sys.argv[1])
    buffered = logging.handlers.MemoryHandler(1000, target=logging.FileHandler(out / "run.log"))  # written on close
    logging.basicConfig(handlers=[buffered], level=logging.INFO)  # logging's own atexit hook: before ours
    early = type("Early", (), {})()
    weakref.finalize(early, print, "early finalizer")  # registered with atexit before ours too
    hook = SkipTeardownAtExit()
    atexit.register(print, "a later atexit hook ran")  # Prefect's and MLflow's flushes register like this

    class Teardown:
        def __del__(self):  # runs only while the interpreter tears its modules down
            print("interpreter teardown")

    keep = Teardown()
    logging.getLogger("posttrain").info("last log line")
    print("command output", end="")  # unflushed, no newline
    hook.status = STATUS
""")


def run_script(tmp_path: Path, status: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # output left in buffers must be flushed
    return subprocess.run([sys.executable, "-c", SCRIPT.replace("STATUS", status), str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)


def test_exit_keeps_the_status_runs_later_hooks_flushes_output_and_logs_and_skips_teardown(tmp_path):
    done = run_script(tmp_path, "3")
    assert done.returncode == 3, done.stderr
    assert "a later atexit hook ran" in done.stdout
    assert "early finalizer" in done.stdout
    assert "command output" in done.stdout
    assert "last log line" in (tmp_path / "run.log").read_text()
    assert "interpreter teardown" not in done.stdout


def test_a_command_that_did_not_return_exits_as_usual(tmp_path):
    done = run_script(tmp_path, "None")
    assert done.returncode == 0, done.stderr
    assert "interpreter teardown" in done.stdout
