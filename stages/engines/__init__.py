"""Engines: what draws samples from a model, under the one sampling schema (``stages.sampling``).

Words used here and by every caller: an *engine* is an object that samples (``generate``, ``generate_ids``),
takes a new version of the policy's weights (``take_weights``) and closes; a *backend* is which kind of
engine, by name (``hf``, ``vllm``, ``vllm_server``), as a stage declares it and logs it resolved; the *server*
is a vLLM server process of a stage's own; the *sampler* is what drew a sample (its log-probs, pi_sampler in a
sampler correction). ``opening`` decides the backend (``choose_backend``) and opens its
engine (``open_engine``); ``interface`` is what every engine returns (``Sample``) and how draws are seeded;
one engine per module: ``hf_generate`` (transformers' generate), ``in_process_vllm`` (vLLM in the stage's
process), ``server_client`` (the HTTP client of a server), whose process lifecycle is ``server_process``
(kept from outliving its stage by ``server_guard``, taking each batch in whole through ``server_routes``);
``weights`` exports the policy's weights and syncs them into an engine; ``machine`` says what this machine's
vLLM can serve; ``settings`` is the ``engine:`` and ``generation:`` a stage declares. It may import
``stages.models`` and ``stages.training``; never ``stages.rollout``, ``stages.rewards`` or a stage kind. No
module imports vLLM at import time.
"""
