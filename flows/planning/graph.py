"""The stage graph, derived from references between stages (never declared twice), and the planner's
checks of it (no cycles, rounds that can unroll).

This is the one module that calls ``iterate``: it unrolls an ``iterate:`` block's rounds into steps
(``expand_rounds``), adds the edge from ``train@r`` to the failure set it reads, and answers which
round a step belongs to; a step's job carries the rest (``StageJob.round``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flows.planning.iterate import (
    FAILURES_INPUT,
    RoundStep,
    downstream,
    failure_references,
    iterate_issues,
    round_step,
    split_step,
    step_name,
)
from stages.rewards.spec import reward_input_key

if TYPE_CHECKING:
    from flows.spec.schema import Pipeline

BASE = "base"  # the reserved name of the pipeline's own model in stage references


def stage_references(pipeline: Pipeline, stage: str) -> dict[str, str]:
    """Every stage a stage reads a checkpoint from, by input name: its own reference fields,
    plus the reward_model stage of each reward it scores with (``rewards.<reward>``), plus,
    for round r of an ``iterate:`` pipeline's training stage, the eval step whose failure set
    it trains on (``failures``: that one is read for its failures.jsonl, not a checkpoint)."""
    config = pipeline.stages[stage]
    refs = dict(config.references())
    for reward in config.reward_names():
        spec = pipeline.rewards.get(reward)
        if spec is not None and spec.stage:
            refs[reward_input_key(reward)] = spec.stage
    refs.update(failure_references(pipeline, stage))
    return refs


def reference_output(input_name: str) -> str:
    """The output of its target a reference reads: the failure set for ``failures``, else the checkpoint."""
    return "failures" if input_name == FAILURES_INPUT else "checkpoint"


def step_round(step: str) -> tuple[str, int]:
    """(the stage a step repeats, its round): ``sft@2`` -> (``sft``, 2); a stage is its own round 1."""
    return split_step(step)


def round_of(pipeline: Pipeline, step: str) -> RoundStep | None:
    """The round a step belongs to where the pipeline iterates (its tags, fingerprint and data), else None."""
    return round_step(pipeline, step)


def upstream_of(pipeline: Pipeline) -> dict[str, list[str]]:
    """stage -> the stages it reads outputs from (``base`` is not a stage)."""
    return {
        name: [t for t in dict.fromkeys(stage_references(pipeline, name).values()) if t != BASE]
        for name in pipeline.stages
    }


def topological_order(pipeline: Pipeline) -> list[str]:
    """Stages in dependency order; ties keep declaration order. The spec has no cycles."""
    edges = upstream_of(pipeline)
    order, done = [], set()

    def visit(name):
        if name in done:
            return
        for upstream in edges[name]:
            visit(upstream)
        done.add(name)
        order.append(name)

    for name in pipeline.stages:
        visit(name)
    return order


def ancestors(pipeline: Pipeline, stage: str) -> set[str]:
    edges, found, todo = upstream_of(pipeline), set(), [stage]
    while todo:
        for upstream in edges[todo.pop()]:
            if upstream not in found:
                found.add(upstream)
                todo.append(upstream)
    return found


def descendants(pipeline: Pipeline, stage: str) -> set[str]:
    return downstream(upstream_of(pipeline), stage)


def render_graph(pipeline: Pipeline) -> str:
    """One line per stage in run order: ``name (kind) <- upstream, ...``."""
    lines = []
    for name in topological_order(pipeline):
        config = pipeline.stages[name]
        sources = [f"{field}={target}" for field, target in stage_references(pipeline, name).items()]
        sources += [f"data={d}({pipeline.data[d].role})" for d in config.dataset_names()]
        lines.append(f"  {name} ({config.kind}) <- {', '.join(sources)}")
    return "\n".join(lines)


# ------------------------------------------------------------------ unrolling the rounds


def expand_rounds(pipeline):
    """The pipeline with round 2..R's steps added after round 1's stages (their references renamed)."""
    spec = getattr(pipeline, "iterate", None)
    if spec is None or spec.rounds == 1:
        return pipeline
    repeated = [name for name in pipeline.stages
                if name == spec.train or name in descendants(pipeline, spec.train)]
    stages = dict(pipeline.stages)
    for round_ in range(2, spec.rounds + 1):
        for name in repeated:
            config = pipeline.stages[name]
            renamed = {field: step_name(target, round_) for field, target in config.references().items()
                       if target in repeated}
            assert all(hasattr(config, field) for field in renamed), (name, renamed)  # references() names fields
            stages[step_name(name, round_)] = config.model_copy(update=renamed)
    return pipeline.model_copy(update={"stages": stages})


# ------------------------------------------------------------------ the planner's checks


def graph_issues(declared, stages: dict, rewards: dict, raw_iterate, raw_data: dict,
                 raw_rewards: dict) -> list[tuple[tuple, str]]:
    """(YAML path, message) for each dependency cycle and each way the ``iterate:`` block cannot unroll or
    would leak. ``declared``: every stage name in the file; ``stages`` / ``rewards``: what validated of them."""
    declared = set(declared)
    edges = {n: [t for t in c.references().values() if isinstance(t, str) and t in declared]
             + [rewards[r].stage for r in c.reward_names() if r in rewards and rewards[r].stage in declared]
             for n, c in stages.items()}
    issues = iterate_issues(raw_iterate, stages, raw_data, raw_rewards, edges)
    for cycle in find_cycles(edges):
        issues.append((("stages", cycle[0]), "dependency cycle: " + " -> ".join(cycle)))
    return issues


def find_cycles(edges: dict[str, list[str]]) -> list[list[str]]:
    """Each distinct cycle in a stage -> upstream graph, as a closed path."""
    cycles, seen_sets = [], set()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in edges.get(node, []):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                key = frozenset(cycle)
                if key not in seen_sets:
                    seen_sets.add(key)
                    cycles.append(cycle)
            elif state.get(nxt) is None and nxt in edges:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in edges:
        if state.get(node) is None:
            visit(node)
    return cycles
