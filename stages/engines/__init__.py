"""Engines: what draws samples from a model, under the one sampling schema (``stages.sampling``).

An *engine* samples, takes new policy weights (``take_weights``) and closes; a *backend* names its kind
(``hf``, ``vllm``, ``vllm_server``); the *server* is a stage's own vLLM process; the *sampler* is what drew a
sample. ``opening`` picks the backend and opens its engine; ``interface`` is the protocol and seed scheme; one
engine per module (``hf_generate``, ``in_process_vllm``, ``server_client`` over ``server_process``);
``weights`` syncs the policy into an engine. May import ``stages.models`` and ``stages.training``; never
``stages.rollout``, ``stages.rewards`` or a stage kind. No module imports vLLM at import time.
"""
