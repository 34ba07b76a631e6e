"""Data: what a stage trains and evaluates on, in one canonical record form. It may import ``stages.spec_model``
and ``stages.rewards`` (answer formats); never a stage kind or the rollout layer."""
