"""What the speed benchmarks in bench/ share: an isolated home, the quickstart's tiny model
and data, a real MLflow stage context, and interleaved timing with medians.

Every benchmark compares two things inside one process, alternating them (A B, B A, ...,
after an untimed warm-up of each) and reports the median of each and the median of the
per-round ratios, so load from other jobs on a shared machine hits both sides alike.
"""

from __future__ import annotations

import atexit
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def isolated_home() -> Path:
    """A throwaway $POSTTRAIN_HOME with the embedded defaults (local SQLite MLflow store).

    Must run before mlflow / prefect / the stages are imported."""
    home = Path(tempfile.mkdtemp(prefix="posttrain-bench-"))
    atexit.register(shutil.rmtree, home, ignore_errors=True)
    os.environ["POSTTRAIN_HOME"] = str(home)
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    warnings.filterwarnings("ignore")
    from flows.recording.home import configure_environment

    configure_environment()
    import logging

    import mlflow  # noqa: F401  (configures its loggers on import; quieten them after)
    import transformers

    logging.getLogger("mlflow").setLevel(logging.WARNING)
    transformers.utils.logging.disable_progress_bar()  # "Loading weights" bars on every load
    return home


def one_thread() -> None:
    """Pin torch to one thread: a tiny model gains nothing from more, and spinning OpenMP
    threads on a shared 2-core box make timings swing wildly (tests/test_ppo.py)."""
    import torch

    torch.set_num_threads(1)


def tiny_checkpoint(home: Path, seed: int = 0) -> Path:
    """The quickstart's base model (~0.34M parameters; its spec is the TinyModelSpec defaults)."""
    from stages.models.loading import TinyModelSpec, resolve_base_checkpoint

    return resolve_base_checkpoint(TinyModelSpec(init="tiny"), seed, home / "cache", home)


def arithmetic_data(home: Path, n: int, role: str = "train", seed: int = 0) -> Path:
    """The quickstart's arithmetic questions, materialised to JSONL."""
    from stages.data.sources import ArithmeticData, materialize

    spec = ArithmeticData(generator="arithmetic", n=n, seed=seed, role=role,
                          demo_error_rate=0.35 if role == "train" else 0.0)
    return materialize(spec, Path("."), home / "cache")


class StageContexts:
    """Real MLflow stage contexts (the tests' ``ctx_factory``): one child run per call."""

    def __init__(self, home: Path, experiment: str = "bench"):
        from flows.recording.tracking import Tracker

        self.home = home
        self.tracker = Tracker(home)
        self.experiment = self.tracker.experiment_id(experiment, None)
        self.parent = self.tracker.start_pipeline_run(self.experiment, experiment, {})

    def make(self, name: str, seed: int = 0):
        from rich.console import Console

        from flows.recording.tracking import MlflowStageContext

        run_id = self.tracker.start_stage_run(self.experiment, self.parent, name, {})
        # progress bars still run (rich's refresh thread included), they just print nowhere
        return MlflowStageContext(self.tracker, run_id, self.home / "work" / run_id, seed=seed,
                                  console=Console(quiet=True))


def time_tracking_calls(ctx) -> dict[str, list[float]]:
    """Seconds of every MLflow call a stage context makes, by method (wraps this instance only)."""
    spent: dict[str, list[float]] = {}
    for name in ("log_metrics", "log_params", "log_table", "log_figure", "set_tags"):
        original = getattr(ctx, name)
        calls = spent.setdefault(name, [])

        def timed(*args, _original=original, _calls=calls, **kwargs):
            started = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                _calls.append(time.perf_counter() - started)

        setattr(ctx, name, timed)
    return spent


def interleaved(candidates: dict[str, Callable[[], float | None]], repeats: int,
                warmup: bool = True) -> dict[str, list[float]]:
    """Run every candidate ``repeats`` times, alternating them, and collect seconds.

    A candidate returns the seconds to count (when it times only part of itself) or None
    (then its whole call is timed). The order alternates each round (A B, B A, ...) so a
    candidate is not always the one that runs right after the other's garbage. With
    ``warmup``, each runs once untimed first (lazy imports, first-call allocations).
    """
    names = list(candidates)
    if warmup:
        for name in names:
            candidates[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(repeats):
        for name in (names if round_ % 2 == 0 else names[::-1]):
            started = time.perf_counter()
            measured = candidates[name]()
            times[name].append(measured if measured is not None else time.perf_counter() - started)
        print("  round " + str(round_ + 1) + ": " +
              "  ".join(f"{name} {times[name][-1]:.3f}s" for name in names), flush=True)
    return times


def median(values: list[float]) -> float:
    return statistics.median(values)


def spread(values: list[float]) -> str:
    """``median [min..max]`` in seconds, for the report."""
    return f"{median(values):.3f}s [{min(values):.3f}..{max(values):.3f}]"


def paired_ratio(numerator: list[float], denominator: list[float]) -> float:
    """Median of the per-round ratios: each pair ran back to back, under the same load."""
    return statistics.median(a / b for a, b in zip(numerator, denominator))


def print_summary(summary: dict, out: Path | None) -> None:
    """Print a benchmark's JSON summary last, and write it to ``out`` too when given."""
    import json

    text = json.dumps(summary, indent=2)
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n", encoding="utf-8")
