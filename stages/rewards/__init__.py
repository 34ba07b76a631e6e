"""Rewards: where every sample is scored (``scoring``, the one scorer). It may import ``stages.models``,
``stages.sampling``, ``stages.context`` and ``stages.preference_math``; never ``stages.rollout`` or a stage kind."""
