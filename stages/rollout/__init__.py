"""The rollout layer: where every sample is made, through an engine of ``stages.engines``.

The episode runner every sample is drawn by (``episodes``): a single completion is a one-turn episode,
an agent's episode is model turns and environment observations, as token ids with an observation mask;
GRPO's rollouts for TRL, with the policy's weights synced into the engine after each optimizer step
(``policy_rollouts``), and from a generation server, drawn up to ``max_staleness`` steps ahead of training
(``served_rollouts``); a judge model's replies (``model_judge``); the environments episodes run against
(``environments``) and their known-episode checks (``episode_checks``). Each sample carries its token ids
and the sampler's log-probs. It may import ``stages.engines``, ``stages.models``, ``stages.training`` (a
stage's several processes) and, to score an episode, ``stages.rewards``; never a stage kind.
"""
