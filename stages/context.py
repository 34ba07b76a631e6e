"""What a stage may ask of the orchestrator: the tracking handle every ``run`` receives.

Stages depend on this protocol only; ``flows.tracking`` implements it on MLflow. Keeping
it a protocol is what lets ``stages/`` stay free of Prefect and of pipeline YAML.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol


class Progress(Protocol):
    def advance(self, amount: int = 1) -> None: ...


class StageContext(Protocol):
    seed: int
    """The stage's seed (the pipeline seed unless the stage sets its own)."""
    work_dir: Path
    """Scratch space for this execution; may hold partial state after a failure."""

    def output_dir(self, name: str) -> Path:
        """A fresh staging dir for an output; published (moved and logged) only on success."""

    def output_file(self, name: str) -> Path:
        """A staging path for a file output; published only on success."""

    def log_params(self, params: dict[str, Any]) -> None: ...

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None: ...

    def set_tags(self, tags: dict[str, str]) -> None: ...

    def log_table(self, rows: list[dict[str, Any]], name: str) -> None:
        """A table (e.g. sample completions) shown in MLflow's artifact view."""

    def log_figure(self, figure: Any, name: str) -> None:
        """A matplotlib figure, saved as PNG and logged."""

    def progress(self, description: str, total: int) -> AbstractContextManager[Progress]:
        """A progress bar for long work."""
