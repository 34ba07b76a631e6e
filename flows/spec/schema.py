"""The pipeline's schema: the typed pydantic models a pipeline YAML validates into, and what
an issue with one looks like (its YAML path, message and line).

Loading (``flows/spec/loading.py``) and the cross-field checks (``flows/spec/validate.py``) both build on it.
"""

from __future__ import annotations

import difflib
import json
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from stages.context import Resources
from stages.data.sources import DataSpec
from stages.models.loading import ModelSpec
from stages.registry import STAGE_KINDS
from stages.rewards.known_cases import RewardCase
from stages.rewards.spec import RewardSpec
from stages.spec_model import NAME_PATTERN, SpecModel


def stage_kind(value) -> str | None:
    if isinstance(value, BaseModel):
        return getattr(value, "kind", None)
    kind = value.get("kind") if isinstance(value, dict) else None
    return kind if isinstance(kind, str) else None  # `kind: [sft]` is no kind (and unhashable)


StageSpec = Annotated[
    Union[tuple(Annotated[kind.config, Tag(name)] for name, kind in STAGE_KINDS.items())],
    Discriminator(stage_kind),
]


class IterateSpec(SpecModel):
    """Rounds of training on the failures evaluation collected (what the rounds do: flows/planning/iterate.py)."""

    model_config = ConfigDict(extra="forbid")

    rounds: int = Field(ge=1, le=100, description="Rounds in all; round 1 is the pipeline as written.")
    collect: str = Field(description="Eval stage whose failure cases (prompts with no correct attempt) feed the "
                         "next round; it must evaluate a `probe` dataset and be downstream of `train`.")
    train: str = Field(description="Training stage (sft or rl) rerun each round on its data mixed with the "
                       "previous round's failures; it and everything downstream of it repeat.")
    mix: float = Field(0.5, ge=0.0, le=1.0, description="Share of the round's training examples drawn from the "
                       "failure set (repeated to fill it); the rest come from `train`'s own dataset, and the "
                       "total stays that dataset's size. For sft a failure's demonstration is its expected answer.")


class SweepSpec(SpecModel):
    """Variants of the pipeline that `posttrain sweep` runs together: every seed times every grid point."""

    model_config = ConfigDict(extra="forbid")

    seeds: list[int] | None = Field(
        None, min_length=1, description="Pipeline seeds each variant runs with (`--set seed=S`); default the "
        "pipeline's own `seed`. `posttrain sweep --seeds` replaces them.")
    grid: dict[str, list[Union[int, float, bool, str]]] = Field(
        default_factory=dict, description="Override path (the `--set` syntax, e.g. `stages.grpo.kl_beta`) -> the "
        "values it takes; the variants are every combination. `posttrain sweep --grid PATH=V1,V2` adds or "
        "replaces a path.")
    parallel: int | None = Field(
        None, ge=1, description="Variants run side by side, at most this many at once, where the pipeline sends "
        "stages to work pools: each pooled stage runs on a worker while other variants' stages run on others. "
        "Stages run in this process still run one at a time. Default: every variant at once when a stage "
        "names a pool, else one after another. `posttrain sweep --parallel N` replaces it.")


class Pipeline(SpecModel):
    """One post-training pipeline: a base model, datasets, rewards and stages."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(
        pattern=rf"^{NAME_PATTERN}$",
        description="Pipeline name (1-64 letters, digits, '_', '.', '-'); also the MLflow experiment name.",
    )
    seed: int = Field(0, description="Seed for model initialisation and for stages that set none.")
    model: ModelSpec = Field(description="The base model every chain starts from (`base` in stage references).")
    data: dict[str, DataSpec] = Field(min_length=1, description="Datasets by name, each with a role.")
    rewards: dict[str, RewardSpec] = Field(
        default_factory=dict, description="Named rewards; built-in names may also be used directly."
    )
    stages: dict[str, StageSpec] = Field(min_length=1, description="Stages by name; references form the graph.")
    reward_checks: dict[str, list[RewardCase]] = Field(
        default_factory=dict,
        description="Known cases per reward (successes, failures, malformed, shortcuts) that "
        "`posttrain check-reward` and `check_rewards: true` verify before training.",
    )
    resources: Resources | None = Field(
        None, description="Default work pool / GPUs / processes for every stage that sets no `resources`.")
    iterate: IterateSpec | None = Field(
        None, description="Rounds of training on the failure cases an eval stage collected (flows/planning/iterate.py).")
    sweep: SweepSpec | None = Field(
        None, description="Seeds and a grid of overrides that `posttrain sweep` runs as one flow; `posttrain run` "
        "ignores it (flows/sweep.py).")

    def seed_for(self, stage: str) -> int:
        """A stage's seed: its own when it sets one (0 included), else the pipeline's."""
        own = getattr(self.stages[stage], "seed", None)
        return self.seed if own is None else own

    def resources_for(self, stage: str) -> Resources:
        """A stage's resources: its own, else the pipeline default, else in-process on one process."""
        return self.stages[stage].resources or self.resources or Resources()


# ------------------------------------------------------------------ errors


@dataclass
class SpecIssue:
    path: str
    message: str
    line: int | None = None

    def render(self, source: str) -> str:
        where = f"{source}:{self.line}: " if self.line else f"{source}: "
        message = " ".join(part.strip() for part in self.message.splitlines())  # one issue, one line
        return f"{where}{self.path + ': ' if self.path else ''}{message}"


class SpecError(Exception):
    """A pipeline that must not run; holds every issue found."""

    def __init__(self, source: str, issues: list[SpecIssue]):
        self.source = source
        self.issues = issues
        super().__init__("\n".join(issue.render(source) for issue in issues))


@dataclass
class LoadedPipeline:
    spec: Pipeline
    path: Path
    overrides: list[str] = field(default_factory=list)

    @property
    def base_dir(self) -> Path:
        return self.path.parent.resolve()

    def rewards_for(self, names: list[str]) -> dict[str, RewardSpec]:
        """Reward specs by name: declared ones, else the built-in of that name."""
        return {n: self.spec.rewards.get(n) or RewardSpec(fn=n) for n in names}


def line_for(lines: dict[tuple, int], path: tuple) -> int | None:
    while path:
        if path in lines:
            return lines[path]
        path = path[:-1]
    return None


def dotted(path: tuple) -> str:
    """``stages.sft.max_steps``; a key that is empty or holds a space, dot or colon is quoted (``stages."a b"``)."""
    return ".".join(str(p) if re.fullmatch(r"[^\s.:\"]+", str(p)) else json.dumps(str(p)) for p in path)



def did_you_mean(word: str, options) -> str:
    close = difflib.get_close_matches(str(word), [str(o) for o in options], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def unwrap_type(tp):
    """Strip Annotated / Optional; return (origin type, tagged union members or None)."""
    while typing.get_origin(tp) is Annotated:
        tp = typing.get_args(tp)[0]
    if typing.get_origin(tp) in (Union, getattr(__import__("types"), "UnionType", Union)):
        members = {}
        for arg in typing.get_args(tp):
            tag = None
            if typing.get_origin(arg) is Annotated:
                tag = next((m.tag for m in typing.get_args(arg)[1:] if isinstance(m, Tag)), None)
                arg = typing.get_args(arg)[0]
            if arg is type(None):
                continue
            members[tag or getattr(arg, "__name__", str(arg))] = arg
        if len(members) == 1:  # ``X | None``; X may be a union itself (an optional ModelSpec): unwrap it too
            return unwrap_type(next(iter(members.values())))
        return tp, members
    return tp, None
