"""The rollout layer: where every sample is made, through an engine of ``stages.engines`` (``episodes``), and
how a training stage draws its policy's batch (``policy_sampler``). May import ``stages.engines``,
``stages.models``, ``stages.training`` and ``stages.rewards``; never a stage kind."""
