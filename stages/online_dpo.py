"""Stage kind ``online_dpo``: DPO on pairs sampled from the policy being trained, ranked by a reward.

Departs from TRL's OnlineDPOTrainer: best against worst of ``attempts`` samples per prompt, ties
skipped and counted rather than trained on; sigmoid DPO against a frozen reference. Design: docs/algorithms.md."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from stages.engines.settings import BackendName, EngineSettings, GenerationSettings, generation_rules
from stages.training.alerts import AlertSettings
from stages.context import ExecutionLimits, StageInputs, StageKind
from stages.training.resume import Resumable
from stages.data.prompt_order import prompt_batches
from stages.data.sources import prompt_messages, read_materialized
from stages.sampling import ROLLOUT_DEFAULTS, ROLLOUT_SAMPLING, SamplingSettings
from stages.models.lora import LORA_DESCRIPTION, LoraSpec
from stages.preference_training import PolicyAgainstReference  # shared with dpo and kto

MAX_GRAD_NORM = 1.0
SAMPLE_TABLE_ROWS = 16


class OnlineDPOStageConfig(PolicyAgainstReference, ExecutionLimits, Resumable):
    """Online DPO: pairs sampled from the current policy each step, ranked by rewards, trained with DPO."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["online_dpo"] = Field(description="Stage kind.")
    model: str = Field(description="Stage whose checkpoint the policy starts from, or `base`.")
    reference: str | None = Field(
        None, description="Stage whose checkpoint is the frozen DPO reference; default the policy's starting "
        "checkpoint (the only one allowed with `lora`).")
    data: str = Field(description="Prompts to sample from (name under `data:`); must not be `heldout`.")
    rewards: list[str] = Field(min_length=1, description="Rewards that rank each prompt's samples (names under "
                               "`rewards:` or built-ins), summed by weight; weight 0 is logged, not ranked on.")
    sampling: ROLLOUT_SAMPLING = Field(
        default_factory=lambda: SamplingSettings(**ROLLOUT_DEFAULTS, attempts=2),
        description="How the pairs' candidates are sampled: temperature, top_p, max_tokens, attempts "
        "(completions per prompt, at least 2; chosen is the best, rejected the worst).")
    prompts_per_step: int = Field(16, ge=1, le=4096, description="Prompts sampled per step (at most one pair each).")
    max_steps: int = Field(50, ge=1, description="Steps: sample, score, pair, one optimizer step on the pairs.")
    beta: float = Field(0.1, gt=0.0, description="DPO's beta: strength of the implicit KL anchor to the reference "
                        "(higher keeps the policy closer).")
    lr: float = Field(5e-5, gt=0, le=1.0, description="Learning rate (constant, AdamW).")
    seed: int | None = Field(None, description="Stage seed (prompt order, sampling); default the pipeline seed.")
    sample_every: int = Field(10, ge=1, description="Log a table of scored pairs every N steps.")
    alerts: AlertSettings = Field(default_factory=AlertSettings, description="When the stage says it is learning "
                                  "nothing and why (stages/training/alerts.py): all rewards 0 (every prompt tied), a reward "
                                  "that cannot parse the replies, or replies cut by the token budget.")
    reward_errors: Literal["fail", "score"] = Field(
        "fail", description="On a reward exception: fail the stage after `max_reward_errors`, or score 0 and count.")
    max_reward_errors: int = Field(0, ge=0, description="Reward exceptions tolerated before the stage fails.")
    backend: BackendName = Field(
        "auto", description="Sampling engine: `vllm` (posttrain's in-process engine, the policy's weights pushed "
        "in before every step), `hf` (transformers generate on the policy) or `auto` (vLLM wherever it can serve "
        "the model, else hf); logged as resolved_backend.")
    engine: EngineSettings = Field(default_factory=EngineSettings, description="vLLM engine settings for sampling.")
    lora: LoraSpec | None = Field(None, description=LORA_DESCRIPTION + " The reference is then the starting "
                                  "checkpoint with the adapters off (no second copy loaded).")
    generation: GenerationSettings = Field(
        default_factory=GenerationSettings,
        description="Where the candidates are sampled. `mode: server` starts a vLLM server for the stage in "
        "processes of its own (stages/engines/server_process.py) and serves it each update's weights before the next "
        "step's draw (a LoRA adapter over HTTP, full weights by reload from disk). Synchronous: max_staleness 0.")

    @model_validator(mode="after")
    def _generation_rules(self):
        generation_rules(self.generation, self.backend)
        return self

    @model_validator(mode="after")
    def _pairs_and_reference(self):
        if self.sampling.attempts < 2:
            raise ValueError(f"online_dpo needs sampling.attempts >= 2 to make a pair of each prompt's samples "
                             f"(got {self.sampling.attempts})")
        self.lora_reference_rule()
        return self

    def reward_names(self) -> list[str]:
        return list(self.rewards)


@dataclass
class PairBatch:
    """B pairs as 2B right-padded rows, chosen rows first: ``input_ids`` / ``attention`` 2B x L and
    ``completion_mask`` 2B x L marking the completion tokens whose log-probs are summed."""

    input_ids: "torch.Tensor"  # noqa: F821 (torch is imported lazily)
    attention: "torch.Tensor"  # noqa: F821
    completion_mask: "torch.Tensor"  # noqa: F821

    @property
    def n_pairs(self) -> int:
        return self.input_ids.shape[0] // 2


def pair_batch(prompt_ids: list[list[int]], chosen: list[list[int]], rejected: list[list[int]],
               pad_id: int) -> PairBatch:
    """Rows ``prompt + completion`` (token ids as sampled, never re-tokenised text), chosen then rejected."""
    import torch

    rows = [(p, c) for p, c in zip(prompt_ids, chosen)] + [(p, r) for p, r in zip(prompt_ids, rejected)]
    width = max(len(p) + len(c) for p, c in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    completion = torch.zeros((len(rows), width))
    for i, (prompt, reply) in enumerate(rows):
        n = len(prompt) + len(reply)
        input_ids[i, :n] = torch.tensor(list(prompt) + list(reply))
        attention[i, :n] = 1
        completion[i, len(prompt):n] = 1.0
    return PairBatch(input_ids, attention, completion)


def sequence_logps(model, batch: PairBatch):
    """log pi(completion | prompt) per row: token log-probs summed over the completion (2B)."""
    import torch

    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention).logits[:, :-1].float()
    targets = batch.input_ids[:, 1:]
    token_logps = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return (token_logps * batch.completion_mask[:, 1:].to(token_logps)).sum(-1)


def dpo_step_loss(policy, reference, batch: PairBatch, beta: float):
    """(loss, chosen implicit rewards, rejected implicit rewards, policy log-probs 2B, reference 2B)."""
    import torch

    from stages.preference_math import dpo_loss

    policy_logps = sequence_logps(policy, batch)
    with torch.no_grad():
        reference_logps = sequence_logps(reference, batch)
    n = batch.n_pairs
    loss, chosen, rejected = dpo_loss(policy_logps[:n], policy_logps[n:], reference_logps[:n],
                                      reference_logps[n:], beta)
    return loss, chosen, rejected, policy_logps, reference_logps


@dataclass
class OnlineDPORun:
    """What one online_dpo stage holds between steps."""

    config: OnlineDPOStageConfig
    policy: object
    reference: object
    tokenizer: object
    optimizer: object
    scorer: object  # stages/rewards/scoring.py Scorer
    seed: int
    sampler: object = None  # stages/rollout/policy_sampler.py PolicySampler: draws each step's samples
    engine_syncs: int = 0
    tied_prompts: int = 0
    pairs_trained: int = 0

    @classmethod
    def load(cls, config: OnlineDPOStageConfig, inputs: StageInputs, seed: int, ctx=None) -> "OnlineDPORun":
        """Policy, reference and optimiser loaded for ``config``; judges audited into ``ctx``'s run."""
        import torch

        from stages.rewards.judge import batch_auditor
        from stages.models.loading import load_policy_and_reference
        from stages.scorers import bind_scorers
        from stages.rewards.scoring import RewardErrorPolicy, Scorer

        start = inputs.model
        trust = inputs.trust_remote_code
        policy, reference, tokenizer = load_policy_and_reference(start, inputs.reference, config.lora, trust)
        policy.eval()  # no dropout anywhere
        trainable = [p for p in policy.parameters() if p.requires_grad]
        bound = bind_scorers(inputs.rewards, inputs)
        auditor = batch_auditor(inputs.rewards, bound, ctx) if ctx is not None else None
        return cls(config, policy, reference, tokenizer, torch.optim.AdamW(trainable, lr=config.lr),
                   Scorer(inputs.rewards, RewardErrorPolicy.of(config), bound, auditor), seed)

    def resumable_state(self) -> tuple[dict, dict]:
        """(tensors, JSON-able state) of everything the next step depends on besides the loop's record."""
        import torch

        tensors = {"policy": self.policy.state_dict(), "optimizer": self.optimizer.state_dict(),
                   "torch_rng": torch.get_rng_state()}
        return tensors, {"engine_syncs": self.engine_syncs, "tied_prompts": self.tied_prompts,
                         "pairs_trained": self.pairs_trained, "reward_errors": self.scorer.policy.state()}

    def restore(self, tensors: dict, state: dict) -> None:
        import torch

        self.policy.load_state_dict(tensors["policy"])
        self.optimizer.load_state_dict(tensors["optimizer"])
        torch.set_rng_state(tensors["torch_rng"])
        self.engine_syncs, self.tied_prompts = state["engine_syncs"], state["tied_prompts"]
        self.pairs_trained = state["pairs_trained"]
        self.scorer.policy.restore(state["reward_errors"])

    def sample(self, prompts: list[list[dict]], step: int):
        """``attempts`` single completions of each prompt: the stage's draw ``step - 1``, as samples."""
        # the policy the last update left: sampled itself, merged into the engine, or served
        self.engine_syncs += self.sampler.take(self.policy, step - 1)
        return [[episode.as_sample() for episode in group] for group in self.sampler.draw(prompts, step - 1)]

    def score(self, batch: list[dict], prompts, groups):
        """The ScoredBatch of every sample (prompt-major), under the stage's ``reward_errors`` policy."""
        from stages.rewards.scoring import reward_columns

        texts = [sample.text for group in groups for sample in group]
        return self.scorer.score(texts, reward_columns(batch, prompts, self.config.sampling.attempts))

    def step(self, step: int, batch: list[dict]) -> tuple[dict[str, float], list[dict]]:
        """Sample, score, pair and update on one batch of prompts: the step's metrics and sample rows."""
        from stages.engines.interface import prompt_token_ids
        from stages.preference_math import best_worst_pairs

        started = time.perf_counter()
        k = self.config.sampling.attempts
        prompts = [prompt_messages(r) for r in batch]
        groups = self.sample(prompts, step)
        scored = self.score(batch, prompts, groups)
        totals = [scored.total[p * k:(p + 1) * k] for p in range(len(batch))]
        pairs, ties = best_worst_pairs(totals)
        self.tied_prompts += len(ties)
        prompt_ids = prompt_token_ids(self.tokenizer, prompts)
        metrics = sampling_metrics(groups, scored, prompt_ids, len(pairs), len(ties))
        metrics.update(self.update(pairs, prompt_ids, groups, totals))
        metrics["reward/errors"] = float(self.scorer.errors)
        metrics["tokens_per_second"] = metrics.pop("_tokens") / (time.perf_counter() - started)
        return metrics, pair_rows(pairs, prompts, groups, totals, batch)

    def update(self, pairs, prompt_ids, groups, totals) -> dict[str, float]:
        """One optimizer step on the pairs (none when every prompt tied): the DPO metrics."""
        import torch

        if not pairs:
            return {}
        batch = pair_batch([prompt_ids[p] for p, _, _ in pairs], [groups[p][c].token_ids for p, c, _ in pairs],
                           [groups[p][r].token_ids for p, _, r in pairs], self.tokenizer.pad_token_id)
        loss, chosen, rejected, logps, ref_logps = dpo_step_loss(self.policy, self.reference, batch,
                                                                 self.config.beta)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(
            [p for p in self.policy.parameters() if p.requires_grad], MAX_GRAD_NORM)
        self.optimizer.step()
        self.pairs_trained += len(pairs)
        n = batch.n_pairs
        margins = (chosen - rejected).detach()
        return {"loss": float(loss.detach()), "grad_norm": float(grad_norm),
                "rewards/chosen": float(chosen.detach().mean()), "rewards/rejected": float(rejected.detach().mean()),
                "rewards/margin": float(margins.mean()), "rewards/accuracy": float((margins > 0).float().mean()),
                "logps/chosen": float(logps[:n].detach().mean()), "logps/rejected": float(logps[n:].detach().mean()),
                "kl": float((logps - ref_logps).detach().mean()),
                "reward/chosen": sum(totals[p][c] for p, c, _ in pairs) / n,
                "reward/rejected": sum(totals[p][r] for p, _, r in pairs) / n,
                "reward/pair_margin": sum(totals[p][c] - totals[p][r] for p, c, r in pairs) / n}


def sampling_metrics(groups, scored, prompt_ids, n_pairs: int, n_ties: int) -> dict[str, float]:
    samples = [s for group in groups for s in group]
    n = len(samples)
    completion_tokens = sum(len(s.token_ids) for s in samples)
    prompt_tokens = sum(len(ids) * len(group) for ids, group in zip(prompt_ids, groups))
    return {"reward/mean": sum(scored.total) / n,
            **{f"reward/{c.name}/mean": sum(c.scores) / n for c in scored.components},
            **{f"reward/{c.name}/unparsed_frac": 1.0 - sum(c.parsed) / n for c in scored.components},
            "pairs": float(n_pairs), "pairs/tie_frac": n_ties / len(groups),
            "completion/mean_tokens": completion_tokens / n,
            "completion/truncated_frac": sum(s.truncated for s in samples) / n,
            "_tokens": float(completion_tokens + prompt_tokens)}


def pair_rows(pairs, prompts, groups, totals, batch) -> list[dict]:
    rows = [{"prompt": prompts[p][-1]["content"], "answer": batch[p].get("answer"),
             "chosen": groups[p][c].text, "rejected": groups[p][r].text,
             "reward/chosen": totals[p][c], "reward/rejected": totals[p][r],
             "weights_version": groups[p][c].weights_version} for p, c, r in pairs]  # updates before the draw
    return rows[:SAMPLE_TABLE_ROWS]


def run(config: OnlineDPOStageConfig, inputs: StageInputs, ctx) -> dict:
    import torch

    from stages.models.lora import save_trained
    from stages.rl_common import log_curves
    from stages.engines.opening import open_engine, stage_backend
    from stages.rollout.episodes import EpisodeRunner
    from stages.rollout.policy_sampler import PolicySampler

    seed = ctx.seed
    torch.manual_seed(seed)
    records = read_materialized(inputs.data)
    state = OnlineDPORun.load(config, inputs, seed, ctx)
    backend = stage_backend(config, inputs.model, ctx)
    engine = open_engine(backend, inputs.model, stage=config, tokenizer=state.tokenizer,
                         prompts=[prompt_messages(r) for r in records], work_dir=ctx.work_dir,
                         policy=state.policy, trust_remote_code=inputs.trust_remote_code, keep_logprobs=False)
    # completions rendered by the engine's own tokenizer, as stages/rollout/episodes.py ``complete`` renders them
    state.sampler = PolicySampler(EpisodeRunner.completions(engine.tokenizer), config.sampling.seeded(seed), engine)
    ctx.log_params({"resolved_backend": backend.name, "backend_reason": backend.why, "resolved_seed": seed,
                    "prompts": len(records), "samples_per_step": config.prompts_per_step * config.sampling.attempts})
    history, resumed, started = train_steps(config, state, records, seed, ctx)
    log_curves(ctx, history)
    losses = [h["loss"] for h in history if "loss" in h]
    metrics = {"steps": float(config.max_steps), "train_seconds": time.perf_counter() - started,
               "pairs_trained": float(state.pairs_trained), "tied_prompts": float(state.tied_prompts),
               "tie_frac": state.tied_prompts / (config.max_steps * config.prompts_per_step),
               "reward_errors": float(state.scorer.errors), "engine_weight_syncs": float(state.engine_syncs),
               "resumed_from_step": float(resumed)}
    if losses:
        metrics.update({"first_loss": losses[0], "final_loss": losses[-1]})
    ctx.log_metrics(metrics)
    outputs = save_trained(state.policy, state.tokenizer, ctx, final_loss=losses[-1] if losses else None)
    return {**outputs, "metrics": metrics}


def train_steps(config: OnlineDPOStageConfig, state: OnlineDPORun, records, seed: int, ctx):
    """``max_steps`` logged, resumable steps, the engine closed at the end: (history, resumed step, start time)."""
    from stages.engines.opening import close_engine
    from stages.training.alerts import SilentFailureWatch
    from stages.training.resume import LoopState, train_loop

    batches = prompt_batches(records, config.prompts_per_step, seed)
    started = time.perf_counter()
    loop = LoopState(save=state.resumable_state, restore=state.restore,
                     skip=lambda done: [next(batches) for _ in range(done)])
    try:
        history, resumed = train_loop(ctx, "online_dpo", config, lambda step: state.step(step, next(batches)), loop,
                                      SilentFailureWatch(config.alerts, config.sampling.max_tokens))
    finally:
        close_engine(state.sampler.engine, ctx)
    return history, resumed, started


KIND = StageKind("online_dpo", OnlineDPOStageConfig, run, ("reward/mean", "rewards/margin", "tie_frac", "steps"),
                 produces="policy", reads="prompts")
