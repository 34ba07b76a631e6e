"""Iterating from failure cases: the ``iterate:`` block, its checks, and the rounds it unrolls into.

```yaml
iterate: {rounds: 2, collect: eval_probe, train: sft, mix: 0.5}
```

Round 1 is the pipeline as written. Round r >= 2 (unrolled by ``flows.planning.graph.expand_rounds``)
reruns ``train`` and every stage downstream of it as *steps* named ``<stage>@<r>`` (``sft@2``, ``eval_probe@2``); stages
upstream of ``train`` (and those beside it) are shared by all rounds and run once.
``train@r`` starts from the same checkpoint as ``train`` (its upstream is shared) and
trains on its own dataset mixed with the failure set that ``collect`` wrote in round
r-1 (``stages/data/failures.py`` says how: ``mix`` is the share of examples drawn from the
failure set). The unrolled stages are ordinary stages to the graph, the planner and the
Prefect flow: ``train@r`` reads ``collect@(r-1)`` as its input ``failures``, so that run id
enters its fingerprint beside ``mix``, and a rerun of an unchanged pipeline is a cache hit
in every round. ``--from sft@2`` reruns round 2 onwards.

Leakage: ``collect`` must evaluate a dataset of role ``probe`` (the validator refuses
heldout and train), and when a round's data is built the failure set's source is checked
again against the spec and against the collect run's own record in MLflow.

Every step's run is tagged ``posttrain.round`` (and ``posttrain.round_of``, the stage it
repeats); ``train@r`` is tagged with the failure set it trained on
(``posttrain.failure_set`` = ``runs:/<collect run>/outputs/failures.jsonl`` and its sha256).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from flows.recording.tags import (
    TAG_FAILURE_SET,
    TAG_FAILURE_SET_SHA256,
    TAG_ROUND,
    TAG_ROUND_OF,
)

ROUND_SEPARATOR = "@"  # stage names cannot hold it, so a step name never collides with a stage
FAILURES_INPUT = "failures"  # the input of train@r that names round r-1's collect step
FAILURE_ARTIFACT = "outputs/failures.jsonl"  # where an eval run publishes its failure set
ITERABLE_KINDS = ("sft", "rl")  # training kinds that read conversations / prompts a failure set can feed
MIX_RECIPE = 1  # bump when stages/data/failures.py changes what a given mix produces (part of the fingerprint)


class LeakageError(RuntimeError):
    """Data that must never reach training was about to (a heldout dataset's failures)."""


# ------------------------------------------------------------------ step names


def step_name(stage: str, round_: int) -> str:
    return stage if round_ == 1 else f"{stage}{ROUND_SEPARATOR}{round_}"


def split_step(step: str) -> tuple[str, int]:
    """``sft@2`` -> (``sft``, 2); a plain stage name is round 1."""
    stage, sep, number = step.rpartition(ROUND_SEPARATOR)
    return (stage, int(number)) if sep and number.isdigit() else (step, 1)


@dataclass(frozen=True)
class FailureFeed:
    """What ``train@r`` reads besides its own dataset."""

    step: str  # train@r
    round: int
    collect: str  # collect@(r-1)
    mix: float


def round_feed(pipeline, step: str) -> FailureFeed | None:
    """The feed of a step that trains on failures (``iterate.train`` at round >= 2), else None."""
    spec = getattr(pipeline, "iterate", None)
    stage, round_ = split_step(step)
    if spec is None or stage != spec.train or round_ < 2 or step not in pipeline.stages:
        return None
    return FailureFeed(step, round_, step_name(spec.collect, round_ - 1), spec.mix)


# ------------------------------------------------------------------ what the planner asks of a step


def failure_references(pipeline, step: str) -> dict[str, str]:
    """The extra upstream edge of ``train@r``: ``{"failures": collect@(r-1)}``."""
    feed = round_feed(pipeline, step)
    return {FAILURES_INPUT: feed.collect} if feed else {}


@dataclass(frozen=True)
class RoundStep:
    """One step of an iterating pipeline, as the planner hands it on (``StageJob.round``): the rest of
    posttrain knows a round only through this object, never through the ``iterate:`` block."""

    step: str  # sft@2
    stage: str  # sft: the stage it repeats
    round: int
    feed: FailureFeed | None  # what it trains on besides its own dataset (iterate.train at round >= 2)

    def tags(self) -> dict[str, str]:
        return {TAG_ROUND: str(self.round), TAG_ROUND_OF: self.stage}

    def fingerprint(self) -> dict:
        """What a round's data adds to a fingerprint (the collect run id enters as an upstream run)."""
        return {"iterate": {"mix": self.feed.mix, "recipe": MIX_RECIPE}} if self.feed else {}

    def training_inputs(self, loaded, inputs, upstream_runs: dict[str, str], tracker, recorder, home: Path):
        """The stage's inputs, its data swapped for the round's mix where it trains on failures (and which
        failure set it trained on recorded); unchanged otherwise."""
        if self.feed is None:
            return inputs
        return failure_set_inputs(loaded, self.feed, inputs, upstream_runs, tracker, recorder, home)


def round_step(pipeline, step: str) -> RoundStep | None:
    """The round of ``step`` where the pipeline iterates, else None."""
    if getattr(pipeline, "iterate", None) is None:
        return None
    stage, round_ = split_step(step)
    return RoundStep(step, stage, round_, round_feed(pipeline, step))


# ------------------------------------------------------------------ validation


def downstream(edges: dict[str, list[str]], stage: str) -> set[str]:
    """Every stage that reads, directly or not, from ``stage`` in a stage -> upstream graph."""
    found, changed = set(), True
    while changed:
        changed = False
        for name, ups in edges.items():
            if name not in found and (stage in ups or found & set(ups)):
                found.add(name)
                changed = True
    return found


def iterate_issues(raw_iterate, stages: dict, raw_data: dict, raw_rewards: dict,
                   edges: dict[str, list[str]]) -> list[tuple[tuple, str]]:
    """(YAML path, message) for each way the ``iterate:`` block cannot work or would leak."""
    if not isinstance(raw_iterate, dict):
        return []  # absent, or a type error already reported
    issues = []
    train, collect = raw_iterate.get("train"), raw_iterate.get("collect")
    train_ok = collect_ok = False

    def unknown(key, name):
        issues.append((("iterate", key), f"unknown stage {name!r}; stages: {', '.join(stages)}"))

    if isinstance(train, str):
        if train not in stages:
            unknown("train", train)
        elif stages[train].kind not in ITERABLE_KINDS:
            issues.append((("iterate", "train"), f"stage {train!r} is kind {stages[train].kind}; iterate.train must "
                           f"be a training stage that reads conversations or prompts ({', '.join(ITERABLE_KINDS)})"))
        else:
            train_ok = True
    if isinstance(collect, str):
        if collect not in stages:
            unknown("collect", collect)
        elif stages[collect].kind != "eval":
            issues.append((("iterate", "collect"), f"stage {collect!r} is kind {stages[collect].kind}; iterate.collect "
                           "must be an eval stage (its failure cases are what the next round trains on)"))
        else:
            data_name = getattr(stages[collect], "data", None)
            role = raw_data.get(data_name, {}).get("role") if isinstance(raw_data.get(data_name), dict) else None
            if role == "heldout":
                issues.append((("iterate", "collect"), f"eval stage {collect!r} evaluates dataset {data_name!r}, role "
                               "heldout: its failures would feed training (leakage guard: heldout data is only ever "
                               "evaluated); collect from an eval stage on a dataset with role probe"))
            elif role is not None and role != "probe":
                issues.append((("iterate", "collect"), f"eval stage {collect!r} evaluates dataset {data_name!r}, role "
                               f"{role}; failures are collected on a dataset with role probe (kept apart from the "
                               "training data, and from the heldout data that measures the rounds)"))
            else:
                collect_ok = role == "probe"
    if train_ok and collect_ok and collect not in downstream(edges, train):
        issues.append((("iterate", "collect"), f"eval stage {collect!r} does not evaluate a checkpoint of {train!r} "
                       f"or of a stage downstream of it, so its failures would not change from round to round; "
                       f"collect from an eval stage downstream of iterate.train"))
    if train_ok:
        repeated = {train} | downstream(edges, train)
        for reward_name, reward in raw_rewards.items():
            if isinstance(reward, dict) and reward.get("stage") in repeated:
                issues.append((("iterate", "train"), f"stage {reward['stage']!r} is {train!r} or downstream of it, "
                               f"so every round retrains it, but reward {reward_name!r} names it: a reward cannot "
                               "follow the rounds; iterate a stage downstream of the reward model instead"))
    return issues


# ------------------------------------------------------------------ a round's training data


@dataclass
class RoundData:
    path: Path
    failures_sha256: str
    counts: dict[str, int]


def guard_failure_source(loaded, feed: FailureFeed, recorded_input: str | None) -> None:
    """Raise LeakageError unless the failure set comes from a probe dataset.

    Checked twice: against the spec (the collect step's dataset and its role), and against
    what the collect run itself recorded in MLflow as its ``input.data`` (a content-keyed
    file name), so a failure set from any other dataset, heldout above all, is refused.
    """
    from stages.data.sources import data_key

    spec = loaded.spec
    data_name = spec.stages[feed.collect].data
    role = spec.data[data_name].role
    if role != "probe":
        raise LeakageError(f"{feed.step} would train on the failures of {feed.collect}, which evaluates dataset "
                           f"{data_name!r} with role {role}; only a probe dataset's failures may feed training")
    if recorded_input is None:
        return
    recorded_key = Path(recorded_input).stem
    heldout = [n for n, d in spec.data.items() if d.role == "heldout" and data_key(d, loaded.base_dir, spec.data) == recorded_key]
    if heldout:
        raise LeakageError(f"the run of {feed.collect} that wrote this failure set evaluated heldout dataset "
                           f"{heldout[0]!r}; its failures must never reach training ({feed.step})")
    if recorded_key != data_key(spec.data[data_name], loaded.base_dir, spec.data):
        raise LeakageError(f"the run of {feed.collect} that wrote this failure set evaluated {recorded_input}, not "
                           f"probe dataset {data_name!r}; refusing to train {feed.step} on it")


def build_round_data(loaded, feed: FailureFeed, failures_path: Path, recorded_input: str | None,
                     cache_dir: Path) -> RoundData:
    """Materialise train@r's mixed dataset, content-keyed under ``cache_dir`` (written atomically)."""
    from stages.data.sources import materialize, read_materialized
    from stages.data.failures import (
        failure_training_records,
        mix_records,
        read_failures,
        write_records,
    )

    guard_failure_source(loaded, feed, recorded_input)
    spec = loaded.spec
    config = spec.stages[feed.step]
    original_path = materialize(spec.data[config.data], loaded.base_dir, cache_dir, spec.data)
    failures_sha256 = hashlib.sha256(Path(failures_path).read_bytes()).hexdigest()
    from_failures = failure_training_records(read_failures(failures_path), demonstrations=config.kind == "sft",
                                             where=f"failure set of {feed.collect}")
    seed = f"{spec.seed_for(feed.step)}:{feed.round}"
    records, counts = mix_records(read_materialized(original_path), from_failures, feed.mix, seed)
    key = hashlib.sha256(json.dumps({"original": original_path.name, "failures": failures_sha256, "mix": feed.mix,
                                     "seed": seed, "kind": config.kind, "recipe": MIX_RECIPE},
                                    sort_keys=True).encode()).hexdigest()[:16]
    target = cache_dir / f"iterate-{key}.jsonl"
    if not target.exists():
        write_records(records, target)
    return RoundData(target, failures_sha256, counts)


def failure_set_inputs(loaded, feed: FailureFeed, inputs, upstream_runs: dict[str, str], tracker, recorder,
                       home: Path):
    """For ``train@r``: swap its data for the round's mix and record which failure set it trained on."""
    collect_run = upstream_runs[feed.collect]
    recorded_input = tracker.get_run(collect_run).data.params.get("input.data")
    built = build_round_data(loaded, feed, inputs.failures, recorded_input, home / "cache" / "data")
    recorder.tags({TAG_FAILURE_SET: f"runs:/{collect_run}/{FAILURE_ARTIFACT}",
                   TAG_FAILURE_SET_SHA256: built.failures_sha256})
    recorder.params({"iterate.round": feed.round, "iterate.mix": feed.mix, "iterate.collect": feed.collect,
                     "iterate.failure_set_run_id": collect_run, "iterate.failure_set_artifact": FAILURE_ARTIFACT,
                     **{f"iterate.{name}": value for name, value in built.counts.items()}})
    return inputs.with_data(built.path)
