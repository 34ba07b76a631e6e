"""What ``posttrain run`` shows on the terminal, and where everything else goes.

The terminal gets posttrain's own lines only: the plan, one line per running stage (step /
total, loss or reward, tokens/s, ETA; live on a TTY, a few plain lines otherwise) and the
summary. Everything else a run writes (other libraries' progress bars and warnings,
Prefect's and MLflow's logs, a stage's own prints, C-level output) is captured at the file
descriptor level: into the stage's log file while a stage runs (``capture`` around it,
logged to the stage's MLflow run as ``logs/``), into the run's log file otherwise.
``-v`` / ``--debug`` turn capturing off. No Prefect or MLflow here.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

# The line's value: the first of these the stage has logged (RL reward, else training loss).
_HEADLINE = (("reward/mean", "reward"), ("loss", "loss"), ("train_loss", "loss"))
PLAIN_LINE_EVERY_S = 30.0  # off a TTY: a line at 25/50/75% of a stage, at most this often, then its last


def _own_stream():
    """A stream on the terminal that stays there when fds 1 and 2 are redirected (or the
    object itself when it has no file descriptor, e.g. under pytest's capsys)."""
    stream = sys.stdout
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation, ValueError):
        return stream
    stream.flush()
    return os.fdopen(os.dup(fd), "w", buffering=1, encoding="utf-8", errors="replace", closefd=True)


class Terminal:
    """posttrain's console for one ``posttrain run``, and the capture of everything else."""

    def __init__(self, verbose: bool = False, debug: bool = False):
        from rich.console import Console

        self.verbose, self.debug = verbose or debug, debug
        self.stream = _own_stream()
        self.is_tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.console = Console(file=self.stream) if self.is_tty else Console(file=self.stream, width=160)
        self.line: StageLine | None = None  # the stage running now, fed by the stage's context

    @contextlib.contextmanager
    def capture(self, log_path: Path):
        """fds 1 and 2 (and sys.stdout / sys.stderr) append to ``log_path`` inside the block."""
        if self.verbose:
            yield
            return
        if not log_path.parent.is_dir():  # the run's own log lies in the temp dir, which exists
            log_path.parent.mkdir(parents=True, exist_ok=True)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        saved = os.dup(1), os.dup(2)
        saved_streams = sys.stdout, sys.stderr
        log = open(log_path, "a", buffering=1, encoding="utf-8", errors="replace")
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        sys.stdout = sys.stderr = log
        try:
            yield
        finally:
            with contextlib.suppress(Exception):
                log.flush()
            sys.stdout, sys.stderr = saved_streams
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            log.close()

    @contextlib.contextmanager
    def stage(self, name: str):
        """The stage's line while it runs; its last state stays on screen after."""
        line = StageLine(name, self)
        previous, self.line = self.line, line
        line.start()
        try:
            yield line
        finally:
            line.stop()
            self.line = previous


class StageLine:
    """One stage's progress: what its trainer or sampler reported, drawn on the terminal."""

    def __init__(self, stage: str, terminal: Terminal):
        self.stage, self.terminal = stage, terminal
        self.started = time.monotonic()
        self.description = ""
        self.done = self.total = 0
        self.counting_since: float | None = None  # when the current count began (for the rate and ETA)
        self.metrics: dict[str, float] = {}
        self.tokens: tuple[float, float] | None = None  # (time, count) when tokens were first reported
        self.status = "running"
        self._live = None
        self._lock = threading.Lock()
        self._last_plain = self.started
        self._quarters_shown = 0

    # -------------------------------------------------------------- fed by the stage's context

    def begin(self, description: str, total: int) -> None:
        with self._lock:
            self.description, self.total, self.done = description, max(int(total), 0), 0
            self.counting_since = time.monotonic()
            self._quarters_shown = 0
        self._refresh()

    def advance(self, amount: int = 1) -> None:
        with self._lock:
            self.done += amount
        self._refresh()
        self._maybe_plain()

    def metrics_logged(self, metrics: dict[str, float]) -> None:
        with self._lock:
            self.metrics.update(metrics)
            if "num_tokens" in metrics and self.tokens is None:
                self.tokens = (time.monotonic(), float(metrics["num_tokens"]))
        self._refresh()

    def alert(self, message: str) -> None:
        """A stage that learns nothing (stages/training/alerts.py): a warning above the live line, now."""
        from rich.markup import escape

        self.terminal.console.print(f"[bold yellow]  {self.stage}: alert[/bold yellow] {escape(message)}",
                                    highlight=False)

    # -------------------------------------------------------------- drawn

    def text(self) -> str:
        with self._lock:
            parts = [f"  {self.stage:<12}", self.status]
            if self.total:
                parts.append(f"{self.done}/{self.total}")
            for key, label in _HEADLINE:
                if key in self.metrics:
                    parts.append(f"{label} {self.metrics[key]:.3g}")
                    break
            rate = self._tokens_per_s()
            if rate:
                parts.append(f"{rate:,.0f} tokens/s")
            now = time.monotonic()
            if self.status == "running" and self.total and self.done and self.counting_since:
                eta = (now - self.counting_since) / self.done * (self.total - self.done)
                parts.append(f"ETA {_clock(eta)}")
            parts.append(f"{_clock(now - self.started)} elapsed" if self.status == "running"
                         else f"{now - self.started:.1f} s")
            return "  ".join(parts)

    def _tokens_per_s(self) -> float | None:
        if "generated_tokens_per_s" in self.metrics:
            return self.metrics["generated_tokens_per_s"]
        if self.tokens is None or "num_tokens" not in self.metrics:
            return None
        since, first = self.tokens
        seconds = time.monotonic() - since
        return (self.metrics["num_tokens"] - first) / seconds if seconds > 1 else None

    def start(self) -> None:
        if self.terminal.is_tty:
            from rich.live import Live
            from rich.text import Text

            self._live = Live(Text(self.text()), console=self.terminal.console, refresh_per_second=4,
                              transient=True, redirect_stdout=False, redirect_stderr=False,
                              get_renderable=lambda: Text(self.text(), no_wrap=True, overflow="ellipsis"))
            self._live.start()

    def stop(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
        self.terminal.console.print(self.text(), highlight=False, markup=False)

    def _refresh(self) -> None:
        if self._live is not None:
            self._live.refresh()

    def _maybe_plain(self) -> None:
        """Off a TTY: a plain line when the stage passes a quarter, at most every PLAIN_LINE_EVERY_S."""
        if self.terminal.is_tty or not self.total:
            return
        quarter = min(4 * self.done // self.total, 3)
        now = time.monotonic()
        if quarter > self._quarters_shown and now - self._last_plain >= PLAIN_LINE_EVERY_S:
            self._quarters_shown, self._last_plain = quarter, now
            self.terminal.console.print(self.text(), highlight=False, markup=False)


def _clock(seconds: float) -> str:
    seconds = max(int(seconds), 0)
    return f"{seconds // 60}:{seconds % 60:02d}"


# The terminal of the ``posttrain run`` in this process, if any: stages running in it (in the
# Prefect task, in this thread or another) draw their line there. Workers and ranks have none.
_ACTIVE: Terminal | None = None


def active() -> Terminal | None:
    return _ACTIVE


@contextlib.contextmanager
def activated(terminal: Terminal):
    global _ACTIVE
    previous, _ACTIVE = _ACTIVE, terminal
    try:
        yield terminal
    finally:
        _ACTIVE = previous


@contextlib.contextmanager
def stage_output(stage: str, log_path: Path):
    """Around one stage's execution: its line on the terminal of this process's ``posttrain run``
    (if any) and its output captured to ``log_path``; yields the line, or None without a terminal."""
    terminal = _ACTIVE
    if terminal is None:
        yield None
        return
    with terminal.stage(stage) as line, terminal.capture(log_path):
        try:
            yield line
        except BaseException:
            line.status = "failed"
            raise
        line.status = "done"


class RunLog:
    """The run's own log (what was written outside any stage): a temporary file until ``keep``
    moves it into ``$POSTTRAIN_HOME/logs/<pipeline>/``; refused input leaves nothing behind."""

    def __init__(self, pipeline: str):
        fd, name = tempfile.mkstemp(prefix="posttrain-run-", suffix=".log")
        os.close(fd)
        self.path = Path(name)
        self.pipeline = pipeline

    def keep(self) -> Path:
        from flows.recording.home import posttrain_home

        home = posttrain_home()
        if self.path.parent == Path(tempfile.gettempdir()) and home.is_dir() and self.path.exists():
            target = home / "logs" / self.pipeline / f"run-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(self.path, target)
            self.path = target
        return self.path


@contextlib.contextmanager
def run_log(pipeline: str):
    log = RunLog(pipeline)
    try:
        yield log
    finally:
        if log.path.parent == Path(tempfile.gettempdir()):
            log.path.unlink(missing_ok=True)
