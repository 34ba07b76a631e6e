"""posttrain's compact PPO with a critic (``kind: rl, algorithm: ppo``).

Departs from PPO and InstructGPT: no PPO-ptx term; a per-token k1 KL penalty in the reward; old
log-probs recomputed by the trainer; a separate critic with its own optimiser (no vf_coef); token-level
losses; advantages whitened, rewards not. Design: docs/algorithms.md."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from stages.training.alerts import SilentFailureWatch, hacking_pairs
from stages.context import StageInputs
from stages.data.prompt_order import prompt_batches
from stages.data.sources import prompt_messages, read_materialized
from stages.training.data_parallel import (
    all_max,
    all_sum,
    broadcast_parameters,
    global_means,
    join_process_group,
    joined_world,
    rank,
    shard,
    sum_gradients,
    world_size,
)
from stages.rollout.environments import build_environment
from stages.rollout.episodes import EpisodeRunner, environment_scorers, episode_metrics, zero_shortcuts
from stages.rollout.policy_sampler import PolicySampler
from stages.engines.interface import Sample
from stages.engines.opening import close_engine, open_engine, stage_backend
from stages.rewards.judge import batch_auditor
from stages.models.lora import AdaptersOff, save_trained
from stages.models.critic import ValueModel
from stages.models.loading import load_policy_and_reference
from stages.models.placement import check_devices, place, placement_params
from stages.rewards.reward_model import reward_model_correlations
from stages.scorers import bind_scorers
from stages.rewards.scoring import ScoredBatch, reward_columns
from stages.rl_common import RLStageConfig, SamplerCorrection, log_curves, resolve_correction
from stages.rl_math import (
    AdaptiveKLController,
    FixedKLController,
    gae,
    is_zero_variance,
    kl_estimators,
    last_actions,
    masked_whiten,
    ppo_policy_loss,
    ppo_value_loss,
    sampler_correction,
    token_entropy,
    token_logprobs,
)
from stages.rewards.scoring import RewardErrorPolicy, Scorer
from stages.training.resume import LoopState, train_loop
from stages.rewards.steps import step_token_indices

SAMPLE_TABLE_ROWS = 16
MAX_GRAD_NORM = 1.0


@dataclass
class Rollout:
    """One rollout batch of B sequences: prompts left-padded to P, completions right-padded to T, so
    the logits at columns P-1 .. P+T-2 predict the completion. Built from recorded token ids, never
    decoded text. ``mask_B_T`` is 1 on the policy's own tokens only, 0 on padding and observations."""

    input_ids_B_L: torch.Tensor
    attention_mask_B_L: torch.Tensor
    completion_ids_B_T: torch.Tensor
    mask_B_T: torch.Tensor
    sample_logprobs_B_T: torch.Tensor
    samples: list[Sample]
    prompt_index: list[int]

    @property
    def position_ids_B_L(self) -> torch.Tensor:
        # the same positions ``generate`` gives a left-padded batch
        return (self.attention_mask_B_L.cumsum(-1) - 1).clamp(min=0)

    def to(self, device) -> "Rollout":
        for name in ("input_ids_B_L", "attention_mask_B_L", "completion_ids_B_T", "mask_B_T", "sample_logprobs_B_T"):
            setattr(self, name, getattr(self, name).to(device))
        return self


def build_rollout(prompt_ids: list[list[int]], groups: list[list[Sample]], pad_id: int) -> Rollout:
    """(prompt ids + sampled ids) per sample, padded into one batch."""
    flat = [(i, s) for i, group in enumerate(groups) for s in group]
    rows = [(prompt_ids[i], s.token_ids, s.logprobs, [1] * len(s.token_ids)) for i, s in flat]
    return pad_rollout(rows, [s for _, s in flat], [i for i, _ in flat], pad_id)


def build_episode_rollout(episodes, prompt_index: list[int], tokenizer) -> Rollout:
    """An environment's episodes as one batch, each episode's ``env_mask`` its action mask."""
    rows = [(e.prompt_ids, e.completion_ids, e.logprobs, e.env_mask) for e in episodes]
    samples = [Sample(text=tokenizer.decode(e.completion_ids, skip_special_tokens=True), token_ids=e.completion_ids,
                      logprobs=e.logprobs, truncated=e.budget_hit, weights_version=e.weights_version)
               for e in episodes]
    return pad_rollout(rows, samples, prompt_index, tokenizer.pad_token_id)


def pad_rollout(rows: list[tuple[list[int], list[int], list[float], list[int]]], samples: list[Sample],
                prompt_index: list[int], pad_id: int) -> Rollout:
    """(prompt ids, completion ids, sampled log-probs, action mask) per row, padded into one batch."""
    width_P = max(len(prompt) for prompt, *_ in rows)
    width_T = max(len(completion) for _, completion, *_ in rows)
    n_rows = len(rows)
    input_ids = torch.full((n_rows, width_P + width_T), pad_id, dtype=torch.long)
    attention = torch.zeros((n_rows, width_P + width_T), dtype=torch.long)
    logprobs = torch.zeros((n_rows, width_T))
    actions = torch.zeros((n_rows, width_T))
    for row, (prompt, completion, sampled, action) in enumerate(rows):
        n_new = len(completion)
        input_ids[row, width_P - len(prompt) : width_P] = torch.tensor(prompt)
        input_ids[row, width_P : width_P + n_new] = torch.tensor(completion, dtype=torch.long)
        attention[row, width_P - len(prompt) : width_P + n_new] = 1
        logprobs[row, :n_new] = torch.tensor(sampled, dtype=torch.float)
        actions[row, :n_new] = torch.tensor(action, dtype=torch.float)
    return Rollout(input_ids, attention, input_ids[:, width_P:], actions, logprobs, samples, prompt_index)


def completion_logits(model: nn.Module, rollout: Rollout, rows, temperature: float) -> torch.Tensor:
    """Tempered logits predicting each completion token: B x T x V."""
    width_T = rollout.completion_ids_B_T.shape[1]
    out = model(input_ids=rollout.input_ids_B_L[rows], attention_mask=rollout.attention_mask_B_L[rows],
                position_ids=rollout.position_ids_B_L[rows], logits_to_keep=width_T + 1)
    return out.logits[:, :-1].float() / temperature


def completion_values(critic: ValueModel, rollout: Rollout, rows) -> torch.Tensor:
    """V(prompt + completion[:t]) for every completion token t: B x T."""
    width_T = rollout.completion_ids_B_T.shape[1]
    values_B_L = critic(rollout.input_ids_B_L[rows], rollout.attention_mask_B_L[rows], rollout.position_ids_B_L[rows])
    return values_B_L[:, -width_T - 1 : -1].float()


@dataclass
class Targets:
    """What the PPO epochs train toward, all B x T and fixed during the update."""

    old_logprobs: torch.Tensor
    old_values: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    k1: torch.Tensor
    k3: torch.Tensor
    entropy: torch.Tensor  # of the rollout-time policy
    sampler_weights: torch.Tensor | None = None  # pi_trainer / pi_sampler per token, where another sampler drew


@torch.no_grad()
def compute_targets(policy, reference, critic, rollout: Rollout, scores: torch.Tensor, beta: float,
                    config: RLStageConfig) -> Targets:
    """Old log-probs, entropy, per-token reward -beta * k1 + ``scores``, GAE and whitening, over the actions
    only. ``scores``: B (added at each last action) or B x T (``placed_scores``)."""
    everything = slice(None)
    mask = rollout.mask_B_T
    policy_logits = completion_logits(policy, rollout, everything, config.sampling.temperature)
    old_logprobs = token_logprobs(policy_logits, rollout.completion_ids_B_T)
    entropy = token_entropy(policy_logits)
    del policy_logits
    ref_logprobs = token_logprobs(completion_logits(reference, rollout, everything, config.sampling.temperature),
                                  rollout.completion_ids_B_T)
    values = completion_values(critic, rollout, everything) * mask
    k1, _, k3 = kl_estimators(old_logprobs, ref_logprobs)
    rewards = -beta * k1 * mask
    if scores.dim() == 2:
        rewards += scores.to(rewards) * mask
    else:
        rewards[torch.arange(len(scores)), last_actions(mask)] += scores.to(rewards)
    advantages, returns = gae(rewards, values, mask, config.gamma, config.lam)
    if config.whiten_advantages:
        advantages = masked_whiten(advantages, mask) if world_size() == 1 else whiten_over_processes(advantages, mask)
    return Targets(old_logprobs * mask, values, advantages, returns, k1 * mask, k3 * mask, entropy * mask)


def step_credits(scores: list[float], rule: str, centre: float = 0.0) -> list[float]:
    """What each step of one completion earns at its last token, by ``rule`` (``step_credit``)."""
    if rule == "sum":
        return list(scores)
    if rule == "mean":
        return [score / len(scores) for score in scores]
    if rule == "centred":
        return [score - centre for score in scores]
    if rule == "min":
        credits, running = [], None
        for score in scores:
            credits.append(score if running is None else min(running, score) - running)
            running = score if running is None else min(running, score)
        return credits
    raise ValueError(f"step_credit {rule!r}: expected sum, mean, min or centred")


def process_credits(scored: ScoredBatch, process_weight: float, step_credit: str) -> dict[str, list[list[float]]]:
    """Per process reward, per completion: each step's credit times ``process_weight``, before the reward's weight."""
    credits = {}
    for component in (c for c in scored.components if c.steps is not None):
        every = [step.score for steps in component.steps for step in steps]
        centre = sum(every) / len(every) if every else 0.0  # the batch's mean step score (step_credit centred)
        credits[component.name] = [[process_weight * credit for credit in
                                     step_credits([step.score for step in steps], step_credit, centre)]
                                    for steps in component.steps]
    return credits


def placed_scores(rollout: Rollout, scored: ScoredBatch, tokenizer, process_weight: float,
                  step_credit: str = "sum") -> torch.Tensor:
    """B x T: each completion's reward on its tokens. A process reward's step credits go to each step's last
    token (the first whose decoded prefix reaches the step's end), everything else to the last action."""
    mask = rollout.mask_B_T
    placed = torch.zeros(mask.shape, dtype=torch.float32)
    last = last_actions(mask).tolist()
    credits = process_credits(scored, process_weight, step_credit) if process_weight else {}
    process = [c for c in scored.components if c.name in credits]
    for row, sample in enumerate(rollout.samples):
        outcome = scored.total[row]
        for component in process:
            outcome -= process_weight * component.weight * component.scores[row]
            steps = component.steps[row]
            tokens = step_token_indices(tokenizer, sample.token_ids, [step.end for step in steps])
            for credit, token in zip(credits[component.name][row], tokens):
                placed[row, min(token, last[row])] += component.weight * credit
        placed[row, last[row]] += outcome
    return placed


def credited_means(scored: ScoredBatch, process_weight: float, step_credit: str) -> dict[str, float]:
    """``reward/<name>/credited``: per process reward, the mean of what it pays a completion before its
    weight (``reward/<name>/mean`` is the completion score). The reward hacking watch reads it."""
    metrics = {}
    for name, rows in process_credits(scored, process_weight, step_credit).items():
        component = next(c for c in scored.components if c.name == name)
        paid = [sum(row) + (1 - process_weight) * score for row, score in zip(rows, component.scores)]
        metrics[f"reward/{name}/credited"] = sum(paid) / max(len(paid), 1)
    return metrics


def whiten_over_processes(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``masked_whiten`` with the mean and (population) variance of the global rollout batch."""
    count = all_sum(mask.sum().double())
    mean = (all_sum((x * mask).sum().double()) / count).to(x.dtype)
    var = (all_sum((((x - mean) ** 2) * mask).sum().double()) / count).to(x.dtype)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    return torch.where(mask.bool(), whitened, torch.zeros_like(whitened))


def minibatch_losses(policy, critic, rollout: Rollout, targets: Targets, rows, config: RLStageConfig):
    """(policy loss, value loss, clip fraction, mean ratio, value clip fraction): token means over ``rows``' actions."""
    mask = rollout.mask_B_T[rows]
    logits = completion_logits(policy, rollout, rows, config.sampling.temperature)
    logprobs = token_logprobs(logits, rollout.completion_ids_B_T[rows])
    values = completion_values(critic, rollout, rows)
    weights = None if targets.sampler_weights is None else targets.sampler_weights[rows]
    policy_loss, clip_frac, ratio_mean = ppo_policy_loss(
        logprobs, targets.old_logprobs[rows], targets.advantages[rows], mask, config.clip_epsilon, weights)
    value_loss, value_clip_frac = ppo_value_loss(
        values, targets.old_values[rows], targets.returns[rows], mask, config.cliprange_value)
    return policy_loss, value_loss, clip_frac, ratio_mean, value_clip_frac


def ppo_update(policy, critic, optimizers, rollout: Rollout, targets: Targets, config: RLStageConfig,
               generator: torch.Generator) -> dict[str, float]:
    """``ppo_epochs`` passes of shuffled minibatches; returns the mean of each statistic. On several
    processes every update is the token-level mean over the global minibatch."""
    world = world_size()
    n_rows = rollout.mask_B_T.shape[0]
    minibatch = min(config.minibatch_size // world, n_rows)
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}

    def record(name, value):
        sums[name] = sums.get(name, 0.0) + float(value)
        counts[name] = counts.get(name, 0) + 1

    for _ in range(config.ppo_epochs):
        order = torch.randperm(n_rows, generator=generator).to(rollout.mask_B_T.device)
        for start in range(0, n_rows, minibatch):
            rows = order[start : start + minibatch]
            mask = rollout.mask_B_T[rows]
            policy_loss, value_loss, clip_frac, ratio_mean, value_clip_frac = minibatch_losses(
                policy, critic, rollout, targets, rows, config)
            share = 1.0 if world == 1 else mask.sum() / all_sum(mask.sum()).clamp(min=1.0)  # of the tokens
            policy_loss, value_loss = policy_loss * share, value_loss * share
            clip_frac, ratio_mean, value_clip_frac = clip_frac * share, ratio_mean * share, value_clip_frac * share
            for optimizer in optimizers:
                optimizer.zero_grad(set_to_none=True)
            (policy_loss + value_loss).backward()  # disjoint networks, each with its own optimiser
            sum_gradients(policy, critic)  # the global minibatch's gradient on every process
            nn.utils.clip_grad_norm_(policy.parameters(), MAX_GRAD_NORM)
            nn.utils.clip_grad_norm_(critic.parameters(), MAX_GRAD_NORM)
            for optimizer in optimizers:
                optimizer.step()
            for name, value in (("policy_loss", policy_loss), ("value_loss", value_loss), ("clip_frac", clip_frac),
                                ("ratio/mean", ratio_mean), ("value_clip_frac", value_clip_frac)):
                record(name, value.detach())
    names = list(sums)
    totals = all_sum(torch.tensor([sums[n] for n in names], dtype=torch.float64)).tolist() if world > 1 else \
        [sums[n] for n in names]
    return {name: total / counts[name] for name, total in zip(names, totals)}


def rollout_metrics(rollout: Rollout, scored: ScoredBatch, targets: Targets, group_size: int) -> dict[str, float]:
    """The rollout batch's statistics, over the global batch so every rank's KL controller sees the same."""
    mask = rollout.mask_B_T
    total = torch.tensor(scored.total)
    groups = total.view(-1, group_size)
    n, tokens = float(len(rollout.samples)), float(mask.sum())
    gap_B_T = (rollout.sample_logprobs_B_T - targets.old_logprobs).abs() * mask
    pairs = {
        "reward/mean": (float(total.sum()), n),
        "reward/zero_variance_group_frac": (float(sum(is_zero_variance(g) for g in groups)), float(len(groups))),
        "kl": (float((targets.k3 * mask).sum()), tokens),
        "entropy": (float((targets.entropy * mask).sum()), tokens),
        # how far the sampler's recorded log-probs are from the distribution trained on (top_p < 1)
        "logprob/sampler_abs_log_ratio": (float(gap_B_T.sum()), tokens),
        "kl/sequence": (float(targets.k1.sum()), n),
        "completion/mean_tokens": (tokens, n),
        "completion/truncated_frac": (float(sum(s.truncated for s in rollout.samples)), n),
        **{f"reward/{c.name}/mean": (float(sum(c.scores)), n) for c in scored.components},
        **{f"reward/{c.name}/unparsed_frac": (float(sum(not p for p in c.parsed)), n) for c in scored.components},
    }
    return {**global_means(pairs), "logprob/sampler_gap": float(all_max(gap_B_T.max()))}


def sample_rows(rollout: Rollout, prompts, answers, scored: ScoredBatch) -> list[dict]:
    rows = []
    for j, sample in enumerate(rollout.samples[:SAMPLE_TABLE_ROWS]):
        i = rollout.prompt_index[j]
        row = {"prompt": prompts[i][-1]["content"], "answer": answers[i], "completion": sample.text,
               "reward": scored.total[j], "truncated": sample.truncated, "weights_version": sample.weights_version}
        row.update({f"reward/{c.name}": c.scores[j] for c in scored.components})
        rows.append(row)
    return rows


@dataclass
class PPORun:
    """Everything one PPO stage holds between rollout batches."""

    config: RLStageConfig
    policy: nn.Module
    tokenizer: object
    reference: nn.Module | AdaptersOff
    critic: ValueModel
    optimizers: list
    kl_control: FixedKLController | AdaptiveKLController
    scorer: Scorer
    seed: int
    device: torch.device
    runner: EpisodeRunner | None = None
    sampler: PolicySampler | None = None  # draws each step's batch (stages/rollout/policy_sampler.py)
    correction: SamplerCorrection = field(default_factory=lambda: SamplerCorrection(kind="none"))

    @classmethod
    def load(cls, config: RLStageConfig, inputs: StageInputs, seed: int, ctx=None) -> "PPORun":
        """Policy, reference, critic and optimisers loaded for ``config``; judges audited into ``ctx``'s run."""
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        check_devices(config.placement)  # before anything loads
        policy_path = inputs.policy
        trust = inputs.trust_remote_code
        policy, reference, tokenizer = load_policy_and_reference(policy_path, inputs.reference, config.lora, trust)
        policy.to(device).eval()
        if not config.lora:
            reference = place(reference, config.placement.reference, device)
        critic = (ValueModel.from_reward_model(inputs.critic, trust) if inputs.critic
                  else ValueModel.from_policy_checkpoint(policy_path, trust)).to(device).eval()
        trainable = [parameter for parameter in policy.parameters() if parameter.requires_grad]
        optimizers = [torch.optim.AdamW(trainable, lr=config.lr),
                      torch.optim.AdamW(critic.parameters(), lr=config.critic_lr or config.lr)]
        kl_control = (FixedKLController(config.kl_beta) if config.kl_target is None
                      else AdaptiveKLController(config.kl_beta, config.kl_target, config.kl_horizon))
        runner = EpisodeRunner.completions(tokenizer)
        if config.environment is not None:
            environment = build_environment(config.environment)
            environment.check()
            runner = EpisodeRunner(environment, config.environment, tokenizer)
        bound = bind_scorers(inputs.rewards, inputs, config.placement.reward_model)
        auditor = batch_auditor(inputs.rewards, bound, ctx) if ctx is not None else None
        scorer = Scorer(inputs.rewards, RewardErrorPolicy.of(config), bound, auditor)
        return cls(config, policy, tokenizer, reference, critic, optimizers, kl_control, scorer, seed, device,
                   runner=runner)

    def step(self, step: int, batch: list[dict], generator: torch.Generator) -> tuple[dict[str, float], list[dict]]:
        """Sample, score, update on one batch of prompts: the step's metrics and sample rows."""
        config = self.config
        answers = [r.get("answer") for r in batch]
        # the policy the last update left: sampled itself, merged into the engine, or served as a version
        self.sampler.take(self.policy, step - 1)
        environment = self.runner.environment
        prompts = [environment.start(r) if environment is not None else prompt_messages(r) for r in batch]
        # draw step - 1 of the stage, this process's shard at its offset in the step's batch
        groups = self.sampler.draw(prompts, step - 1, rank() * len(batch))
        episodes = [e for group in groups for e in group]
        texts = [e.answer or "" for e in episodes]  # an episode's final answer is scored, not its transcript
        if environment is None:
            rollout = build_rollout([group[0].prompt_ids for group in groups],
                                    [[e.as_sample() for e in group] for group in groups], self.tokenizer.pad_token_id)
            episodes = None
        else:
            rollout = build_episode_rollout(episodes, [i for i, g in enumerate(groups) for _ in g], self.tokenizer)
        rollout = rollout.to(self.device)
        columns = reward_columns([batch[i] for i in rollout.prompt_index],
                                 [prompts[i] for i in rollout.prompt_index], 1)
        scored = self.score(texts, columns, episodes)

        beta = self.kl_control.value
        if config.process_weight and not any(c.steps is not None for c in scored.components):
            raise RuntimeError(f"process_weight is {config.process_weight} but none of the stage's rewards "
                               f"({', '.join(self.scorer.specs)}) scored steps: use a process reward (e.g. "
                               "chain_steps) or remove process_weight")
        scores = (placed_scores(rollout, scored, self.tokenizer, config.process_weight, config.step_credit)
                  if config.process_weight
                  else torch.tensor(scored.total))
        targets = compute_targets(self.policy, self.reference, self.critic, rollout, scores, beta, config)
        # the sampler's recorded log-probs against the trainer's (stages/rl_math.py sampler_correction)
        weights, correction = sampler_correction(targets.old_logprobs, rollout.sample_logprobs_B_T, rollout.mask_B_T,
                                                 self.correction.kind, self.correction.cap)
        if self.correction.kind != "none":
            targets.sampler_weights = weights
        update = ppo_update(self.policy, self.critic, self.optimizers, rollout, targets, config, generator)
        metrics = {**rollout_metrics(rollout, scored, targets, config.sampling.attempts), **update,
                   **reward_model_correlations(scored, self.scorer.specs),
                   **(episode_metrics(episodes, config.environment) if episodes is not None else {}),
                   **(credited_means(scored, config.process_weight, config.step_credit) if config.process_weight else {}),
                   **correction, "kl_beta": beta, "reward/errors": float(self.scorer.errors)}
        self.kl_control.update(metrics["kl/sequence"], n_steps=len(texts) * world_size())
        return metrics, sample_rows(rollout, prompts, answers, scored)

    def score(self, texts: list[str], columns: dict, episodes) -> ScoredBatch:
        """The rewards of the completions, or of the episodes' final answers (a shortcut episode scores 0)."""
        if episodes is None:
            return self.scorer.score(texts, columns)
        scored = self.scorer.score(texts, columns, environment_scorers(self.scorer.specs, self.runner.environment,
                                                                       episodes))
        return zero_shortcuts(scored, episodes, self.config.environment)

    def save(self, ctx) -> dict[str, str]:
        """The policy as the stage's ``checkpoint`` (and, with lora, ``adapter``) outputs."""
        return save_trained(self.policy, self.tokenizer, ctx)

    def resumable_state(self, generator: torch.Generator) -> tuple[dict, dict]:
        """(tensors, JSON-able state) of everything the next step depends on besides the loop's own record."""
        tensors = {"policy": self.policy.state_dict(), "critic": self.critic.state_dict(),
                   "optimizers": [optimizer.state_dict() for optimizer in self.optimizers],
                   "generator": generator.get_state(), "torch_rng": torch.get_rng_state()}
        return tensors, {"kl_beta": self.kl_control.value, "reward_errors": self.scorer.policy.state()}

    def restore(self, generator: torch.Generator, tensors: dict, state: dict) -> None:
        self.policy.load_state_dict(tensors["policy"])
        self.critic.load_state_dict(tensors["critic"])
        for optimizer, saved in zip(self.optimizers, tensors["optimizers"]):
            optimizer.load_state_dict(saved)
        generator.set_state(tensors["generator"])
        torch.set_rng_state(tensors["torch_rng"])
        self.kl_control.value = state["kl_beta"]
        self.scorer.policy.restore(state["reward_errors"])


def train_ppo(config: RLStageConfig, inputs: StageInputs, ctx) -> dict:
    """Run PPO on ``inputs.policy`` against ``inputs.rewards``; save the policy."""
    seed = ctx.seed
    torch.manual_seed(seed)
    join_process_group()  # several processes: each samples and scores its shard (stages/training/data_parallel.py)
    run = PPORun.load(config, inputs, seed, ctx)
    broadcast_parameters(run.policy, run.critic)
    records = read_materialized(inputs.data)
    backend = stage_backend(config, inputs.policy, ctx)
    engine = open_engine(backend, inputs.policy, stage=config, tokenizer=run.tokenizer,
                         prompts=[prompt_messages(r) for r in records], work_dir=ctx.work_dir, policy=run.policy,
                         trust_remote_code=inputs.trust_remote_code)
    run.sampler = PolicySampler(run.runner, config.sampling.seeded(seed), engine)
    run.correction, correction_why = resolve_correction(config, backend)
    ctx.log_params({"resolved_backend": backend.name, "backend_reason": backend.why,
                    "resolved_correction": f"{run.correction.kind} cap {run.correction.cap}",
                    "correction_reason": correction_why})
    batches = (shard(batch) for batch in prompt_batches(records, config.prompts_per_step, seed))
    generator = torch.Generator().manual_seed(seed)  # minibatch order
    ctx.log_params({"resolved_seed": seed, "prompts": len(records), "world_size": joined_world(),
                    "rollout_sequences": config.prompts_per_step * config.sampling.attempts,
                    **placement_params(run.reference, run.scorer.fns.values())})

    started = time.perf_counter()
    state = LoopState(save=lambda: run.resumable_state(generator),
                      restore=lambda tensors, saved: run.restore(generator, tensors, saved),
                      skip=lambda done: [next(batches) for _ in range(done)])
    try:
        history, resumed = train_loop(ctx, "ppo", config, lambda step: run.step(step, next(batches), generator), state,
                                      SilentFailureWatch(config.alerts, config.sampling.max_tokens, hacking_pairs(
                                          {name: (spec.fn, spec.weight) for name, spec in inputs.rewards.items()})))
    finally:
        close_engine(run.sampler.engine, ctx)

    log_curves(ctx, history)
    outputs = run.save(ctx)
    final = {**{k: v for k, v in history[-1].items() if k != "step"}, "steps": float(config.max_steps),
             "resumed_from_step": float(resumed), "train_seconds": time.perf_counter() - started}
    return {**outputs, "metrics": final}
