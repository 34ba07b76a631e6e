"""Locks across processes sharing a ``$POSTTRAIN_HOME``.

Creating a SQLite store (MLflow's or Prefect's) runs migrations that two processes must
not run at once (seen here: "table _alembic_tmp_tags already exists"), so store creation
holds a lock. And one execution per stage fingerprint runs at a time:

Two ``posttrain run`` processes planned from the same store can both decide to run a
stage with the same fingerprint. The stage lock makes the second wait; when it gets the
lock it looks in MLflow again and reuses the first one's result instead of training the
same thing twice. ``flock`` locks die with their process, so a killed run never leaves
a stale lock behind.

The processes a home keeps between runs (its Prefect server, its warm process) are known by
pid and start time in a state file: a recycled pid does not match (``still_running``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def file_lock(path: Path):
    """An exclusive ``flock`` on ``path`` (created if missing), released on exit or process death."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


@contextmanager
def stage_lock(home: Path, experiment_id: str, stage: str, fingerprint: str, on_wait=None):
    """Hold the lock of one (experiment, stage, fingerprint); ``on_wait(holder)`` is called before blocking."""
    folder = home / "locks"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{experiment_id}-{stage}-{fingerprint}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait(os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process")
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}".encode(), 0)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def process_start(pid: int) -> float | None:
    """When ``pid`` started; None if no such process runs (a zombie has finished running)."""
    try:
        import psutil

        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            with contextlib.suppress(ChildProcessError):  # our own child (e.g. started in this process): reap it
                os.waitpid(pid, os.WNOHANG)
            return None
        return process.create_time()
    except Exception:
        return None


def still_running(pid: int, started: float) -> bool:
    """Whether the process ``pid`` that started at ``started`` (``process_start``) still runs."""
    now = process_start(pid)
    return now is not None and abs(now - started) < 0.05
