"""Stage kind ``rl``: learning from rewards, with a KL anchor to a reference policy. Design: docs/algorithms.md."""

from __future__ import annotations

from stages.context import StageInputs, StageKind
from stages.rl_common import RLStageConfig, rl_model_for

__all__ = ["RLStageConfig", "RewardCheckFailed", "run", "verify_rewards"]


class RewardCheckFailed(RuntimeError):
    """A reward failed its declared known cases: training on it would waste the budget."""


def verify_rewards(inputs: StageInputs, ctx, environment=None) -> None:
    """Run the reward cases and ``environment``'s known episodes; refuse to train on a violation (tabled)."""
    from stages.scorers import bind_scorers
    from stages.rewards.known_cases import check_reward_cases
    from stages.rewards.spec import JUDGE_FN

    checked = {n: inputs.rewards[n] for n in inputs.reward_checks}
    judges = bind_scorers({n: s for n, s in checked.items() if s.fn == JUDGE_FN}, inputs)
    results = [r for name, cases in inputs.reward_checks.items()
               for r in check_reward_cases(name, inputs.rewards[name], cases, judges.get(name))]
    ctx.log_table([{"reward": r.reward, "case": r.case.case, "completion": r.completion_repr, "score": r.score,
                    "parsed": r.parsed, "violations": "; ".join(r.violations)} for r in results],
                  "reward_checks.json")
    lines = [f"{r.reward} [{r.case.case}] {r.case.completion!r}: {'; '.join(r.violations)}"
             for r in results if r.violations]
    if environment is not None and environment.checks:  # known episodes, replayed through the environment
        from stages.rollout.episode_checks import check_episode_cases

        episodes = check_episode_cases(environment, inputs.rewards, environment.checks)
        ctx.log_table([{"environment": r.environment, "case": r.case.case, "turns": repr(r.case.turns)[:200],
                        "score": r.score, "ended": r.episode.ended, "tool_errors": r.episode.tool_errors,
                        "violations": "; ".join(r.violations)} for r in episodes], "environment_checks.json")
        lines += [f"{r.environment} [{r.case.case}] {r.case.turns!r}: {'; '.join(r.violations)}"
                  for r in episodes if r.violations]
    if lines:
        raise RewardCheckFailed(f"{len(lines)} reward check(s) failed, not training:\n" + "\n".join(lines))


def run(config: RLStageConfig, inputs: StageInputs, ctx) -> dict:
    if config.check_rewards:
        verify_rewards(inputs, ctx, config.environment)
    if config.difficulty_filter is not None:  # train on the prompts the starting policy sometimes solves
        from stages.difficulty import filter_prompts

        inputs = inputs.with_data(filter_prompts(config, inputs, ctx))
    if config.algorithm == "grpo":
        from stages.grpo import train_grpo

        return train_grpo(config, inputs, ctx)
    from stages.ppo import train_ppo

    return train_ppo(config, inputs, ctx)


KIND = StageKind("rl", RLStageConfig, run, ("reward/mean", "kl", "steps"), produces="policy", reads="prompts",
                 world_issues=lambda config, world, resources: config.world_issues(world, resources),
                 choose=rl_model_for)
