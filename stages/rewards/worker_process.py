"""The reward worker's process (``python -m stages.rewards.worker_process``), run for a stage by worker.py."""

from __future__ import annotations

import importlib
import os
import signal
import sys

from stages.rewards.worker import receive, send
from stages.rewards.registry import load_reward_fn
from stages.rewards.spec import RewardError


def _die_with_parent() -> None:
    """Linux: the kernel kills the worker when the stage process dies (even by SIGKILL, mid-call)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # not Linux: the worker still exits at its next read, when its stdin closes
        pass


def serve() -> None:
    """The worker's loop: read (sys.path, environment, fn, completions, columns, kwargs), answer ("started", None)
    once the reward is imported, then ("ok", result) or ("raised", (class name, message, whether it is a
    RewardError)); a reward that cannot be imported is answered ("raised", ...) at once."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the stage's to handle; it stops the worker
    _die_with_parent()
    stdin = sys.stdin.buffer
    # answers go out on a private copy of fd 1; fd 1 itself (prints, a subprocess's output) goes to stderr
    stdout = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    while True:
        try:
            path, environment, fn, completions, columns, kwargs = receive(stdin.fileno())
        except EOFError:
            return
        if path != sys.path:
            sys.path[:] = path
            importlib.invalidate_caches()
        if environment != os.environ:
            os.environ.clear()
            os.environ.update(environment)
        try:
            reward = load_reward_fn(fn)
            reward = load_reward_fn(reward.lazy_path) if hasattr(reward, "lazy_path") else reward  # a lazy built-in
        except Exception as error:
            send(stdout, ("raised", (type(error).__name__, str(error), isinstance(error, RewardError))))
            continue
        send(stdout, ("started", None))
        try:
            result = reward(completions, **columns, **kwargs)
            if not hasattr(result, "scores") and not isinstance(result, tuple):
                result = list(result)  # a generator or an array: what pickles
            send(stdout, ("ok", result))
        except Exception as error:
            send(stdout, ("raised", (type(error).__name__, str(error), isinstance(error, RewardError))))


if __name__ == "__main__":
    serve()
