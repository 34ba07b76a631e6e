"""What a stage may ask of the orchestrator: the tracking handle every ``run`` receives, a protocol that
``flows.recording.tracking`` implements on MLflow, so that ``stages/`` stays free of Prefect."""

from __future__ import annotations

import typing
from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol

from pydantic import ConfigDict, Field

from stages.spec_model import SpecModel

# How a stage executes, not what it computes: out of the fingerprint, so the cache and resume state stay
EXECUTION_FIELDS = frozenset({"save_steps", "time_limit_minutes", "resources", "placement", "alerts"})
ALERT_TAG = "posttrain.alert"
# The tag a resumed stage sets: JSON {"step": k, "run": the run that stopped at step k, "checkpoint": its path}
RESUMED_TAG = "posttrain.resumed_from"


class StageTimeLimit(Exception):
    """A stage ran past its ``time_limit_minutes`` (a stage failure, not a transient one)."""


class Resources(SpecModel):
    """Where and on what a stage runs (never part of what it computes: not in its fingerprint)."""

    model_config = ConfigDict(extra="forbid")
    renamed: ClassVar[dict[str, str]] = {"accelerate_config": "strategy"}

    pool: str | None = Field(
        None, description="Prefect work pool that runs this stage (through the `posttrain-stage/<pool>` "
        "deployment, with run_deployment); unset: in the orchestrating process.",
    )
    gpus: int = Field(0, ge=0, le=64, description="GPUs the stage needs (per node with `nodes`); passed to the "
                      "pool's job template as the `gpus` job variable, and with more than one, one training "
                      "process per GPU.")
    processes: int = Field(1, ge=1, le=64, description="Training processes (data parallel) for sft, reward_model, "
                           "dpo, kto and rl stages. On CPU: N gloo processes through torchrun; on GPUs: "
                           "`accelerate launch` with `strategy`. Batch sizes stay global (split over the processes).")
    strategy: Literal["ddp", "fsdp", "zero3"] = Field(
        "ddp", description="How several GPUs train: infra/accelerate/<strategy>.yaml (DDP, FSDP, or DeepSpeed "
        "ZeRO-3 with the `gpu` extra). CPU processes train with DDP only.")

    nodes: int = Field(1, ge=1, le=64, description="Machines training this stage together (multi-node): more "
                       "than 1 needs a Kubernetes work pool (`pool`) and `gpus` per node; the pool's job template "
                       "runs it as an indexed Job of `nodes` pods joined by torchrun's rendezvous on pod 0.")

    def per_node(self) -> int:
        return max(self.processes, self.gpus, 1)

    def world_size(self) -> int:
        return self.nodes * self.per_node()


class ExecutionLimits(SpecModel):
    """Fields every stage kind shares."""

    resources: Resources | None = Field(
        None, description="Work pool, GPUs and processes for this stage; default the pipeline's `resources`.")

    time_limit_minutes: float | None = Field(
        None, gt=0,
        description="Stop the stage after this many minutes: a training stage stops after its current "
        "optimizer step and keeps a resumable checkpoint; any stage is stopped at most 30 s after the limit. "
        "The run is marked FAILED with what it got done.",
    )


CHECKPOINT_INPUTS = ("model", "policy", "reference", "critic", "reward_model", "failures")
SCORER_PREFIX = "rewards."  # ``rewards.<name>``: the checkpoint a reward scores or judges with


@dataclass(frozen=True)
class StageKind:
    """A stage kind (``KIND`` in its module, listed in stages/registry.py): what a config instance does not say."""

    name: str
    config: Any  # its config model, or a discriminated union of them (rl: one model per algorithm)
    run: Any
    headline_metrics: tuple[str, ...]  # the summary's columns, most telling first (`pass_at_*`: a prefix)
    produces: Literal["policy", "reward_model"] | None = None
    trains: bool = True  # reads training data: a heldout dataset is refused, a failure set may feed it
    evaluates: bool = False  # scores a checkpoint: its runs are ranked by `posttrain compare` and linked to the model
    reads: Literal["demonstrations", "prompts"] | None = None  # what it needs of a conversation record
    # (config, world, resources) -> why it cannot train on `world` processes; None: one process only
    world_issues: Any = None

    # a union config's chooser: raw stage mapping -> its model (the common base when it names none)
    choose: Any = None

    def config_models(self) -> tuple[type, ...]:
        """Its config model, or each member of its union."""
        if isinstance(self.config, type):
            return (self.config,)
        union = typing.get_args(self.config)[0]
        return tuple(typing.get_args(member)[0] for member in typing.get_args(union))

    def model_for(self, value) -> type:
        """The config model of a raw stage mapping: what the lenient parse builds when it does not validate."""
        return self.config if self.choose is None else self.choose(value)


def references_to(**stages: str | None) -> dict[str, str]:
    """A stage config's ``references()``: field name -> the stage it names, fields left unset dropped."""
    return {field: stage for field, stage in stages.items() if stage is not None}


def no_world_issues(config, world: int, resources) -> list[str]:
    """A kind that trains on any number of processes under the orchestrator's generic rules."""
    return []


@dataclass(frozen=True)
class StageInputs:
    """Everything a stage reads, as local paths and typed specs, the same on every rank."""

    trust_remote_code: bool = False  # the pipeline's trust in its model's own code (off unless it says so)
    datasets: Mapping[str, Path] = field(default_factory=dict)  # what it reads, by declared name, as JSONL
    model: Path | None = None
    policy: Path | None = None
    reference: Path | None = None
    critic: Path | None = None
    reward_model: Path | None = None
    failures: Path | None = None
    scorer_checkpoints: Mapping[str, Path] = field(default_factory=dict)  # reward -> its reward model's / judge's
    judge_cache: Path | None = None  # judge replies by (judge, rubric, prompt, completion); None: no cache
    rewards: Mapping[str, Any] = field(default_factory=dict)  # reward name -> stages.rewards.spec.RewardSpec
    reward_checks: Mapping[str, list] = field(default_factory=dict)  # reward name -> its known cases
    base_dir: Path | None = None  # the pipeline file's folder, where a stage's own relative paths point

    def __post_init__(self):
        for name in _PATH_FIELDS:
            if getattr(self, name) is not None:
                object.__setattr__(self, name, Path(getattr(self, name)))
        object.__setattr__(self, "datasets", {k: Path(v) for k, v in self.datasets.items()})
        object.__setattr__(self, "scorer_checkpoints", {k: Path(v) for k, v in self.scorer_checkpoints.items()})

    @property
    def data(self) -> Path | None:
        return next(iter(self.datasets.values()), None)

    def with_data(self, path: Path) -> StageInputs:
        """These inputs reading ``path`` in place of the stage's dataset (a filtered or mixed copy of it)."""
        if not self.datasets:
            raise ValueError("the stage reads no dataset to replace")
        first = next(iter(self.datasets))
        return replace(self, datasets={**self.datasets, first: Path(path)})

    def scorer_checkpoint(self, reward: str, what: str) -> Path:
        """The checkpoint reward ``reward`` scores with; ``what`` says with what, for the error."""
        if reward not in self.scorer_checkpoints:
            raise ValueError(f"reward {reward!r} {what}, but the stage received no checkpoint for it")
        return self.scorer_checkpoints[reward]

    def with_paths(self, paths: Mapping[str, str]) -> StageInputs:
        """These inputs with the paths of ``paths()`` (as another process resolved them) in place."""
        scorers = {k[len(SCORER_PREFIX):]: Path(v) for k, v in paths.items() if k.startswith(SCORER_PREFIX)}
        datasets = {k[len("data."):]: Path(v) for k, v in paths.items() if k.startswith("data.")}
        plain = {k: Path(v) for k, v in paths.items() if k in _PATH_FIELDS}
        return replace(self, **plain, scorer_checkpoints={**self.scorer_checkpoints, **scorers},
                       datasets={**self.datasets, **datasets})

    def paths(self) -> dict[str, str]:
        """Every path, flat (``data``, ``data.<name>``, ``rewards.<reward>``, ...): ``input.*`` params, the ranks'."""
        flat = {name: str(getattr(self, name)) for name in _PATH_FIELDS if getattr(self, name) is not None}
        if self.data is not None:
            flat["data"] = str(self.data)  # what iterate reads back from a collect run's ``input.data``
        flat.update({f"data.{name}": str(path) for name, path in self.datasets.items()})
        flat.update({f"{SCORER_PREFIX}{name}": str(path) for name, path in self.scorer_checkpoints.items()})
        return flat


_PATH_FIELDS = ("judge_cache", "base_dir", *CHECKPOINT_INPUTS)


class Progress(Protocol):
    def advance(self, amount: int = 1) -> None: ...


class StageContext(Protocol):
    seed: int
    """The stage's seed (the pipeline seed unless the stage sets its own)."""
    work_dir: Path
    """Scratch space for this execution; may hold partial state after a failure."""
    deadline: float | None
    """``time.monotonic()`` by which the stage must stop (its time limit), or None."""
    resume_dir: Path
    """Trainer checkpoints that outlive a crash: the next execution of the same stage (same
    fingerprint) finds them here and resumes; removed once the stage is published."""
    run_id: str
    """This execution's run (what a checkpoint names as the run that wrote it)."""

    def output_dir(self, name: str) -> Path:
        """A fresh staging dir for an output; published (moved and logged) only on success."""

    def output_file(self, name: str) -> Path:
        """A staging path for a file output; published only on success."""

    def log_params(self, params: dict[str, Any]) -> None: ...

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None: ...

    def set_tags(self, tags: dict[str, str]) -> None: ...

    def log_table(self, rows: list[dict[str, Any]], name: str) -> None: ...

    def log_figure(self, figure: Any, name: str) -> None: ...

    def progress(self, description: str, total: int) -> AbstractContextManager[Progress]: ...
