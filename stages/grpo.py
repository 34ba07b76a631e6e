"""GRPO with TRL's ``GRPOTrainer``, configured from an ``rl`` stage.

Departs from DeepSeekMath's GRPO: group-centred advantages without the std division by default
(``group_normalized`` is the paper's); the loss is TRL's ``loss_type`` (grpo, dr_grpo, dapo, cispo); the
k3 KL is in the loss; samples from another engine are weighted by a truncated pi_trainer / pi_sampler.
Design: docs/algorithms.md."""

from __future__ import annotations

import json
from pathlib import Path

from stages.training.alerts import SilentFailureWatch, hacking_pairs
from stages.context import StageInputs
from stages.data.prompt_order import GenerationPrompts
from stages.data.sources import prompt_messages, read_materialized
from stages.engines.hf_generate import neutral_generation_config
from stages.engines.opening import Backend, open_engine, stage_backend
from stages.rollout.episodes import environment_scorers
from stages.models.placement import check_devices, place, placement_params
from stages.rewards.scoring import reward_columns
from stages.rewards.spec import ENVIRONMENT_FN, RewardSpec
from stages.rewards.scoring import RewardErrorPolicy, Scorer

# TRL's metric names -> the names every rl stage logs (stages/rl.py lists them)
METRIC_NAMES = {
    "reward": "reward/mean",
    "reward_std": "reward/std",
    "frac_reward_zero_std": "reward/zero_variance_group_frac",
    "kl": "kl",
    "entropy": "entropy",
    "clip_ratio/region_mean": "clip_frac",
    "cispo_clip_ratio": "clip_frac",
    "completions/mean_length": "completion/mean_tokens",
    "completions/clipped_ratio": "completion/truncated_frac",
    "ratio/mean": "ratio/mean",
    "dynamic/rounds": "dynamic/rounds",
    "dynamic/kept_zero_variance_frac": "dynamic/kept_zero_variance_frac",
    "loss": "loss",
    "grad_norm": "grad_norm",
    "learning_rate": "lr",
    "num_tokens": "num_tokens",  # prompt and completion tokens so far: the terminal's tokens/s
}


def rename_metrics(logs: dict) -> dict[str, float]:
    renamed = {}
    for key, value in logs.items():
        if not isinstance(value, (int, float)):
            continue
        if key in METRIC_NAMES:
            renamed[METRIC_NAMES[key]] = float(value)
        elif key.startswith("rewards/") and key.endswith("/mean"):
            renamed["reward/" + key[len("rewards/"):]] = float(value)
        elif key.startswith(("reward/", "env/")):
            renamed[key] = float(value)
    return renamed


def make_reward_func(name: str, scorer: Scorer, step_metrics, environment=None):
    """A TRL reward function around reward ``name`` of ``scorer``; an ``environment`` reward is
    ``environment``'s own score. Parse rates and the error count go to ``step_metrics``."""
    spec = scorer.specs[name]

    def reward(prompts, completions, completion_ids=None, episode_answer=None, episode_rewardable=None,
               episode=None, **columns):
        # an environment's episodes: the final answer is scored, not the transcript; a shortcut scores 0
        texts = episode_answer or [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        records = [{"answer": answer, "task": json.loads(task) if task else None}  # the task is JSON for Arrow
                   for answer, task in zip(columns.get("answer") or [None] * len(texts),
                                           columns.get("task") or [None] * len(texts))]
        fn = None
        if spec.fn == ENVIRONMENT_FN and episode is not None:
            fn = environment_scorers({name: spec}, environment, episode)[name]
        scored = scorer.score_one(name, texts, reward_columns(records, prompts, 1), fn)
        if step_metrics is not None:
            step_metrics.add(f"reward/{name}/unparsed_frac", 1.0 - sum(scored.parsed) / len(texts))
            step_metrics.add("reward/errors", float(scorer.errors))
        if episode_rewardable is not None:
            return [score if ok else 0.0 for score, ok in zip(scored.scores, episode_rewardable)]
        return scored.scores

    reward.__name__ = name
    bound = scorer.fns.get(name)
    if hasattr(bound, "scorer"):  # a reward model: where it lives is logged (stages/models/placement.py placement_params)
        reward.scorer = bound.scorer
    return reward


def _trainer_class():
    import torch
    from trl import GRPOTrainer

    class PosttrainGRPOTrainer(GRPOTrainer):
        """GRPOTrainer that also logs the ratio's mean, and with ``dynamic_sampling`` trains on signal only."""

        dynamic = None  # (DynamicSampling, the training rows, random.Random) when the stage declares it
        step_metrics = None
        correction = None  # a SamplerCorrection where another sampler draws

        def _generate_and_score_completions(self, inputs):
            batch = self._dynamic_batch(inputs)
            if self.correction is not None and self.model.training and \
                    batch.get("sampling_per_token_logps") is not None:
                batch = sampler_corrected(self, batch)
            return batch

        def _dynamic_batch(self, inputs):
            batch = super()._generate_and_score_completions(inputs)
            if self.dynamic is None or not self.model.training:
                return batch
            settings, rows, rng = self.dynamic
            group_size, wanted = self.num_generations, len(inputs) // self.num_generations
            kept, spare = split_by_signal(batch, group_size)
            rounds = 1
            while len(kept) < wanted and rounds < settings.max_rounds:
                fresh = [rows[i] for i in rng.sample(range(len(rows)), wanted) for _ in range(group_size)]
                more = super()._generate_and_score_completions(fresh)
                more_kept, more_spare = split_by_signal(more, group_size)
                kept, spare, rounds = kept + more_kept, spare + more_spare, rounds + 1
            chosen = (kept + spare)[:wanted]  # topped up with zero-variance groups only when the budget ran out
            self.step_metrics.update({"dynamic/rounds": float(rounds),
                                      "dynamic/kept_zero_variance_frac": sum(not g.signal for g in chosen) / wanted})
            return merge_groups(chosen)

        def _get_per_token_logps_and_entropies(self, *args, **kwargs):
            result = super()._get_per_token_logps_and_entropies(*args, **kwargs)
            self._last_logps = result[0]
            return result

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            logps = getattr(self, "_last_logps", None)
            if logps is not None and self.model.training:
                # the behaviour policy: the previous update's log-probs when a batch is reused, else the
                # engine's own when posttrain's vLLM sampled it (trainer over sampler), else the trainer's (1)
                old = inputs.get("old_per_token_logps")
                if old is None:
                    old = inputs.get("sampling_per_token_logps")
                mask = inputs["completion_mask"].float()
                if "tool_mask" in inputs:  # an environment's observations: not the policy's tokens
                    mask = mask * inputs["tool_mask"].float()
                ratio = torch.exp(logps.detach() - (logps.detach() if old is None else old))
                mean = ((ratio * mask).sum() / mask.sum().clamp(min=1.0)).item()
                self.step_metrics.add("ratio/mean", mean)
            return loss

    return PosttrainGRPOTrainer


def sampler_corrected(trainer, batch: dict) -> dict:
    """A batch posttrain's engine drew, each token's advantage times its truncated pi_trainer / pi_sampler
    (stages/rl_math.py ``sampler_correction``); the KL term is not weighted."""
    import torch

    from stages.rl_math import sampler_correction

    logps = batch.get("old_per_token_logps")
    if logps is None:  # on-policy: the trainer's log-probs of these tokens under the current weights
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        with torch.no_grad():
            logps, _, _ = trainer._get_per_token_logps_and_entropies(
                trainer.model, ids, attention, batch["completion_ids"].size(1),
                batch_size=trainer.args.per_device_train_batch_size)
    mask = batch["completion_mask"].float()
    if batch.get("tool_mask") is not None:  # an environment's observations: not the policy's tokens
        mask = mask * batch["tool_mask"].float()
    weights, metrics = sampler_correction(logps, batch["sampling_per_token_logps"], mask,
                                          trainer.correction.kind, trainer.correction.cap)
    trainer.step_metrics.update(metrics)
    if trainer.correction.kind != "none":
        advantages = batch["advantages"]
        batch["advantages"] = (advantages.unsqueeze(1) if advantages.dim() == 1 else advantages) * weights
    return batch


def turn_off_dropout(model) -> None:
    """Dropout off everywhere, float ``attention_dropout`` attributes too (TRL's ``disable_dropout`` misses
    them); module attributes only: the saved config keeps the checkpoint's values."""
    import torch

    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if "dropout" in name and isinstance(value, float):
                setattr(module, name, 0.0)


class Group:
    """One prompt's ``group_size`` rows of a generated batch, and whether their rewards differ."""

    def __init__(self, tensors: dict, signal: bool):
        self.tensors, self.signal = tensors, signal


# per-row tensors of TRL's generated batch and the side they are padded on
LEFT_PADDED = ("prompt_ids", "prompt_mask")
RIGHT_PADDED = ("completion_ids", "completion_mask", "old_per_token_logps", "sampling_per_token_logps",
                "ref_per_token_logps", "tool_mask")


def split_by_signal(batch: dict, group_size: int) -> tuple[list[Group], list[Group]]:
    """(groups whose advantages are not all zero, groups whose are): a group's advantages are all
    zero exactly when its rewards are all equal, for centred and normalised advantages alike."""
    unknown = set(batch) - set(LEFT_PADDED) - set(RIGHT_PADDED) - {"advantages", "num_items_in_batch"}
    if unknown:
        raise RuntimeError(f"dynamic sampling cannot regroup TRL's batch fields {sorted(unknown)}")
    advantages_B = batch["advantages"]
    kept, spare = [], []
    for start in range(0, advantages_B.shape[0], group_size):
        rows = slice(start, start + group_size)
        group = Group({key: value[rows] for key, value in batch.items() if key != "num_items_in_batch"},
                      bool((advantages_B[rows].abs() > 1e-8).any()))
        (kept if group.signal else spare).append(group)
    return kept, spare


def merge_groups(groups: list[Group]) -> dict:
    """One batch from groups generated in different rounds (re-padded to the longest of each side)."""
    import torch
    import torch.nn.functional as F

    merged = {}
    for key in groups[0].tensors:
        parts = [g.tensors[key] for g in groups]
        if key in LEFT_PADDED or key in RIGHT_PADDED:
            width = max(p.shape[1] for p in parts)
            parts = [F.pad(p, (width - p.shape[1], 0) if key in LEFT_PADDED else (0, width - p.shape[1]))
                     for p in parts]
        merged[key] = torch.cat(parts)
    mask = merged["completion_mask"] * merged["tool_mask"] if "tool_mask" in merged else merged["completion_mask"]
    merged["num_items_in_batch"] = mask.sum()
    return merged


def sample_rows(logs, limit: int = 32) -> list[dict]:
    """The latest completions TRL kept, with their rewards and advantages, as table rows."""
    def text(x):
        return str(x[-1]["content"] if isinstance(x, list) else x)

    rows = [
        {"prompt": text(p), "completion": text(c), "advantage": float(a),
         **{f"reward/{name}": float(values[i]) for name, values in logs["rewards"].items()}}
        for i, (p, c, a) in enumerate(zip(logs["prompt"], logs["completion"], logs["advantages"]))
    ]
    return rows[-limit:]


def build_grpo_config(config, output_dir: Path, seed: int):
    from trl import GRPOConfig

    from stages.training.data_parallel import world_size
    from stages.training.callbacks import device_arguments
    from stages.training.resume import resumable_arguments

    return GRPOConfig(
        **resumable_arguments(output_dir, config.save_steps),
        max_steps=config.max_steps,
        learning_rate=config.lr,
        lr_scheduler_type="constant",
        # split over the processes; TRL's RepeatSampler gathers rewards to centre each group whole
        per_device_train_batch_size=config.prompts_per_step * config.sampling.attempts // world_size(),
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=config.updates_per_batch,
        num_generations=config.sampling.attempts,
        max_completion_length=config.sampling.max_tokens,
        temperature=config.sampling.temperature,
        top_p=config.sampling.top_p,
        beta=config.kl_beta,
        loss_type=config.loss,
        scale_rewards="none" if config.advantage == "group_centered" else "group",
        epsilon=config.clip_epsilon,
        # TRL's CISPO caps the weight at epsilon_high itself (absolute); the other losses clip at 1 + epsilon
        epsilon_high=config.cispo_cap if config.loss == "cispo" else None,
        logging_steps=1,
        report_to="none",
        seed=seed,
        data_seed=seed,
        shuffle_dataset=False,  # the rows come in posttrain's order (stages/data/prompt_order.py)
        **device_arguments(),
        gradient_checkpointing=False,
        disable_dropout=True,  # nn.Dropout modules; turn_off_dropout below catches the rest
        log_completions=False,
        dataloader_num_workers=0,
    )


def grpo_rollouts(config, inputs: StageInputs, tokenizer, dataset, ordered: GenerationPrompts, seed: int,
                  backend: Backend, step_metrics=None, work_dir: Path | None = None):
    """posttrain's rollouts for TRL, drawn by the engine of ``backend``, opened on first use; from a server they
    draw ahead the prompts of ``ordered``."""
    import os

    from stages.rollout.episodes import EpisodeRunner
    from stages.rollout.policy_rollouts import PolicyRollouts

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is marked experimental in TRL
    env = config.environment
    runner = EpisodeRunner.completions(tokenizer)
    if env is not None:
        from stages.rollout.environments import build_environment

        runner = EpisodeRunner(build_environment(env), env, tokenizer)
        runner.environment.check()

    def opener():
        return open_engine(backend, inputs.policy, stage=config, tokenizer=tokenizer, prompts=dataset["prompt"],
                           work_dir=work_dir, trust_remote_code=inputs.trust_remote_code)

    settings = config.sampling.seeded(seed)
    if backend.on_server:  # the server's engine is opened by ServedRollouts, which hands each draw its version
        from stages.rollout.served_rollouts import ServedRollouts

        # the server starts from the policy's checkpoint: it serves version 0 as opened
        inner = PolicyRollouts(runner, tokenizer, settings, opener, step_metrics, opened_holds_weights=True)
        return ServedRollouts(inner, ordered, config.generation.max_staleness, step_metrics)
    # with none opened, generate on the training model draws (PolicyRollouts.engine_for)
    return PolicyRollouts(runner, tokenizer, settings, opener if backend.samples_apart else None, step_metrics,
                          trainer_stream=not backend.samples_apart and env is None)


def train_grpo(config, inputs: StageInputs, ctx) -> dict:
    from datasets import Dataset

    from stages.engines.server_process import cpu_split, training_threads

    from stages.models.lora import save_trained
    from stages.rl_common import log_curves, resolve_correction
    from stages.training.callbacks import StepMetrics, quiet_trainer, tracking_callback
    from stages.training.resume import train_resumably

    seed = ctx.seed
    check_devices(config.placement)  # before anything loads
    model, tokenizer, own_generation_config = _load_policy(inputs)

    records = read_materialized(inputs.data)
    dataset = Dataset.from_list(_prompt_rows(config, records))
    ordered = GenerationPrompts(dataset, config.prompts_per_step, config.sampling.attempts, config.max_steps,
                                config.updates_per_batch, seed)
    rewards: dict[str, RewardSpec] = inputs.rewards
    step_metrics = StepMetrics()
    backend = stage_backend(config, inputs.policy, ctx)
    rollouts = grpo_rollouts(config, inputs, tokenizer, dataset, ordered, seed, backend, step_metrics,
                             ctx.work_dir)
    scorer, reward_funcs = _reward_funcs(config, inputs, ctx, rollouts, step_metrics)

    args = build_grpo_config(config, ctx.resume_dir, seed)
    args.reward_weights = [spec.weight for spec in rewards.values()]
    correction, correction_why = resolve_correction(config, backend)
    ctx.log_params({"resolved_backend": backend.name, "backend_reason": backend.why,
                    "resolved_correction": f"{correction.kind} cap {correction.cap}", "correction_reason": correction_why})
    trainer = _trainer_class()(model=model, reward_funcs=reward_funcs, args=args, train_dataset=ordered.rows,
                               processing_class=tokenizer, rollout_func=rollouts,
                               peft_config=config.lora.peft_config() if config.lora else None)
    _prepare(trainer, config, dataset, seed)
    _attach(trainer, config, step_metrics,
            correction if backend.samples_apart or config.correction is not None else None, rollouts)
    history: list[dict] = []
    watch = SilentFailureWatch(config.alerts, config.sampling.max_tokens,
                               hacking_pairs({name: (spec.fn, spec.weight) for name, spec in rewards.items()}))
    trainer.add_callback(tracking_callback(ctx, rename_metrics, f"grpo: {config.max_steps} steps",
                                           _step_logger(config, trainer, history, watch, ctx), step_metrics))
    quiet_trainer(trainer)
    ctx.log_params({"prompts": len(records), "resolved_seed": seed, "world_size": args.world_size,
                    "generation_batch": args.generation_batch_size,
                    **placement_params(trainer.ref_model, reward_funcs)})
    try:
        with training_threads(cpu_split(config.generation)[1]):  # the trainer's share of the cores, beside a server's
            _, resumed_step = train_resumably(trainer, ctx, _stage_state(trainer, history, watch, rollouts, scorer))
    finally:
        _close_rollouts(rollouts, ctx)

    log_curves(ctx, history)
    metrics = {**_final_metrics(history, trainer.state.global_step, scorer.errors),
               "resumed_from_step": float(resumed_step)}
    ctx.log_metrics(metrics)

    trainer.model.config.name_or_path = str(inputs.policy)  # was the KL anchor's, for TRL
    model.generation_config = own_generation_config  # `model` is also what a LoRA policy wraps
    outputs = save_trained(trainer.model, tokenizer, ctx)
    return {**outputs, "metrics": metrics}


def _reward_funcs(config, inputs: StageInputs, ctx, rollouts, step_metrics) -> tuple:
    """(the scorer, TRL's reward function of each of the stage's rewards, in the order of their weights)."""
    scorer = _scorer(config, inputs, ctx)
    environment = (getattr(rollouts, "inner", rollouts).runner.environment
                   if config.environment is not None else None)
    return scorer, [make_reward_func(name, scorer, step_metrics, environment) for name in inputs.rewards]


def _attach(trainer, config, step_metrics, correction, rollouts) -> None:
    """Give the trainer subclass its step metrics and sampler correction (None: no extra forward pass), and
    with a server drawing ahead, push each new version of the weights as soon as it exists."""
    trainer.step_metrics = step_metrics
    trainer.correction = correction
    if config.generation.max_staleness > 0:
        trainer.add_callback(push_after_each_step(trainer, rollouts))


def _close_rollouts(rollouts, ctx) -> None:
    """Stop the rollouts' engine or server (and its producer), logging its weight syncs and start-up."""
    ctx.log_metrics({"engine_weight_syncs": float(rollouts.sampler.syncs)})
    if hasattr(rollouts, "startup_seconds"):
        ctx.log_metrics({"generation_server_startup_seconds": rollouts.startup_seconds})
    rollouts.close()


def push_after_each_step(trainer, rollouts):
    """A callback serving the policy's new weights after each optimizer step, to rollouts drawn ahead."""
    from transformers import TrainerCallback

    class PushWeights(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            rollouts.sync(trainer)

    return PushWeights()


def _step_logger(config, trainer, history: list[dict], watch: SilentFailureWatch, ctx):
    """At each step's log: keep its metrics, report to ``watch``, every ``sample_every`` steps log samples."""

    def on_metrics(state, metrics):
        if "reward/mean" not in metrics:  # the end-of-training summary log, or a reused batch's update
            return
        history.append({"step": state.global_step, **metrics})
        watch.report(ctx, state.global_step, metrics)
        if state.global_step % config.sample_every == 0 or state.global_step == state.max_steps:
            ctx.log_table(sample_rows(trainer._logs), f"samples/step_{state.global_step:05d}.json")

    return on_metrics


def _stage_state(trainer, history: list[dict], watch: SilentFailureWatch, rollouts, scorer: Scorer):
    """What a resumed GRPO stage restores besides the trainer's checkpoint (a judge's audit schedule restarts)."""
    from stages.training.resume import StageState

    from stages.rollout.served_rollouts import ServedRollouts

    def save() -> dict:
        return {"history": history, "watch": watch.state(), "reward_errors": scorer.policy.state(),
                "calls": rollouts.calls, "syncs": rollouts.sampler.syncs,
                "dropped": getattr(rollouts, "dropped", 0),
                "dynamic_rng": trainer.dynamic[2].getstate() if trainer.dynamic is not None else None}

    def restore(saved: dict) -> None:
        history[:] = saved["history"]
        watch.restore(saved["watch"])
        scorer.policy.restore(saved["reward_errors"])
        rollouts.calls, rollouts.sampler.syncs = saved["calls"], saved["syncs"]
        if hasattr(rollouts, "dropped"):
            rollouts.dropped = saved.get("dropped", 0)
        if trainer.dynamic is not None:
            version, internal, gauss = saved["dynamic_rng"]
            trainer.dynamic[2].setstate((version, tuple(internal), gauss))

    if not isinstance(rollouts, ServedRollouts):
        return StageState(save, restore, every=trainer.num_iterations)
    return StageState(save, restore, every=trainer.num_iterations,
                      save_files=lambda folder: rollouts.save_drawn(folder, trainer.state.global_step),
                      restore_files=rollouts.restore_drawn)


def _prompt_rows(config, records: list[dict]) -> list[dict]:
    """TRL's dataset rows: the prompt (an environment's start), the answer and the task as JSON."""
    start = prompt_messages
    if config.environment is not None:
        from stages.rollout.environments import build_environment

        start = build_environment(config.environment).start
    return [{"prompt": start(r), "answer": r.get("answer"),
             "task": json.dumps(r["task"]) if r.get("task") is not None else None} for r in records]


def _load_policy(inputs: StageInputs):
    """(model, tokenizer, the checkpoint's own generation config) of the policy, ready for TRL."""
    from stages.models.loading import load_model_and_tokenizer, reference_checkpoint

    model, tokenizer = load_model_and_tokenizer(inputs.policy,
                                                trust_remote_code=inputs.trust_remote_code)
    tokenizer.padding_side = "left"
    # TRL builds the KL reference from the policy's `name_or_path`: point it at the anchor.
    model.config.name_or_path = str(reference_checkpoint(inputs.policy, inputs.reference))
    # sample from a neutral generation config, keep the checkpoint's for saving (stages/engines/hf_generate.py)
    own_generation_config = model.generation_config
    model.generation_config = neutral_generation_config(
        eos_token_id=own_generation_config.eos_token_id, pad_token_id=own_generation_config.pad_token_id,
        bos_token_id=own_generation_config.bos_token_id)
    return model, tokenizer, own_generation_config


def _scorer(config, inputs: StageInputs, ctx) -> Scorer:
    """The stage's scorer: its bound rewards, ``reward_errors`` policy and judge auditor."""
    from stages.rewards.judge import batch_auditor
    from stages.scorers import bind_scorers

    bound = bind_scorers(inputs.rewards, inputs, config.placement.reward_model)
    return Scorer(inputs.rewards, RewardErrorPolicy.of(config), bound, batch_auditor(inputs.rewards, bound, ctx))


def _final_metrics(history: list[dict], steps: int, reward_errors: int) -> dict[str, float]:
    last = history[-1] if history else {}
    metrics = {"steps": float(steps), "reward_errors": float(reward_errors)}
    for key in ("reward/mean", "kl"):
        if key in last:
            metrics[f"final_{key.replace('/', '_')}"] = last[key]
    return metrics


def _prepare(trainer, config, dataset, seed: int) -> None:
    """Dropout off in policy and reference, the reference placed, dynamic sampling's prompt pool set."""
    for network in (trainer.model, trainer.ref_model):
        if network is not None:
            turn_off_dropout(network)
    if trainer.ref_model is not None:
        trainer.ref_model = place(trainer.ref_model, config.placement.reference, trainer.accelerator.device)
    if config.dynamic_sampling is not None:
        import random

        trainer.dynamic = (config.dynamic_sampling, list(dataset), random.Random(seed))
