"""The stage graph, derived from references between stages (never declared twice)."""

from __future__ import annotations

from flows.iterate import downstream, failure_references
from flows.spec import BASE, Pipeline
from stages.rewards import reward_input_key


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
