"""The rollout layer: where every sample is made.

The episode runner every sample is drawn by (``episodes``): a single completion is a one-turn episode,
an agent's episode is model turns and environment observations, as token ids with an observation mask;
the generation engines under the one sampling schema (``stages.sampling``) (HF generate, the in-process vLLM engine, with
its context budget and version: ``generation``); rollouts for a training stage, with the policy's
weights synced into the engine after each optimizer step (``training``); a judge model's replies (``model_judge``); the environments they run
against (``environments``) and their known-episode checks (``episode_checks``); generation apart from
training: a vLLM server of the stage's own in processes of its own (``server``, kept from outliving its
stage by ``guard``, taking each batch in whole through ``server_routes``) and GRPO's
rollouts drawn from it up to ``max_staleness`` steps ahead of training (``ahead``). Each sample carries
its token ids and the sampler's log-probs. It may import ``stages.models``, ``stages.training`` (a
stage's several processes) and, to score an episode, ``stages.rewards``; never a stage kind.
"""
