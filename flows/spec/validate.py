"""The validator's checks across fields: references, leakage, rewards, data, models, resources.

Each collector takes what the lenient parse could make of the pipeline (``_Draft``) and
returns ``(YAML path, message)`` pairs; ``semantic_issues`` runs them all, so a user sees
every problem at once, next to the structural errors ``flows/spec/loading.py`` reports.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from pydantic import TypeAdapter, ValidationError

from flows.planning.graph import BASE, graph_issues
from flows.spec.schema import (
    SpecIssue,
    StageSpec,
    did_you_mean,
    dotted,
    line_for,
    stage_kind,
    unwrap_type,
)
from stages.context import Resources
from stages.data.sources import (
    ArithmeticData,
    DataError,
    DataSpec,
    FileData,
    HubData,
    MixtureData,
    ReasoningGymData,
    holds_preferences,
    load_records,
    located_file_records,
    prompt_messages,
    prompt_text,
)
from stages.models.loading import (
    GGUFModelSpec,
    HubModelSpec,
    ModelSpec,
    PathModelSpec,
    chat_template_problem,
    check_checkpoint_dir,
)
from stages.models.pretrained import (
    GGUF_SUFFIX,
    ModelSourceError,
    cached_hub_snapshot,
    gguf_reader_problem,
    hub_problem,
    locate_gguf,
)
from stages.rollout.environments import EnvironmentLoadError, has_own_score, load_environment_class
from stages.registry import STAGE_KINDS
from stages.rewards.registry import BUILTIN_REWARDS, import_dotted, load_reward_fn
from stages.rewards.spec import ENVIRONMENT_FN, JUDGE_FN, REASONING_GYM_FN, REWARD_MODEL_FN, RewardError, RewardSpec
from stages.rewards.schemas import RECORD_READERS, kwargs_issues, record_problem
from stages.rewards.sandbox import ISOLATION_MODES
from stages.spec_model import (
    KEY_NAME_PATTERN,
    MISSING,
    condition_holds,
    condition_paths,
    condition_text,
    name_problem,
    read_path,
    set_fields,
)


# ------------------------------------------------------------------ semantic checks


def _partial(adapter: TypeAdapter, values: dict) -> dict:
    """The entries that validate on their own (so semantic checks run despite other errors)."""
    good = {}
    for name, value in (values or {}).items():
        try:
            good[name] = adapter.validate_python(value)
        except ValidationError:
            pass
    return good


def _lenient_stages(raw_stages: dict) -> tuple[dict, set, dict]:
    """Every stage of a known kind, validated if it can be, else built without validation; the names of those
    that validated; and per stage the fields that failed their own check.

    So a stage with a bad learning rate still has its references, datasets and rewards
    checked: the user sees all of a file's errors in one pass.
    """
    adapter, stages, validated, failed = TypeAdapter(StageSpec), {}, set(), {}
    for name, value in raw_stages.items():
        try:
            stages[name] = adapter.validate_python(value)
            validated.add(name)
        except ValidationError:
            kind = STAGE_KINDS.get(stage_kind(value))
            if kind is not None:
                config_cls = kind.model_for(value)
                fields, failed[name] = _valid_fields(config_cls, value)
                stages[name] = config_cls.model_construct(**fields)
    return stages, validated, failed


def _valid_fields(config_cls, value: dict) -> tuple[dict, set]:
    """The fields of ``value`` that validate on their own, and the names of those that do not. A required one
    that does not is None (an empty list or mapping for those types), which every reference and name check
    skips: no check meets a value of the wrong type."""
    fields, failed = {}, set()
    for name, info in config_cls.model_fields.items():
        if name in value:
            try:
                annotation = Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
                fields[name] = TypeAdapter(annotation).validate_python(value[name])
                continue
            except ValidationError:
                failed.add(name)
        if info.is_required():
            origin = typing.get_origin(unwrap_type(info.annotation)[0])
            fields[name] = [] if origin is list else {} if origin is dict else None
    return fields, failed


@dataclass
class _Draft:
    """What the lenient parse made of a pipeline: raw sections, and the parts that validated."""

    raw: dict
    base_dir: Path
    raw_stages: dict
    raw_data: dict
    raw_rewards: dict
    raw_checks: dict
    stages: dict  # stage name -> config (fields that failed validation left at their defaults)
    validated: set  # the stages whose config validated whole: a stage kind's own checks run on those alone
    failed: dict  # stage name -> its fields that failed their own check (read by no later check)
    data: dict  # dataset name -> DataSpec, for those that validated
    rewards: dict  # reward name -> RewardSpec, for those that validated
    records: _DatasetRecords

    @classmethod
    def of(cls, raw: dict, base_dir: Path) -> _Draft:
        def section(key: str) -> dict:
            return raw.get(key) if isinstance(raw.get(key), dict) else {}

        data = _partial(TypeAdapter(DataSpec), section("data"))
        stages, validated, failed = _lenient_stages(section("stages"))
        return cls(raw, base_dir, section("stages"), section("data"), section("rewards"), section("reward_checks"),
                   stages, validated, failed, data, _partial(TypeAdapter(RewardSpec), section("rewards")),
                   _DatasetRecords(data, base_dir))


Issues = list[tuple[tuple, str]]


def semantic_issues(raw: dict, base_dir: Path, lines) -> list[SpecIssue]:
    """Every cross-field problem of a pipeline, each at its YAML path and line."""
    draft = _Draft.of(raw, base_dir)
    found: Issues = []
    for collect in COLLECTORS:
        found += collect(draft)
    return [SpecIssue(dotted(path), message, line_for(lines, path)) for path, message in found]


def _name_issues(d: _Draft) -> Issues:
    issues = []
    for name in d.raw_stages:
        if name == BASE:
            issues.append((("stages", name), f"`{BASE}` is reserved for the pipeline's model; rename this stage"))
        elif problem := name_problem(name, KEY_NAME_PATTERN):
            issues.append((("stages", name), f"stage {problem}"))
    for section, names in (("data", d.raw_data), ("rewards", d.raw_rewards)):
        for name in names:
            if problem := name_problem(name, KEY_NAME_PATTERN):
                issues.append(((section, name), f"{'dataset' if section == 'data' else 'reward'} {problem}"))
    return issues


def _section_failed(d: _Draft, key: str) -> bool:
    """Whether the pipeline gives section ``key`` (data, rewards, reward_checks) as something other than a mapping:
    reported at its place, and read by no later check as if it declared nothing."""
    return key in d.raw and not isinstance(d.raw[key], dict)


def _reference_issues(d: _Draft) -> Issues:
    """Each stage's references to stages, datasets and rewards name something that exists and fits."""
    issues = []
    for name, config in d.stages.items():
        issues += _stage_reference_issues(d, name, config)
        # what the stage needs of its files and, if it runs here, of this machine: asked of a config that validated
        # whole (a field that failed is reported at its place, and the kind's check was written for valid ones)
        if hasattr(config, "here_problems") and name in d.validated:
            resources = _stage_resources(d, config)
            runs_here = resources is None or resources.pool is None
            issues += [(("stages", name, *where.split(".")), why)
                       for where, why in config.here_problems(d.base_dir, runs_here)]
        for data_name in config.dataset_names():
            if not isinstance(data_name, str) or _section_failed(d, "data"):
                continue
            where = ("stages", name, "data")
            if data_name not in d.raw_data:
                issues.append((where, f"unknown dataset {data_name!r}{did_you_mean(data_name, d.raw_data)}; "
                                      f"datasets: {', '.join(map(str, d.raw_data)) or 'none declared'}"))
            elif (STAGE_KINDS[config.kind].trains and isinstance(d.raw_data[data_name], dict)
                  and d.raw_data[data_name].get("role") == "heldout"):
                issues.append((where, f"dataset {data_name!r} has role heldout and cannot feed training stage "
                                      f"{name!r} (leakage guard: heldout data is only ever evaluated)"))
        for i, reward_name in enumerate(config.reward_names()):
            if _section_failed(d, "rewards"):
                break
            if isinstance(reward_name, str) and reward_name not in d.raw_rewards and reward_name not in BUILTIN_REWARDS:
                options = [*d.raw_rewards, *BUILTIN_REWARDS]
                where = ("stages", name, "labels") if getattr(config, "labels", None) == reward_name \
                    else ("stages", name, "rewards", i)  # a step reward model names its labelling reward so
                issues.append((where,
                               f"unknown reward {reward_name!r}{did_you_mean(reward_name, options)}; "
                               f"declare it under `rewards:` or use a built-in ({', '.join(BUILTIN_REWARDS)})"))
    return issues


def unchecked_notes(spec) -> list[str]:
    """What validation could not check on this machine for a pipeline that validated (a stage sent to a work
    pool whose requirements this machine cannot look at), each at its path: said, not refused."""
    notes = []
    for name, config in spec.stages.items():
        if hasattr(config, "unchecked"):
            resources = getattr(config, "resources", None) or spec.resources
            runs_here = resources is None or resources.pool is None
            notes += [f"stages.{name}.{where}: {what}" for where, what in config.unchecked(runs_here)]
    return notes


def not_applicable_issues(d: _Draft) -> Issues:
    """Every field set where it does not apply, in stages, datasets and rewards (``not_applicable``)."""
    entries = [("stages", name, config, d.failed.get(name, set())) for name, config in d.stages.items()]
    entries += [("data", name, spec, set()) for name, spec in d.data.items()]
    entries += [("rewards", name, spec, set()) for name, spec in d.rewards.items()]
    return [((section, name, *path), message) for section, name, root, failed in entries
            for path, message in not_applicable(root, failed)]


def not_applicable(root, failed: set = frozenset()) -> list[tuple[tuple, str]]:
    """(path from the entry, message) of each field set in an entry (a stage's, dataset's or reward's config)
    whose declared ``applies_when`` condition (stages/spec_model.py) does not hold: the one check of every such
    rule. A field in ``failed`` (it failed its own check) is neither checked nor read by another's condition."""
    issues = []
    for path, value, condition in set_fields(root):
        if condition is None or value is None or path[0] in failed:  # null: the field left out, as its default
            continue
        if any(p.split(".")[0] in failed for p in condition_paths(condition)) or condition_holds(root, condition):
            continue
        issues.append((path, f"{_shown(value)}, but this field applies only when {condition_text(condition)} "
                             f"(here {_actual(root, condition)}): {condition['why']}; remove it"))
    return issues


def _shown(value) -> str:
    if hasattr(value, "model_dump"):
        return "set"
    text = repr(value)
    return f"set to {text if len(text) <= 40 else text[:37] + '...'}"


def _actual(root, condition: dict) -> str:
    """What the condition's paths are in this entry: ``generation.mode is colocated, lora is not set``."""
    said = []
    for path in sorted(condition_paths(condition)):
        value = read_path(root, path)
        if value is MISSING:
            said.append(f"{getattr(root, 'kind', 'this entry')} has no {path}")
        elif value is None:
            said.append(f"{path} is not set")
        else:
            said.append(f"{path} is {'set' if hasattr(value, 'model_dump') else value}")
    return ", ".join(said)


def _stage_reference_issues(d: _Draft, name: str, config) -> Issues:
    issues = []
    for field_name, target in config.references().items():
        where = ("stages", name, field_name)
        if not isinstance(target, str):
            continue  # a type error, already reported
        if target == name:
            issues.append((where, f"stage {name!r} refers to itself"))
        elif target != BASE and target not in d.raw_stages:
            options = [BASE, *d.raw_stages]
            issues.append((where, f"unknown stage {target!r}{did_you_mean(target, options)}; stages: "
                                  f"{', '.join(options)}"))
        elif target in d.stages and STAGE_KINDS[d.stages[target].kind].produces is None:
            issues.append((where, f"stage {target!r} ({d.stages[target].kind}) produces no checkpoint to use here"))
    return issues


def _reward_check_issues(d: _Draft) -> Issues:
    issues = []
    for reward_name in d.raw_checks:
        if _section_failed(d, "rewards"):
            break
        if reward_name not in d.raw_rewards and reward_name not in BUILTIN_REWARDS:
            issues.append((("reward_checks", reward_name), f"unknown reward {reward_name!r}"
                           f"{did_you_mean(reward_name, [*d.raw_rewards, *BUILTIN_REWARDS])}"))
    for name, config in d.stages.items():
        if getattr(config, "check_rewards", False) is True and not (
                _section_failed(d, "reward_checks") or "environment" in d.failed.get(name, ())):
            names = [r for r in config.reward_names() if isinstance(r, str)]
            environment = getattr(config, "environment", None)
            if not any(r in d.raw_checks for r in names) and not (environment and environment.checks):
                issues.append((("stages", name, "check_rewards"), "check_rewards is on, but `reward_checks:` "
                               f"declares no cases for any of {', '.join(names)}"
                               + (" and its environment declares no `checks:`" if environment else "")))
    return issues


def _reward_fn_issues(d: _Draft) -> Issues:
    issues = []
    for name, spec in d.rewards.items():
        try:
            fn = load_reward_fn(spec.fn)
        except RewardError as error:
            issues.append((("rewards", name, "fn"), str(error)))
            fn = None
        for where, message in kwargs_issues(spec.fn, fn, spec.kwargs):
            issues.append((("rewards", name, "kwargs", *where), message))
    return issues


def _judge_issues(d: _Draft) -> Issues:
    """A judge is the base model, a stage with a policy checkpoint, or an importable function; its known
    cases can be checked before training only when the judge exists then (base, or a function)."""
    issues = []
    for name, spec in d.rewards.items():
        if spec.fn != JUDGE_FN:
            continue
        if spec.judge_fn is not None:
            try:
                import_dotted(spec.judge_fn, "judge_fn")
            except RewardError as error:
                issues.append((("rewards", name, "judge_fn"), str(error)))
            continue
        if spec.model is not None:
            raw_model = d.raw_rewards[name].get("model")
            issues += [(("rewards", name, *where), message) for where, message in _model_issues(raw_model, d.base_dir, {})]
            continue
        where = ("rewards", name, "stage")
        if spec.stage != BASE and spec.stage not in d.raw_stages:
            options = [BASE, *d.raw_stages]
            issues.append((where, f"unknown stage {spec.stage!r}{did_you_mean(spec.stage, options)}; the judge is "
                                  f"{BASE} or a stage: {', '.join(options)}"))
        elif spec.stage in d.stages and STAGE_KINDS[d.stages[spec.stage].kind].produces != "policy":
            issues.append((where, f"stage {spec.stage!r} ({d.stages[spec.stage].kind}) has no generative checkpoint "
                                  "to judge with"))
        if name in d.raw_checks and spec.stage != BASE:  # (a judge_fn or a model of its own exists now)
            issues.append((("reward_checks", name), f"judge {name!r} is stage {spec.stage!r}'s checkpoint, which does "
                           "not exist before that stage has trained, so its known cases cannot be checked; judge with "
                           f"`stage: {BASE}` or a `judge_fn` to check them"))
    return issues


def _dataset_issues(d: _Draft) -> Issues:
    issues = []
    for name, spec in d.data.items():
        for i, other in enumerate(getattr(spec, "exclude", [])):
            if other == name:
                issues.append((("data", name, "exclude", i), f"dataset {name!r} cannot exclude itself"))
            elif other not in d.raw_data:
                issues.append((("data", name, "exclude", i), f"unknown dataset {other!r}"
                               f"{did_you_mean(other, d.raw_data)}; datasets: {', '.join(d.raw_data)}"))
    for name, spec in d.data.items():
        if isinstance(spec, MixtureData):
            issues += _mixture_issues(d, name, spec)
    for name, spec in d.data.items():
        if isinstance(spec, (FileData, HubData)) and d.records.error(name):
            issues.append((("data", name, _source_key(spec)), d.records.error(name)))
        elif isinstance(spec, ReasoningGymData):
            for field_name, message in _reasoning_gym_task_issues(spec):
                issues.append((("data", name, field_name), message))
    return issues


def _source_key(spec) -> str:
    """The key a file-read dataset's problems are reported at: ``path``, ``hub`` or ``folder``."""
    return "path" if isinstance(spec, FileData) else "hub" if spec.hub is not None else "folder"


def _mixture_issues(d: _Draft, name: str, spec: MixtureData) -> Issues:
    """A mixture's components are declared plain datasets of one record type, and heldout data only ever
    mixes with heldout data (leakage guard: a training mixture never draws a heldout record)."""
    issues, kinds = [], set()
    for component in spec.mixture:
        where = ("data", name, "mixture", component)
        raw = d.raw_data.get(component)
        if component == name:
            issues.append((where, f"mixture {name!r} cannot contain itself"))
        elif raw is None:
            issues.append((where, f"unknown dataset {component!r}{did_you_mean(component, d.raw_data)}; datasets: "
                                  f"{', '.join(map(str, d.raw_data))}"))
        elif isinstance(raw, dict) and "mixture" in raw:
            issues.append((where, f"dataset {component!r} is itself a mixture; list its components here instead"))
        elif isinstance(raw, dict) and (raw.get("role") == "heldout") != (spec.role == "heldout"):
            if spec.role == "heldout":
                issues.append((where, f"heldout mixture {name!r} cannot draw from {raw.get('role')} dataset "
                                      f"{component!r}: it would evaluate on data that is trained on (leakage guard)"))
            else:
                issues.append((where, f"dataset {component!r} has role heldout and cannot be a component of "
                                      f"{spec.role} mixture {name!r} (leakage guard: heldout data is only ever "
                                      "evaluated)"))
        elif component in d.data:
            kinds.add(holds_preferences(d.data[component]))
    if len(kinds) > 1:
        issues.append((("data", name, "mixture"), f"mixture {name!r} mixes preference pairs with conversations; "
                                                  "its components must hold one kind of record"))
    return issues


def _resource_issues(d: _Draft) -> Issues:
    """More than one process or GPU: training stages only, with batches that divide over them
    (flows/execution/distributed.py ``world_issues``)."""
    from flows.execution.distributed import world_issues

    issues = []
    iterated = d.raw["iterate"].get("train") if isinstance(d.raw.get("iterate"), dict) else None
    for name, config in d.stages.items():
        resources = _stage_resources(d, config)
        if resources is None or resources.world_size() <= 1:
            continue
        where = ("stages", name, "resources") if getattr(config, "resources", None) else ("resources",)
        problems = world_issues(config, resources, runs_here=resources.pool is None)
        if resources.nodes > 1 and name == iterated:
            problems.append("the stage `iterate` retrains is refused on several nodes: its later rounds train on "
                            "a failure set built on node 0's disk, which the other nodes do not see")
        for problem in problems:
            issues.append((where, f"stage {name!r} ({config.kind}) on {_layout(resources)}: {problem}"))
    return issues


def _stage_resources(d: _Draft, config) -> Resources | None:
    """The stage's own resources, else the pipeline's default (None where neither validated)."""
    resources = getattr(config, "resources", None)
    if not isinstance(resources, Resources):
        raw_default = d.raw.get("resources")
        try:
            resources = Resources.model_validate(raw_default) if isinstance(raw_default, dict) else None
        except ValidationError:
            resources = None
    return resources


def _placement_issues(d: _Draft) -> Issues:
    """``placement:`` (stages/models/placement.py): a reward-model placement needs a reward model to place; a
    sharded strategy shards the reference itself; a stage that runs here needs the devices it names."""
    from stages.models.placement import device_problem

    issues = []
    for name, config in d.stages.items():
        placement = getattr(config, "placement", None)
        if placement is None:
            continue
        where = ("stages", name, "placement")
        resources = _stage_resources(d, config) or Resources()
        chosen = {field: value for field, value in placement.model_dump().items() if value != "policy"}
        if "reward_model" in chosen and not any(
                getattr(d.rewards.get(r), "fn", None) == "reward_model" for r in config.reward_names()):
            issues.append((where + ("reward_model",), f"stage {name!r} places its reward models, but none of its "
                           "rewards is `fn: reward_model`: remove placement.reward_model"))
        if chosen and resources.strategy != "ddp":
            issues.append((where, f"stage {name!r}: strategy {resources.strategy} shards the frozen models with the "
                           "policy; placement applies to ddp (and one process) only"))
        if resources.pool is None and any(value.startswith("cuda:") for value in chosen.values()):
            import torch

            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            for field, value in chosen.items():
                if (problem := device_problem(value, count)) is not None:
                    issues.append((where + (field,), f"stage {name!r} runs on this machine (no `resources.pool`): "
                                   f"placement.{field}: {problem}"))
    return issues


def _layout(resources: Resources) -> str:
    if resources.nodes > 1:
        return f"{resources.nodes} nodes x {resources.per_node()} processes"
    return f"{resources.world_size()} processes"


def _graph_issues(d: _Draft) -> Issues:
    """No dependency cycles, and an ``iterate:`` block the planner can unroll (flows/planning/graph.py)."""
    return graph_issues(d.raw_stages, d.stages, d.rewards, d.raw.get("iterate"), d.raw_data, d.raw_rewards)


class _DatasetRecords:
    """Each dataset's records, located (``file:line``), loaded once per validation and only when asked for.

    Files are always read (a file that does not parse is an error in itself); generated
    datasets only when a check needs their records.
    """

    def __init__(self, data: dict, base_dir: Path):
        self.data, self.base_dir = data, base_dir
        self._records: dict[str, list[tuple[str, dict]] | None] = {}
        self._errors: dict[str, str] = {}

    def error(self, name: str) -> str | None:
        self.get(name)
        return self._errors.get(name)

    def get(self, name: str) -> list[tuple[str, dict]] | None:
        """(where, record) pairs, or None when the dataset is unknown or cannot be read (reported apart)."""
        if name not in self._records:
            spec = self.data.get(name)
            try:
                if isinstance(spec, (FileData, HubData)):
                    self._records[name] = located_file_records(spec, self.base_dir)
                elif spec is not None:
                    self._records[name] = [(f"data.{name} record {i + 1}", r)
                                           for i, r in enumerate(load_records(spec, self.base_dir, self.data))]
                else:
                    self._records[name] = None
            except DataError as error:
                self._records[name], self._errors[name] = None, str(error)
            except Exception as error:  # a generator's own failure is reported by its own check
                self._records[name] = None
                self._errors.setdefault(name, f"{type(error).__name__}: {error}")
        return self._records[name]


# What each stage kind reads from a conversation record, beyond its schema.
def _record_shape_problem(kind: str, record: dict) -> str | None:
    messages = record.get("messages") or []
    reads = STAGE_KINDS[kind].reads if kind in STAGE_KINDS else None
    if reads == "demonstrations" and not any(m.get("role") == "assistant" for m in messages):
        return f"has no assistant turn (`completion`, or a `messages` turn with role assistant), and {kind} " \
               "trains on the assistant's turns"
    if reads == "prompts" and not prompt_messages(record):
        return "has no prompt (only an assistant turn), and the stage samples replies to the prompt"
    return None


def _first_problem(records: list[tuple[str, dict]], problem_of) -> str | None:
    """``where: problem`` of the first record with a problem, and how many more have one."""
    found = [(where, problem) for where, record in records if (problem := problem_of(record))]
    if not found:
        return None
    where, problem = found[0]
    more = f" (and {len(found) - 1} more of its {len(records)} records)" if len(found) > 1 else ""
    return f"{where}: the record {problem}{more}"


def _consumer_issues(stages: dict, rewards: dict[str, RewardSpec], data: dict, raw_rewards: dict,
                     records: _DatasetRecords) -> list[tuple[tuple, str]]:
    """Datasets hold what their stages and rewards read, checked on the records themselves.

    Generated records have the turns their stages read by construction; arithmetic ones also
    integer answers, so they are not generated for this.
    """
    issues = []
    for name, config in stages.items():
        for data_name in config.dataset_names():
            spec = data.get(data_name) if isinstance(data_name, str) else None
            if spec is None or holds_preferences(spec, data) or isinstance(spec, ArithmeticData):
                continue
            kind = getattr(config, "kind", "")
            located = records.get(data_name) if isinstance(spec, (FileData, HubData, MixtureData)) else None
            if located and (problem := _first_problem(located, lambda r: _record_shape_problem(kind, r))):
                issues.append((("stages", name, "data"), f"dataset {data_name!r} cannot feed stage {name!r} ({kind}): "
                               f"{problem}"))
            for i, reward_name in enumerate(config.reward_names()):
                if not isinstance(reward_name, str):
                    continue
                spec_r = rewards.get(reward_name) if reward_name in raw_rewards else (
                    RewardSpec(fn=reward_name) if reward_name in BUILTIN_REWARDS else None)
                if spec_r is None or spec_r.fn not in RECORD_READERS:
                    continue
                located = records.get(data_name)  # a reasoning-gym dataset is generated for this, once
                if located is None:
                    continue
                problem = _first_problem(located, lambda r: record_problem(spec_r.fn, spec_r.kwargs, r))
                if problem is not None:
                    issues.append((("stages", name, "rewards", i), f"reward {reward_name!r} ({spec_r.fn}) cannot score "
                                   f"dataset {data_name!r}: {problem}"))
    return issues


def _leakage_issues(data: dict, records: _DatasetRecords) -> list[tuple[tuple, str]]:
    """A heldout dataset shares no prompt (normalised text) with a train or probe dataset.

    Compared by content whenever a file is involved: the same file declared twice, or a copy,
    is caught whatever its role says. Two built-in arithmetic generators draw from a question
    space of a few hundred sums by design (the quickstart's heldout measures the skill, not
    unseen questions), so they are refused only when they draw the same questions in the same
    order (same seed and ranges); two reasoning-gym datasets by their seed ranges
    (``_reasoning_gym_issues``).
    """
    issues = []
    for held_name, held in data.items():
        if held.role != "heldout":
            continue
        where = ("data", held_name, _source_key(held) if isinstance(held, (FileData, HubData)) else "seed")
        for other_name, other in data.items():
            if other_name == held_name or other.role == "heldout" or isinstance(other, MixtureData):
                continue  # a mixture holds its components' records: they are compared themselves
            if isinstance(held, ArithmeticData) and isinstance(other, ArithmeticData):
                same = ("seed", "min_operand", "max_operand", "ops")
                if all(getattr(held, f) == getattr(other, f) for f in same):
                    issues.append((where, f"heldout dataset {held_name!r} draws the same questions in the same order "
                                   f"as {other.role} dataset {other_name!r} (same generator, seed and ranges): "
                                   f"leakage guard; give it another seed"))
                continue
            if not (isinstance(held, (FileData, HubData)) or isinstance(other, (FileData, HubData))):
                continue
            held_records, other_records = records.get(held_name), records.get(other_name)
            if held_records is None or other_records is None or holds_preferences(held) != holds_preferences(other):
                continue
            other_prompts = {prompt_text(r) for _, r in other_records}
            shared = [(w, r) for w, r in held_records if prompt_text(r) in other_prompts]
            if shared:
                first_where, first = shared[0]
                issues.append((where, f"heldout dataset {held_name!r} shares {len(shared)} of its {len(held_records)} "
                               f"prompts with {other.role} dataset {other_name!r} (compared as normalised text; first "
                               f"{first_where}: {prompt_text(first)[:80]!r}): leakage guard, heldout data is never "
                               "trained on; remove them from one of the two"))
    return issues


def _sandbox_issues(stages: dict, rewards: dict[str, RewardSpec], raw_rewards: dict, raw_checks: dict,
                    raw: dict) -> list[tuple[tuple, str]]:
    """A code_tests reward scored in this process (a stage without a work pool, or check-reward) needs its
    sandbox here: found now, not at scoring time after the training before it."""
    from stages.rewards.sandbox import SandboxUnavailable, ensure_available

    pooled_default = isinstance(raw.get("resources"), dict) and raw["resources"].get("pool")
    local_users: dict[str, list[str]] = {}
    for name, config in stages.items():
        own = getattr(config, "resources", None)
        if own.pool if isinstance(own, Resources) else pooled_default:
            continue
        for reward_name in config.reward_names():
            if isinstance(reward_name, str):
                local_users.setdefault(reward_name, []).append(name)
    for reward_name in raw_checks:
        local_users.setdefault(reward_name, []).append("check-reward")
    issues = []
    for reward_name, users in local_users.items():
        spec = rewards.get(reward_name) if reward_name in raw_rewards else (
            RewardSpec(fn=reward_name) if reward_name == "code_tests" else None)
        if spec is None or spec.fn != "code_tests":
            continue
        isolation = spec.kwargs.get("sandbox", ISOLATION_MODES[0])
        if isolation not in ISOLATION_MODES:
            continue  # reported by the kwargs check
        try:
            ensure_available(isolation)
        except SandboxUnavailable as error:
            where = ("rewards", reward_name, "fn") if reward_name in raw_rewards else ("rewards",)
            opt_out = (" Or opt out explicitly: `kwargs: {sandbox: rlimits-only}` on this reward (limits, a throwaway "
                       "dir and a scrubbed environment, no network or filesystem isolation)."
                       if isolation == "bubblewrap" else "")
            issues.append((where, f"reward {reward_name!r} (code_tests) runs model-written code in {', '.join(users)} "
                           f"in this process, and its sandbox cannot run here: {error}{opt_out}"))
    return issues


def _model_issues(model, base_dir: Path, stages: dict) -> list[tuple[tuple, str]]:
    """The base model can be found (and, for a local checkpoint, loaded safely and chatted with)."""
    if not isinstance(model, dict):
        return []
    try:
        spec = TypeAdapter(ModelSpec).validate_python(model)
    except ValidationError:
        return []  # reported as a structural error
    if isinstance(spec, GGUFModelSpec):
        where = ("model", "gguf") if isinstance(spec.gguf, str) else ("model", "gguf", "package")
        try:
            path = locate_gguf(spec.gguf, base_dir)
        except ModelSourceError as error:
            if not isinstance(spec.gguf, str) and "has no file" in str(error):
                where = ("model", "gguf", "file")
            return [(where, str(error))]
        if (problem := gguf_reader_problem()) is not None:
            return [(("model", "gguf"), problem)]
        if not path.name.endswith(GGUF_SUFFIX):
            return [(where, f"{str(path)!r} is not a .gguf file")]
        return []
    if isinstance(spec, HubModelSpec):
        if (problem := hub_problem(spec.hub, spec.revision)) is not None:
            return [(("model", "hub"), problem)]
        snapshot = cached_hub_snapshot(spec.hub, spec.revision)
        return [(("model", "hub"), message) for message in _checkpoint_problems(snapshot, spec, stages)]
    if isinstance(spec, PathModelSpec):
        path = Path(spec.path) if Path(spec.path).is_absolute() else base_dir / spec.path
        return [(("model", "path"), message) for message in _checkpoint_problems(path, spec, stages)]
    return []


def _checkpoint_problems(path: Path | None, spec, stages: dict) -> list[str]:
    if path is None:  # a hub model the hub has but the cache does not: checked once downloaded
        return []
    problem = check_checkpoint_dir(path, trust_remote_code=spec.trust_remote_code)
    if problem:
        return [problem]
    if (no_template := chat_template_problem(path)) and stages:
        # Every stage kind renders conversations with the base model's tokenizer (its
        # checkpoints carry that tokenizer on), so any stage needs a chat template.
        readers = [n for n, c in stages.items() if BASE in c.references().values()] or list(stages)
        return [f"{no_template}, and stage(s) {', '.join(readers)} render conversations with it; use a chat "
                "model's checkpoint or add a chat template to it"]
    return []


def _reasoning_gym_task_issues(spec: ReasoningGymData) -> list[tuple[str, str]]:
    """The task exists and reasoning-gym accepts its config (one entry is built, not all n)."""
    from stages.data.reasoning_gym import config_problem, task_names

    try:
        names = task_names()
    except DataError as error:  # the optional extra is not installed
        return [("reasoning_gym", str(error))]
    if spec.reasoning_gym not in names:
        return [("reasoning_gym", f"unknown reasoning-gym task {spec.reasoning_gym!r}"
                 f"{did_you_mean(spec.reasoning_gym, names)}; reasoning_gym.factory.DATASETS lists its "
                 f"{len(names)} tasks")]
    problem = config_problem(spec)
    return [("config", problem)] if problem else []


def _reasoning_gym_issues(stages: dict, rewards: dict[str, RewardSpec], data: dict, raw_rewards: dict,
                          raw_checks: dict) -> list[tuple[tuple, str]]:
    """A ``reasoning_gym`` reward regenerates each entry from its record's ``task``: it scores
    reasoning_gym datasets only, and its known cases name their entry. A heldout reasoning_gym
    dataset shares no entry with another dataset of its task and config (leakage guard)."""
    from stages.data.reasoning_gym import task_problem

    def fn_of(reward_name):
        if reward_name in raw_rewards:
            return rewards[reward_name].fn if reward_name in rewards else None
        return reward_name if reward_name in BUILTIN_REWARDS else None

    issues = []
    for name, config in stages.items():
        gym_rewards = [(i, r) for i, r in enumerate(config.reward_names())
                       if isinstance(r, str) and fn_of(r) == REASONING_GYM_FN]
        for data_name in config.dataset_names():
            if not isinstance(data_name, str) or data_name not in data or _is_reasoning_gym(data, data_name):
                continue
            for i, reward_name in gym_rewards:
                issues.append((("stages", name, "rewards", i), f"reward {reward_name!r} (fn reasoning_gym) scores "
                               f"reasoning_gym datasets only, and dataset {data_name!r} is not one (`reasoning_gym: "
                               "TASK`): its records name no task entry to regenerate and score"))

    for reward_name, cases in raw_checks.items():
        if fn_of(reward_name) != REASONING_GYM_FN or not isinstance(cases, list):
            continue
        for i, case in enumerate(cases):
            if not isinstance(case, dict):
                continue  # a structural error, reported already
            if case.get("task") is None:
                issues.append((("reward_checks", reward_name, i), "a reasoning_gym reward's case needs `task:`, the "
                               "entry it answers ({reasoning_gym: TASK, config: {...}, seed: S, size: N, index: I}), "
                               "from which the reward regenerates what it scores against"))
            elif (problem := task_problem(case["task"])) is not None:
                issues.append((("reward_checks", reward_name, i, "task"), problem))

    gyms = {n: s for n, s in data.items() if isinstance(s, ReasoningGymData)}
    for held_name, held in gyms.items():
        if held.role != "heldout":
            continue
        for other_name, other in gyms.items():
            same_task = (other.reasoning_gym, other.config) == (held.reasoning_gym, held.config)
            if other_name == held_name or other.role == "heldout" or not same_task:
                continue
            if held.seed < other.seed + other.n and other.seed < held.seed + held.n:
                issues.append((("data", held_name, "seed"), f"heldout dataset {held_name!r} shares entries with "
                               f"{other.role} dataset {other_name!r} (same task and config; reasoning-gym draws entry "
                               f"i from seed + i, so seeds {held.seed}..{held.seed + held.n - 1} and {other.seed}.."
                               f"{other.seed + other.n - 1} overlap): leakage guard; e.g. seed: "
                               f"{max(held.seed, other.seed + other.n)}"))
            elif held_name not in other.exclude and (shared := _shared_prompts(held, other)):
                issues.append((("data", other_name, "exclude"), f"{other.role} dataset {other_name!r} asks "
                               f"{shared} of heldout dataset {held_name!r}'s questions (the task's question space is "
                               f"small: disjoint seeds draw the same questions; compared as normalised text): leakage "
                               f"guard; add `exclude: [{held_name}]` to drop them from {other_name!r}"))
    return issues


def _is_reasoning_gym(data: dict, name: str) -> bool:
    """A reasoning_gym dataset, or a mixture of them only (its records name their task entries too)."""
    spec = data[name]
    if isinstance(spec, MixtureData):
        return all(isinstance(data.get(c), ReasoningGymData) for c in spec.mixture)
    return isinstance(spec, ReasoningGymData)


def _shared_prompts(held: ReasoningGymData, other: ReasoningGymData) -> int:
    """How many of ``held``'s prompts ``other`` also holds (0 when either cannot be generated: reported elsewhere)."""
    try:
        held_prompts = {prompt_text(r) for r in load_records(held, Path("."))}
        return sum(prompt_text(r) in held_prompts for r in load_records(other, Path(".")))
    except Exception:  # an unknown task or config: its own check names it
        return 0


def _reward_model_issues(stages: dict, rewards: dict[str, RewardSpec], data: dict, raw_stages: dict,
                         raw_rewards: dict, raw_checks: dict, failed: dict) -> list[tuple[tuple, str]]:
    """Reward models are scorers, not policies; preference pairs are not conversations.

    A reference that must name a reward_model stage (eval's ``reward_model``, PPO's
    ``critic``, a ``fn: reward_model`` reward's ``stage``) names one, no other reference names
    one, and each stage reads the kind of dataset it trains on.
    """
    issues = []

    def kind_of(target):
        config = stages.get(target)
        return getattr(config, "kind", None)

    for name, config in stages.items():
        wants_rm = set(getattr(config, "reward_model_references", ()))
        for field_name, target in config.references().items():
            if not isinstance(target, str) or target == name or target not in stages:
                continue  # unknown or self references are reported above
            is_rm = kind_of(target) == "reward_model"
            if field_name in wants_rm and not is_rm:
                issues.append((("stages", name, field_name),
                               f"stage {target!r} is kind {kind_of(target)}; {field_name} needs a reward_model stage"))
            elif field_name not in wants_rm and is_rm:
                issues.append((("stages", name, field_name),
                               f"stage {target!r} is a reward model (a scorer, not a policy); it cannot be used as "
                               f"{field_name}"))
        if "level" in failed.get(name, ()):
            continue  # what it learns, and so what it reads, is unknown: the level is reported at its place
        if getattr(config, "level", None) == "step" and not config.labels and config.data in data:
            spec = data[config.data]
            if getattr(spec, "records", None) != "steps":
                issues.append((("stages", name, "labels"), "a level step reward model learns step labels: name the "
                               "process reward that labels the steps of its data (`labels: REWARD`, e.g. fn "
                               f"chain_steps), or give it a step-rated file (`records: steps`); dataset "
                               f"{config.data!r} is neither"))
        elif getattr(config, "labels", None) and getattr(data.get(config.data), "records", None) == "steps":
            issues.append((("stages", name, "labels"), f"dataset {config.data!r} is step-rated (`records: steps`): "
                           "its ratings are the labels; remove `labels`"))
        wants_pairs = getattr(config, "data_records", "conversations") == "preferences"
        for data_name in config.dataset_names():
            if (isinstance(data_name, str) and data_name in data
                    and holds_preferences(data[data_name], data) != wants_pairs):
                needed = ("preference pairs (`generator: arithmetic_preferences` or a file with "
                          "`records: preferences`)" if wants_pairs else "conversations, not preference pairs")
                issues.append((("stages", name, "data"), f"stage kind {config.kind} reads {needed}; "
                               f"dataset {data_name!r} does not hold them"))
    return issues + _scorer_reward_issues(stages, rewards, raw_stages, raw_checks)


def _scorer_reward_issues(stages: dict, rewards: dict[str, RewardSpec], raw_stages: dict,
                          raw_checks: dict) -> list[tuple[tuple, str]]:
    """A ``fn: reward_model`` reward scores with a reward_model stage, and has no known cases to check."""
    issues = []
    for reward_name, spec in rewards.items():
        if spec.fn != REWARD_MODEL_FN:
            continue
        where, kind = ("rewards", reward_name, "stage"), getattr(stages.get(spec.stage), "kind", None)
        if spec.stage not in raw_stages:
            issues.append((where, f"unknown stage {spec.stage!r}{did_you_mean(spec.stage, raw_stages)}; "
                                  f"stages: {', '.join(raw_stages)}"))
        elif spec.stage in stages and kind != "reward_model":
            issues.append((where, f"stage {spec.stage!r} is kind {kind}; a reward_model reward scores with a "
                                  "reward_model stage"))
        if reward_name in raw_checks:
            issues.append((("reward_checks", reward_name), "a reward_model reward has no model before its stage "
                           "has trained, so it cannot be checked against known cases"))
    return issues


def _vllm_issues(stages: dict, raw: dict, base_dir: Path, failed: dict) -> list[tuple[tuple, str]]:
    """A stage that must generate with vLLM and runs in this process needs a vLLM here that can serve the
    pipeline's model: installed, of this machine's kind (GPU or CPU build), taking the model's attention head
    size (vLLM's CPU kernels take only some), and on a GPU a declared bfloat16 the GPU computes.

    A stage sent to a work pool (``resources.pool``) is checked where it runs: a GPU worker has vLLM, this
    machine need not. ``backend: auto`` never needs it. vLLM is looked at (which imports torch, ~1 s) only
    when some stage here declares ``backend: vllm`` or ``generation.mode: server``.
    """
    try:  # where the stages run is unknown if the default resources failed (reported at their place)
        if raw.get("resources") is not None:
            Resources.model_validate(raw["resources"])
    except ValidationError:
        return []
    pooled_default = isinstance(raw.get("resources"), dict) and raw["resources"].get("pool")
    in_process = [name for name, config in stages.items()
                  if _needs_vllm(config) and "resources" not in failed.get(name, ())
                  and not ((own.pool if isinstance(own := getattr(config, "resources", None), Resources)
                            else pooled_default))]
    if not in_process:
        return []
    from stages.engines.machine import vllm_problem

    problem = vllm_problem(head_size=_base_head_size(raw, base_dir))
    issues = [] if problem is None else [
        (("stages", name, *_needs_vllm(stages[name])), f"{problem}, and the stage runs in this process (no "
         "`resources.pool`): use `backend: auto` or `hf` and generation mode colocated, or send it to a GPU "
         "pool") for name in in_process]
    import torch

    if torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        issues += [(("stages", name, "engine", "dtype"), f"the GPU here ({torch.cuda.get_device_name()}) does not "
                    "compute bfloat16, and the stage's vLLM engine runs here: use dtype float32 or auto")
                   for name in in_process if getattr(getattr(stages[name], "engine", None), "dtype", None) == "bfloat16"]
    return issues


def _base_head_size(raw: dict, base_dir: Path) -> int | None:
    """The attention head size of the pipeline's model, where it is known before anything runs: a tiny model's
    config, a local checkpoint's or a cached hub snapshot's config.json (None otherwise: a GGUF file, a hub
    model not cached)."""
    from stages.engines.machine import checkpoint_head_size

    try:
        spec = TypeAdapter(ModelSpec).validate_python(raw.get("model"))
    except ValidationError:
        return None
    if getattr(spec, "init", None) == "tiny":
        return spec.hidden_size // spec.num_heads
    if isinstance(spec, PathModelSpec):
        return checkpoint_head_size(Path(spec.path) if Path(spec.path).is_absolute() else base_dir / spec.path)
    if isinstance(spec, HubModelSpec):
        snapshot = cached_hub_snapshot(spec.hub, spec.revision)
        return checkpoint_head_size(snapshot) if snapshot is not None else None
    return None


def _needs_vllm(config) -> tuple[str, ...]:
    """Where a stage's config says it must generate with vLLM (empty when it need not)."""
    generation = getattr(config, "generation", None)
    if getattr(generation, "mode", None) == "server":
        return ("generation", "mode")
    return ("backend",) if getattr(config, "backend", None) == "vllm" else ()


# the built-in rewards that score a completion's steps (stages/rewards/steps.py); every other built-in scores its end
STEP_BUILTINS = ("chain_steps",)


def _reward_level(d: _Draft, reward_name) -> str | None:
    """``step`` (a process reward: it scores each step), ``outcome`` (one score of the completion), or None
    where it is not known before anything runs (a function of the user's, a reward that failed its check)."""
    if not isinstance(reward_name, str):
        return None
    if reward_name not in d.raw_rewards:
        return "step" if reward_name in STEP_BUILTINS else "outcome" if reward_name in BUILTIN_REWARDS else None
    spec = d.rewards.get(reward_name)
    if spec is None:
        return None
    if spec.fn == REWARD_MODEL_FN:
        return _head(d, spec.stage)
    if spec.fn in STEP_BUILTINS:
        return "step"
    return "outcome" if spec.fn in BUILTIN_REWARDS else None


def _weight(d: _Draft, reward_name) -> float | None:
    """A reward's weight in the stage's sum (a built-in's is 1), None where its declaration failed."""
    if reward_name not in d.raw_rewards:
        return 1.0
    spec = d.rewards.get(reward_name)
    return spec.weight if spec is not None else None


def _head(d: _Draft, stage) -> str | None:
    """What a reward_model stage's head scores: ``step`` (level step, a token classifier) or ``outcome``."""
    config = d.stages.get(stage) if isinstance(stage, str) else None
    if getattr(config, "kind", None) != "reward_model" or "level" in d.failed.get(stage, ()):
        return None
    return "step" if config.level == "step" else "outcome"


def _reward_level_issues(d: _Draft) -> Issues:
    """Rewards of the level a stage needs, and reward models whose head fits their use: PPO's process credit
    needs a process reward among its rewards; a step reward model learns its labels from a process reward; a
    critic and a best-of-N selector need a scalar head (level pair), and a step reward model used as a reward
    scores steps, which normalize and offset do not rescale."""
    issues = []
    for name, config in d.stages.items():
        failed = d.failed.get(name, set())
        if getattr(config, "process_weight", 0) and not failed & {"process_weight", "rewards"}:
            paid = [r for r in config.rewards if _weight(d, r) != 0]  # a weight-0 reward is watched, never paid
            if all(_reward_level(d, r) == "outcome" for r in paid):
                issues.append((("stages", name, "process_weight"), f"process_weight {config.process_weight} places "
                               "process rewards' step scores, but none of the rewards the stage trains on "
                               f"({', '.join(paid) or 'none of weight other than 0'}) scores steps: add one (e.g. "
                               f"{STEP_BUILTINS[0]}, or fn reward_model of a level step stage), or remove process_weight"))
        labels = getattr(config, "labels", None) if config.kind == "reward_model" else None
        if labels and "labels" not in failed and _reward_level(d, labels) == "outcome":
            issues.append((("stages", name, "labels"), f"reward {labels!r} scores a completion's end, not its steps: "
                           "a level step reward model learns from a process reward's step scores (e.g. fn "
                           f"{STEP_BUILTINS[0]})"))
        for field, use in (("critic", "PPO's critic starts from its scalar score head"),
                           ("reward_model", "`select` ranks whole attempts by one score each")):
            target = getattr(config, field, None) if field in type(config).model_fields else None
            if isinstance(target, str) and field not in failed and _head(d, target) == "step":
                issues.append((("stages", name, field), f"stage {target!r} is a level step reward model (it scores "
                               f"each step), and {use}: name a level pair reward model"))
    for reward_name, spec in d.rewards.items():
        if spec.fn == REWARD_MODEL_FN and _head(d, spec.stage) == "step":
            for field in ("normalize", "offset"):
                if field in spec.model_fields_set:
                    issues.append((("rewards", reward_name, field), f"stage {spec.stage!r} is a level step reward "
                                   f"model: it scores each step with P(right), which {field} does not rescale; remove "
                                   f"{field}"))
    return issues


# In the order a user reads the file: names, references, rewards, data, models, resources, graph.
def _environment_issues(d: _Draft) -> Issues:
    """A stage's environment loads, and an ``environment`` reward (the environment's own score of an episode)
    is used only where there are episodes, of an environment that defines a score."""
    def fn_of(reward_name):
        spec = d.rewards.get(reward_name) if reward_name in d.raw_rewards else None
        return spec.fn if spec is not None else reward_name

    issues = [(("reward_checks", r), f"reward {r!r} is an environment's own score of an episode; declare known "
               "episodes under the stage's `environment: checks:` instead") for r in d.raw_checks if fn_of(r) == ENVIRONMENT_FN]
    for name, config in d.stages.items():
        spec = getattr(config, "environment", None)
        cls = None
        if spec is not None:
            try:
                cls = load_environment_class(spec.fn)
            except EnvironmentLoadError as error:
                issues.append((("stages", name, "environment", "fn"), str(error)))
        for i, reward_name in enumerate(config.reward_names()):
            if not isinstance(reward_name, str) or fn_of(reward_name) != ENVIRONMENT_FN:
                continue
            where = ("stages", name, "rewards", i)
            if spec is None and "environment" not in d.failed.get(name, ()):
                issues.append((where, f"reward {reward_name!r} is an environment's own score of an episode; stage "
                               f"{name!r} declares no `environment:`"))
            elif cls is not None and not has_own_score(cls):
                issues.append((where, f"reward {reward_name!r}: environment {spec.fn!r} defines no score of its own "
                               "(override `score(episode, answer, task)`); use a reward that scores the final answer"))
    return issues


COLLECTORS = (
    _name_issues,
    not_applicable_issues,
    _reference_issues,
    _environment_issues,
    _reward_check_issues,
    _reward_fn_issues,
    _judge_issues,
    _dataset_issues,
    lambda d: _consumer_issues(d.stages, d.rewards, d.data, d.raw_rewards, d.records),
    lambda d: _leakage_issues(d.data, d.records),
    lambda d: _sandbox_issues(d.stages, d.rewards, d.raw_rewards, d.raw_checks, d.raw),
    lambda d: _model_issues(d.raw.get("model"), d.base_dir, d.stages),
    lambda d: _reward_model_issues(d.stages, d.rewards, d.data, d.raw_stages, d.raw_rewards, d.raw_checks, d.failed),
    lambda d: _reasoning_gym_issues(d.stages, d.rewards, d.data, d.raw_rewards, d.raw_checks),
    _resource_issues,
    _placement_issues,
    lambda d: _vllm_issues(d.stages, d.raw, d.base_dir, d.failed),
    _reward_level_issues,
    _graph_issues,
)
