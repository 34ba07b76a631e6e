"""GRPO's rollouts for TRL (its ``rollout_func``): each step's episodes drawn by the stage's engine, with the
policy's weights synced into it, or by generate on the training model itself. Design: docs/algorithms.md."""

from __future__ import annotations

from contextlib import contextmanager

from stages.rollout.policy_sampler import PolicySampler
from stages.sampling import SamplingSettings


class PolicyRollouts:
    """TRL ``rollout_func``: ``group_size`` episodes of each distinct prompt TRL hands over, by ``runner``
    (one-turn completions or an environment's episodes), with ``env_mask`` (TRL's ``tool_mask``) and, per
    episode, what the reward functions read (stages/grpo.py); episode metrics go to ``step_metrics``.

    Sampled by the engine ``opener`` returns (opened on first use, synced after each update), by the engine a
    caller hands ``draw``, or else by generate on the training model. A call's draws are seeded
    ``seed + draw_offset(call, prompt index)``, so a rerun draws the same rollouts; ``trainer_stream`` draws
    from the trainer's random stream instead (docs/algorithms.md, section `stages/rollout/policy_rollouts.py`).
    """

    def __init__(self, runner, tokenizer, settings: SamplingSettings, opener=None, step_metrics=None,
                 trainer_stream: bool = False, opened_holds_weights: bool = False):
        self.tokenizer = tokenizer
        self.trainer_stream = trainer_stream
        self.group_size = settings.attempts
        # settings seeded with the stage's seed
        self.sampler = PolicySampler(runner, settings, opener=opener, opened_holds_weights=opened_holds_weights)
        self.step_metrics = step_metrics
        self.calls = 0  # seeds each call's draws (several per step with dynamic sampling)

    @property
    def runner(self):
        return self.sampler.runner

    @property
    def settings(self) -> SamplingSettings:
        return self.sampler.settings

    def close(self) -> None:
        self.sampler.close()

    def synced(self, trainer):
        """The engine, holding the weights of the policy ``trainer`` trains now (taken once per optimizer step)."""
        self.sampler.take(trainer.model, trainer.state.global_step)
        return self.sampler.engine

    @contextmanager
    def engine_for(self, trainer):
        """The synced engine, or else generate on the training model unwrapped as TRL unwraps it for its own."""
        if self.sampler.opener is not None:
            yield self.synced(trainer)
            return
        from contextlib import nullcontext

        from trl.models import unwrap_model_for_generation

        from stages.engines.hf_generate import HFEngine

        summoned = getattr(trainer, "_dist", None)  # TRL's DistributedBackend: a no-op but for FSDP v1
        with unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator,
                                         gather_deepspeed3_params=trainer.args.ds3_gather_for_generation,
                                         gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs
                                         ) as model, \
                (summoned.summon_full_params(trainer.model_wrapped, recurse=False) if summoned else nullcontext()):
            yield HFEngine(model, self.tokenizer, prompt_batch_size=256, keep_logprobs=True,
                           weights_version=trainer.state.global_step, seeded=not self.trainer_stream)

    def __call__(self, prompts: list, trainer) -> dict:
        first = trainer.accelerator.process_index * (len(prompts) // self.group_size)  # this process's shard
        with self.engine_for(trainer) as engine:
            out = self.draw(prompts, engine, self.calls, first)
        self.calls += 1
        self.consumed(out, trainer)
        return out

    def draw(self, prompts: list, engine, call: int, first_prompt: int = 0) -> dict:
        """The episodes of each distinct prompt by ``engine``, the stage's draw ``call`` (``first_prompt``: this
        process's first distinct prompt in it): TRL's rollout columns, and an environment's."""
        from stages.rollout.episodes import shortcut

        distinct = prompts[:: self.group_size]
        if [p for p in distinct for _ in range(self.group_size)] != list(prompts):
            raise RuntimeError(f"expected each prompt {self.group_size} times in a row from TRL's sampler; "
                               f"got {len(prompts)} prompts that are not so grouped")
        episodes = [e for group in self.sampler.draw(distinct, call, first_prompt, engine) for e in group]
        out = {"prompt_ids": [e.prompt_ids for e in episodes],
               "completion_ids": [e.completion_ids for e in episodes],
               "logprobs": [e.logprobs for e in episodes]}
        if self.runner.environment is None:
            return out
        return {**out, "env_mask": [e.env_mask for e in episodes],
                "episode_answer": [e.answer if e.answer is not None else "" for e in episodes],
                "episode_rewardable": [not shortcut(e, self.runner.spec) for e in episodes],
                "episode": episodes}  # what an `environment` reward scores (the environment's own score)

    def consumed(self, out: dict, trainer) -> None:
        """The episode metrics of a batch the trainer uses, to ``step_metrics``."""
        from stages.rollout.episodes import episode_metrics

        if self.runner.environment is None:
            return
        if self.step_metrics is not None and trainer.model.training:
            self.step_metrics.update(episode_metrics(out["episode"], self.runner.spec))

    def for_thread(self) -> PolicyRollouts:
        """A copy that draws in another thread, its runner with a tokenizer of its own (a fast tokenizer used from
        two threads at once, one of them TRL's setting its padding, fails with "Already borrowed")."""
        import copy

        twin = copy.copy(self)
        twin.sampler = copy.copy(self.sampler)
        twin.sampler.runner = copy.copy(self.runner)
        twin.tokenizer = twin.sampler.runner.tokenizer = copy.deepcopy(self.tokenizer)
        return twin
