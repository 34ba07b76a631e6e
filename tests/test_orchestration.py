"""The orchestration's shape: one StageJob per stage execution, serialisable as it is sent to
work pools and torchrun ranks, and a planner that decides with typed actions."""

from __future__ import annotations

import json

from conftest import ROOT


def _iterate_pipeline():
    from flows.spec.loading import load_pipeline

    return load_pipeline(ROOT / "pipelines" / "iterate.yaml")


def test_a_stage_job_travels_as_json_and_comes_back_the_same():
    from flows.planning.graph import upstream_of
    from flows.planning.job import StageJob, bind_upstream, stage_jobs
    from flows.planning.lineage import Action, Decision

    loaded = _iterate_pipeline()
    step = next(name for name in loaded.spec.stages if "@" in name)  # a round-2 step: rounds unrolled
    decisions = [Decision(name, Action.RUN, "forced", forced=True) for name in loaded.spec.stages]
    jobs = stage_jobs(loaded, decisions, "1", "parent")
    upstream = {u: f"run-{u}" for u in loaded.spec.stages}
    job = bind_upstream(jobs[step], upstream, {u: {"checkpoint": f"/x/{u}"} for u in upstream},
                        upstream_of(loaded.spec)[step])
    back = StageJob.from_json(json.loads(json.dumps(job.to_json())))
    assert back == job
    assert back.config == loaded.spec.stages[step] and back.seed == loaded.spec.seed_for(step)
    assert back.may_reuse is False and len(back.fingerprint) == 24
    assert back.upstream_runs == {u: f"run-{u}" for u in upstream_of(loaded.spec)[step]} != {}


def test_a_plan_read_back_from_json_keeps_its_typed_actions():
    from dataclasses import asdict

    from flows.planning.lineage import Action, Decision

    decision = Decision("sft", Action.RUN, "forced", forced=True)
    back = Decision(**json.loads(json.dumps({**asdict(decision), "action": decision.action.value})))
    assert back.action is Action.RUN and back.may_reuse is False
    assert Decision("eval", "cached", "same fingerprint", "abc").action is Action.CACHED


# ------------------------------------------------------------------ the shape of the code

PACKAGES = ("flows", "stages")


def _modules() -> dict[str, object]:
    """Module name -> parsed source, for the package's own modules."""
    import ast

    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = ast.parse(path.read_text(encoding="utf-8"), str(path))
    return found


def _imports(tree, modules) -> set[str]:
    """The project's modules a module imports, at any depth of its code (typing-only imports aside)."""
    import ast

    found: set[str] = set()

    def visit(node):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.module:
            candidates = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            found.update(name for name in candidates if name in modules)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def test_no_import_cycles_in_flows_or_stages():
    modules = _modules()
    edges = {name: _imports(tree, modules) - {name} for name, tree in modules.items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(name, path):
        state[name] = 1
        for target in sorted(edges[name]):
            if state.get(target) == 1:
                cycles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target, path + [target])
        state[name] = 2

    for name in sorted(edges):
        if name not in state:
            visit(name, [name])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(cycle) for cycle in cycles)


def test_stage_kinds_do_not_import_each_other():
    """What two kinds share lives beside them (rl_common, preference_training, the packages data, models, rollout, rewards, training);
    ``rl`` alone reaches into the two algorithms it dispatches to."""
    from stages.registry import STAGE_KINDS

    modules = _modules()
    kinds = {f"stages.{kind}" for kind in STAGE_KINDS} | {"stages.grpo", "stages.ppo"}
    allowed = {("stages.rl", "stages.grpo"), ("stages.rl", "stages.ppo")}
    crossings = sorted((name, target) for name in kinds for target in _imports(modules[name], modules) & kinds
                       if target != name and (name, target) not in allowed)
    assert not crossings, crossings


# what each package of flows/ and stages/ may import beyond itself, as its __init__.py docstring says
PACKAGE_IMPORTS = {
    "stages.data": ("stages.rewards",),
    "stages.models": (),
    "stages.training": (),
    "stages.engines": ("stages.models", "stages.training"),
    "stages.rollout": ("stages.engines", "stages.models", "stages.rewards", "stages.training"),
    "stages.rewards": ("stages.models", "stages.preference_math"),
    "flows.spec": ("flows.planning", "flows.execution.distributed"),
    "flows.planning": ("flows.spec", "flows.recording.tags"),
    "flows.execution": ("flows.spec", "flows.planning", "flows.recording", "flows.servers", "flows.terminal"),
    "flows.recording": ("flows.terminal", "flows.servers.db_templates"),
    "flows.servers": ("flows.recording", "flows.spec.loading", "flows.execution.pipeline", "flows.cli"),
}


def test_each_package_imports_only_what_its_docstring_names():
    """stages/data, models, rollout, rewards and training are what the kinds share: none imports a kind;
    flows/ packages import each other only as their docstrings say."""
    modules = _modules()
    anywhere = {"stages", "stages.context", "stages.spec_model", "stages.sampling", "stages.registry", "flows"}
    crossings = []
    for name, tree in modules.items():
        package = next((p for p in PACKAGE_IMPORTS if name == p or name.startswith(p + ".")), None)
        if package is None:
            continue
        root = package.split(".")[0]
        for target in _imports(tree, modules):
            if target in anywhere or not target.startswith(root) or target == package or \
                    target.startswith(package + "."):
                continue
            if not any(target == allowed or target.startswith(allowed + ".") for allowed in PACKAGE_IMPORTS[package]):
                crossings.append((name, target))
    assert not crossings, crossings


def test_the_seed_is_resolved_by_the_planner_alone():
    """A stage's seed is its own, else the pipeline's, decided once (``Pipeline.seed_for``, carried by the job
    into ``ctx.seed``): no stage module reads ``config.seed`` to decide it again."""
    import ast

    readers = sorted(name for name, tree in _modules().items() if name.startswith("stages") for node in ast.walk(tree)
                     if isinstance(node, ast.Attribute) and node.attr == "seed" and isinstance(node.value, ast.Name)
                     and node.value.id == "config")
    assert not readers, readers


def test_iterate_is_called_by_the_planner_alone():
    """``iterate:`` is not threaded through the core: flows/planning/graph.py is the one module that imports
    flows/planning/iterate.py (job.py names its ``RoundStep`` for typing only); spec, execution and recording
    know a round only as ``StageJob.round`` and ``graph.step_round``."""
    modules = _modules()
    importers = sorted(name for name, tree in modules.items() if "flows.planning.iterate" in _imports(tree, modules))
    assert importers == ["flows.planning.graph"], importers


def test_every_sample_is_drawn_by_the_episode_runner():
    """A single completion is a one-turn episode: outside the engines themselves (stages/engines/hf_generate.py,
    in_process_vllm.py, server_client.py), only the runner (stages/rollout/episodes.py) asks an engine for samples; stages sample through
    it (``EpisodeRunner.run``, ``complete``, ``PolicyRollouts``)."""
    import ast

    callers = set()
    for name, tree in _modules().items():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("generate", "generate_ids")):  # an engine's, or a model's own generate
                callers.add(name)
    assert callers == {"stages.rollout.episodes", "stages.engines.hf_generate", "stages.engines.in_process_vllm",
                       "stages.engines.server_client"}, callers


def test_each_stage_kind_is_declared_once_in_its_own_module():
    """A kind is one ``StageKind``: its module's ``KIND``, with that module's ``run``; the registry lists it."""
    import importlib

    from stages.registry import STAGE_KINDS

    for name, kind in STAGE_KINDS.items():
        module = importlib.import_module(f"stages.{name}")
        assert module.KIND is kind and kind.name == name
        assert kind.run is module.run and kind.headline_metrics
    assert {k for k, kind in STAGE_KINDS.items() if kind.world_issues is None} == {"online_dpo", "eval", "benchmark"}
    assert {k for k, kind in STAGE_KINDS.items() if kind.produces != "policy"} == {"reward_model", "eval", "benchmark"}
    assert {k for k, kind in STAGE_KINDS.items() if kind.evaluates} == {"eval", "benchmark"}


MAX_FUNCTION_LINES = 60


def test_no_function_in_flows_or_stages_is_longer_than_a_screen():
    import ast

    long = [f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines"
            for name, tree in _modules().items() for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, long


def test_ranks_train_on_the_data_the_launching_process_resolved(tmp_path, monkeypatch):
    """An iterate round's training data is the failure set the launching process builds; a rank
    that re-resolved the job alone would train on the declared dataset instead."""
    from flows.execution.execute import resolve_inputs
    from flows.planning.graph import upstream_of
    from flows.planning.job import bind_upstream, stage_jobs
    from flows.planning.lineage import Action, Decision
    from flows.execution.rank import rank_inputs

    monkeypatch.setenv("POSTTRAIN_HOME", str(tmp_path))
    loaded = _iterate_pipeline()
    step = next(name for name in loaded.spec.stages if "@" in name and loaded.spec.stages[name].kind == "sft")
    decisions = [Decision(name, Action.RUN, "forced", forced=True) for name in loaded.spec.stages]
    outputs = {u: {"checkpoint": f"/x/{u}", "failures": f"/x/{u}/failures.jsonl"} for u in loaded.spec.stages}
    job = bind_upstream(stage_jobs(loaded, decisions, "1", "parent")[step], {u: f"run-{u}" for u in outputs},
                        outputs, upstream_of(loaded.spec)[step])
    declared = resolve_inputs(job.loaded, job.stage, job.upstream_outputs, tmp_path)
    launched = declared.with_data(tmp_path / "round-data.jsonl")  # what failure_set_inputs returns
    on_rank = rank_inputs(job, {"paths": launched.paths()}, tmp_path)
    assert on_rank.data == launched.data != declared.data
    assert on_rank.rewards.keys() == declared.rewards.keys()
