"""``posttrain check-reward``: known cases scored before any training budget is spent."""

from __future__ import annotations

import sys

from stages.context import StageInputs
from stages.rewards.known_cases import check_reward_cases
from stages.rewards.spec import JUDGE_FN


def check_rewards_command(loaded, only: list[str], console) -> int:
    """Print a table of every declared case; 0 if all hold, 1 on a violation, 2 if nothing to check."""
    from rich.table import Table

    checks = loaded.spec.reward_checks
    names = only or list(checks)
    missing = [n for n in names if n not in checks]
    environments = {name: config for name, config in loaded.spec.stages.items()
                    if getattr(config, "environment", None) is not None and config.environment.checks}
    if environments and not only and not checks:
        return check_environments(loaded, environments, console)
    if missing or not names:
        declared = ", ".join(checks) or "none"
        print(f"{loaded.path}: no reward_checks declared for {', '.join(missing) or 'any reward'} "
              f"(declared: {declared}); nothing was checked", file=sys.stderr)
        return 2
    specs = loaded.rewards_for(names)
    judges = _bound_judges(loaded, {n: s for n, s in specs.items() if s.fn == JUDGE_FN})
    results = [r for name in names for r in check_reward_cases(name, specs[name], checks[name], judges.get(name))]
    table = Table(title=f"reward checks · {loaded.spec.name}")
    for column in ("reward", "case", "completion", "answer", "score", "parsed", "expected", "verdict"):
        table.add_column(column)
    for r in results:
        expected = ", ".join(part for part in (
            f">= {r.case.min:g}" if r.case.min is not None else "",
            f"<= {r.case.max:g}" if r.case.max is not None else "",
            f"parsed={r.case.parsed}" if r.case.parsed is not None else "",
            f"steps {_scores(r.case.steps)}" if r.case.steps is not None else "") if part)
        verdict = "ok" if not r.violations else "VIOLATION: " + "; ".join(r.violations)
        score = f"{r.score:g}" + (f" steps {_scores(r.steps)}" if r.steps is not None else "")  # a process reward's
        table.add_row(r.reward, r.case.case, r.completion_repr, str(r.case.answer), score, str(r.parsed),
                      expected, verdict, style="red" if r.violations else None)
    console.print(table)
    bad = sum(1 for r in results if r.violations)
    console.print(f"{len(results)} cases, {bad} violation{'s' if bad != 1 else ''}")
    status = check_environments(loaded, environments, console) if environments and not only else 0
    return 1 if bad or status else 0


def check_environments(loaded, stages: dict, console) -> int:
    """Replay every stage environment's known episodes; 0 if all hold, 1 on a violation."""
    from rich.table import Table

    from stages.rollout.episode_checks import check_episode_cases

    table = Table(title=f"environment checks · {loaded.spec.name}")
    for column in ("stage", "case", "turns", "answer", "score", "ended", "tool errors", "verdict"):
        table.add_column(column)
    bad = total = 0
    distinct: dict[str, list[str]] = {}  # stages sharing one environment (a YAML anchor) are checked once
    for name, config in stages.items():
        distinct.setdefault(repr((config.environment, config.reward_names())), []).append(name)
    for names in distinct.values():
        config, name = stages[names[0]], ", ".join(names)
        for r in check_episode_cases(config.environment, loaded.rewards_for(config.reward_names()),
                                     config.environment.checks):
            total, bad = total + 1, bad + bool(r.violations)
            verdict = "ok" if not r.violations else "VIOLATION: " + "; ".join(r.violations)
            table.add_row(name, r.case.case, repr(r.case.turns)[:120], str(r.case.answer), f"{r.score:g}",
                          r.episode.ended, str(r.episode.tool_errors), verdict, style="red" if r.violations else None)
    console.print(table)
    console.print(f"{total} episode cases, {bad} violation{'s' if bad != 1 else ''}")
    return 1 if bad else 0


def _bound_judges(loaded, judges: dict) -> dict:
    """The judges of ``fn: judge`` rewards with known cases: a judge function, a model of its own, or the
    pipeline's base model (a stage's checkpoint does not exist before it has trained: the validator refuses such cases)."""
    if not judges:
        return {}
    from flows.recording.home import configure_environment, ensure_home
    from stages.models.loading import resolve_base_checkpoint
    from stages.scorers import bind_scorers

    home = ensure_home(configure_environment())
    spec = loaded.spec
    from flows.execution.execute import judge_model_inputs

    scorers = judge_model_inputs(judges, spec.seed, home, loaded.base_dir)
    for name, reward in judges.items():
        if reward.stage == "base":
            scorers[name] = resolve_base_checkpoint(spec.model, spec.seed, home / "cache" / "models", loaded.base_dir)
    inputs = StageInputs(trust_remote_code=bool(getattr(spec.model, "trust_remote_code", False)),
                         judge_cache=home / "cache" / "judge", scorer_checkpoints=scorers)
    return bind_scorers(judges, inputs)


def _scores(values: list[float]) -> str:
    return "[" + ", ".join(f"{v:g}" for v in values) + "]"
