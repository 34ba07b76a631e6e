"""Known episodes of an environment, scored before training (``check-reward`` for agents) (docs/algorithms.md)."""

from __future__ import annotations

from dataclasses import dataclass

from stages.rollout.environments import EnvironmentSpec, EpisodeCase, build_environment
from stages.rollout.episodes import Episode, environment_scorers, replay, shortcut
from stages.rewards.scoring import score_component
from stages.rewards.spec import RewardSpec


@dataclass
class EpisodeCaseResult:
    environment: str
    case: EpisodeCase
    episode: Episode
    score: float
    errors: list[str]

    @property
    def violations(self) -> list[str]:
        problems = [f"reward raised {e}" for e in self.errors]
        if self.case.min is not None and self.score < self.case.min:
            problems.append(f"score {self.score:g} < min {self.case.min:g}")
        if self.case.max is not None and self.score > self.case.max:
            problems.append(f"score {self.score:g} > max {self.case.max:g}")
        if self.case.ended is not None and self.episode.ended != self.case.ended:
            problems.append(f"ended {self.episode.ended}, expected {self.case.ended}")
        if self.case.tool_errors is not None and self.episode.tool_errors != self.case.tool_errors:
            problems.append(f"{self.episode.tool_errors} tool error(s), expected {self.case.tool_errors}")
        return problems


def check_episode_cases(spec: EnvironmentSpec, rewards: dict[str, RewardSpec],
                        cases: list[EpisodeCase]) -> list[EpisodeCaseResult]:
    """Replay and score every case; a result with violations means do not train in this environment."""
    environment = build_environment(spec)
    environment.check()
    results = []
    for case in cases:
        episode = replay(environment, spec, [{"role": "user", "content": case.prompt}], case.turns)
        columns = {"answer": [case.answer], "prompts": [episode.messages[:1]]}
        total, errors = 0.0, []
        bound = environment_scorers(rewards, environment, [episode])  # `environment`: its own score
        for name, reward in rewards.items():
            scored = score_component(name, reward, [episode.answer or ""], columns, bound.get(name))
            total += reward.weight * scored.scores[0]
            errors += [message for _, message in scored.errors]
        if shortcut(episode, spec):
            total = 0.0
        results.append(EpisodeCaseResult(spec.fn, case, episode, total, errors))
    return results
