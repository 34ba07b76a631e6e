"""The bound scorers of a stage's rewards (reward models, judges): where rewards/ meets rollout/, since a model
judge samples through the generation engine and rewards/ imports nothing of rollout/."""

from __future__ import annotations

from stages.context import StageInputs
from stages.rewards.reward_model import bind_reward_models
from stages.rewards.spec import RewardSpec
from stages.rollout.model_judge import open_model_judge


def bind_scorers(rewards: dict[str, RewardSpec], inputs: StageInputs, where: str = "policy") -> dict:
    """Every reward model and judge of ``rewards`` bound, a model judge sampling through the generation engine."""
    return bind_reward_models(rewards, inputs, where, open_model_judge)
