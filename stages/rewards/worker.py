"""Reward functions under a wall-clock bound that holds in any thread: a worker process (docs/algorithms.md)."""

from __future__ import annotations

import os
import pickle
import select
import struct
import subprocess
import sys
import threading
import time
from typing import Any

CHUNK = 32
START_SECONDS = 300.0  # a worker that has not started and imported the reward by then is taken for dead


class RewardTimeout(Exception):
    """A reward call that passed its wall-clock bound (the worker was killed)."""


class RewardRaised(Exception):
    """A reward that raised in the worker: ``kind`` is the exception's class name."""

    def __init__(self, kind: str, message: str, contract: bool):
        super().__init__(message)
        self.kind, self.contract = kind, contract  # contract: a RewardError (a broken reward, not a bad sample)


def send(stream, payload: Any) -> None:
    data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def _read_exactly(fd: int, n: int, deadline: float | None) -> bytes:
    chunks, left = [], n
    while left:
        if deadline is not None:
            wait = deadline - time.monotonic()
            if wait <= 0 or not select.select([fd], [], [], wait)[0]:
                raise RewardTimeout
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError("the reward worker exited")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def receive(fd: int, deadline: float | None = None) -> Any:
    (size,) = struct.unpack("<Q", _read_exactly(fd, 8, deadline))
    return pickle.loads(_read_exactly(fd, size, deadline))


class RewardWorker:
    """One worker process that runs named rewards; ``call`` is bounded, a timeout kills and replaces it."""

    def __init__(self):
        self.process: subprocess.Popen | None = None
        self.lock = threading.Lock()  # one call at a time (the stage's threads share the worker)
        self.launcher = _Launcher()

    def _start(self) -> subprocess.Popen:
        self.process = self.launcher.start()
        return self.process

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()

    def call(self, fn: str, completions: list[str], columns: dict[str, list], kwargs: dict, seconds: float):
        """``fn(completions, **columns, **kwargs)`` in the worker, else ``RewardRaised`` or ``RewardTimeout``."""
        with self.lock:
            process = self.process if self.process is not None and self.process.poll() is None else self._start()
            try:
                # this process's sys.path and environment as they are now
                send(process.stdin, (list(sys.path), dict(os.environ), fn, completions, columns, kwargs))
                # the bound counts from "started" (the reward imported): a slow start is not the reward's time
                status, value = receive(process.stdout.fileno(), time.monotonic() + START_SECONDS)
                if status == "started":
                    status, value = receive(process.stdout.fileno(), time.monotonic() + seconds)
            except RewardTimeout:
                self.stop()
                raise
            except (EOFError, BrokenPipeError, OSError) as error:  # the worker died (killed, out of memory)
                self.stop()
                raise RewardRaised("WorkerDied", f"the reward worker exited ({error})", False) from None
        if status == "ok":
            return value
        kind, message, contract = value
        raise RewardRaised(kind, message, contract)


class _Launcher:
    """Starts workers from one process-long thread: the parent-death signal fires when the *thread* that
    started a child ends, and stages run in threads that end (Prefect's)."""

    def __init__(self):
        import queue

        self.requests: queue.Queue = queue.Queue()
        threading.Thread(target=self._serve, name="posttrain-reward-launcher", daemon=True).start()

    def _serve(self) -> None:
        while True:
            reply = self.requests.get()
            try:
                env = dict(os.environ, PYTHONSAFEPATH="1")  # the caller's directory never shadows posttrain's
                command = [sys.executable, "-m", "stages.rewards.worker_process"]
                reply.put(subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                           cwd=os.getcwd()))
            except Exception as error:  # handed to the caller
                reply.put(error)

    def start(self) -> subprocess.Popen:
        import queue

        reply: queue.Queue = queue.Queue(maxsize=1)
        self.requests.put(reply)
        process = reply.get()
        if isinstance(process, Exception):
            raise process
        return process


_WORKER: RewardWorker | None = None
_WORKER_LOCK = threading.Lock()


def _forget_after_fork() -> None:
    """A forked child starts its own worker: the parent's launcher thread and worker are not its own."""
    global _WORKER, _WORKER_LOCK
    _WORKER, _WORKER_LOCK = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)


def worker() -> RewardWorker:
    global _WORKER
    with _WORKER_LOCK:
        if _WORKER is None:
            _WORKER = RewardWorker()
        return _WORKER
