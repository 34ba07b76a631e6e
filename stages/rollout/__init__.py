"""The rollout layer: where every sample is made, through an engine of ``stages.engines``.

``episodes`` runs every draw (a single completion is a one-turn episode); ``environments`` and
``episode_checks`` are what agents' episodes run against; ``policy_sampler`` is how a training stage (PPO,
online DPO, GRPO) draws its policy's batch; ``policy_rollouts`` and ``served_rollouts`` are GRPO's rollouts
for TRL, in process or from a generation server; ``model_judge`` a judge's replies. May import
``stages.engines``, ``stages.models``, ``stages.training`` and ``stages.rewards``; never a stage kind.
"""
