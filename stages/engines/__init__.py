"""Engines: what draws samples from a model (HF generate, in-process vLLM, a generation server), one per module;
terms in docs/algorithms.md. May import ``stages.models`` and ``stages.training``; never ``stages.rollout``,
``stages.rewards`` or a stage kind. No module imports vLLM at import time."""
