"""Locks across processes sharing a ``$POSTTRAIN_HOME``.

Creating a SQLite store (MLflow's or Prefect's) runs migrations that two processes must
not run at once (seen here: "table _alembic_tmp_tags already exists"), so store creation
holds a lock. And one execution per stage fingerprint runs at a time:

Two ``posttrain run`` processes planned from the same store can both decide to run a
stage with the same fingerprint. The stage lock makes the second wait; when it gets the
lock it looks in MLflow again and reuses the first one's result instead of training the
same thing twice. ``flock`` locks die with their process, so a killed run never leaves
a stale lock behind.
"""

from __future__ import annotations

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
