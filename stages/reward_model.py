"""Stage kind ``reward_model``: a Bradley-Terry reward model with TRL's ``RewardTrainer`` (docs/algorithms.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from stages.context import ExecutionLimits, StageInputs, StageKind, no_world_issues
from stages.training.resume import Resumable
from stages.spec_model import applies_when
from stages.data.sources import read_materialized
from stages.models.loading import load_sequence_scorer
from stages.models.lora import LORA_DESCRIPTION, LoraSpec
from stages.rewards.reward_model import (  # re-exported: stages.reward_model is where callers look
    RewardModelReward,
    RewardModelScorer,
    centre_per_prompt,
    reward_model_correlations,
)
from stages.training.callbacks import metric_renamer, pooling_pair_metrics, schedule_arguments


_WHOLE_CLASSIFIER = "level step trains the whole token classifier"
_STEP_ONLY = "a pair reward model learns from preference pairs, not steps"


class RewardModelStageConfig(ExecutionLimits, Resumable):
    """Train a Bradley-Terry reward model on preference pairs, or (``level: step``) a process reward model
    on step-labelled demonstrations."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["reward_model"] = Field(description="Stage kind.")
    level: Literal["pair", "step"] = Field(
        "pair", description="pair: a Bradley-Terry sequence scorer trained on preference pairs; step: a process "
        "reward model trained to tell right steps from wrong ones (labels from `labels`, the head `step_head`), used "
        "as a reward that scores every step.")
    labels: str | None = Field(
        None, json_schema_extra=applies_when({"level": "step"}, why="a pair reward model learns from preference "
                                             "pairs, not step labels"), description="The process reward (a name under `rewards:`, e.g. a chain_steps verifier) "
        "whose step scores label the steps of `data`'s demonstrations (a step scoring at least 1 is right); "
        "leave it out when `data` is a step-rated file (`records: steps`), whose ratings are the labels.")
    step_head: Literal["surprise", "token"] = Field(
        "surprise", json_schema_extra=applies_when({"level": "step"}, why=_STEP_ONLY), description="How a step is "
        "judged right. surprise: the stage's model, frozen, reads each demonstration, and a small head learns P(right) "
        "from how surprised the model was by the step's tokens (the sum, minimum and last of their log-probabilities) "
        "beside its hidden states at the step's last token and the one before (stages/rewards/step_surprise.py); "
        "token: a token classifier, the whole model trained, reading P(right) at the step's last token. "
        "docs/pipeline-guide.md says when to take which.")
    step_class_weights: Literal["none", "balanced"] = Field(
        "none", json_schema_extra=applies_when({"level": "step"}, why=_STEP_ONLY), description="How right and wrong steps weigh in the cross-entropy. balanced: each "
        "class weighs the inverse of its share of the training steps, so the rarer wrong steps count as much "
        "in all as the right ones; none: every step weighs the same.")
    counterfactual_steps: int = Field(
        0, ge=0, le=8, json_schema_extra=applies_when(
            {"level": "step", "labels": {"set": True}},
            why="its copies are relabelled by the `labels` reward (a step-rated file has none to relabel them)"),
        description="Per training demonstration, this many copies with one "
        "step's last number moved by 1 up or down, every step relabelled by `labels` (harder labels: a right step "
        "and its wrong twin differ only in the result). Held-out demonstrations are never copied.")
    model: str = Field("base", description="Stage whose checkpoint the reward model starts from, or `base`.")
    data: str = Field(description="Preference pairs (name under `data:`), or with level step conversations whose "
                      "last assistant turn is split into steps; must not be `heldout`.")
    heldout_fraction: float = Field(
        0.1, ge=0.0, lt=1.0, description="Share of the pairs held out (seeded) to measure pairwise accuracy; "
        "0 trains on all and reports no held-out accuracy.")
    max_steps: int = Field(200, ge=1, description="Optimizer steps.")
    batch_size: int = Field(32, ge=1, le=65536, description="Pairs per optimizer step.")
    lr: float = Field(1e-3, gt=0, le=1.0, description="Peak learning rate.")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field("cosine", description="Learning-rate schedule.")
    warmup_ratio: float = Field(0.0, ge=0, lt=1, description="Share of steps spent warming up.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    max_length: int = Field(128, ge=8, description="Pairs with a reply longer than this (in tokens) are dropped.")
    center_rewards_coefficient: float | None = Field(
        None, ge=0, json_schema_extra=applies_when({"level": "pair"}, why=_WHOLE_CLASSIFIER), description="Weight of a penalty on the squared mean score, keeping rewards centred near 0.")
    eval_every: int = Field(50, ge=1, description="Measure held-out pairwise accuracy every N steps.")
    logging_steps: int = Field(10, ge=1, description="Log loss, training accuracy and margin every N steps.")
    seed: int | None = Field(None, description="Seed of the score head and data order; default the pipeline seed.")
    lora: LoraSpec | None = Field(None, json_schema_extra=applies_when({"level": "pair"}, why=_WHOLE_CLASSIFIER),
                                  description=LORA_DESCRIPTION + " The score head trains in full and is "
                                  "saved with the adapters.")

    @property
    def data_records(self) -> str:
        """What ``data`` must hold (flows/spec/validate.py)."""
        return "conversations" if self.level == "step" else "preferences"

    def references(self) -> dict[str, str]:
        return {"model": self.model}

    def dataset_names(self) -> list[str]:
        return [self.data]

    def reward_names(self) -> list[str]:
        return [self.labels] if self.labels else []


METRIC_NAMES = {
    "loss": "loss",
    "grad_norm": "grad_norm",
    "learning_rate": "lr",
    "accuracy": "train/pairwise_accuracy",
    "margin": "train/reward_margin",
    "mean_reward": "train/mean_reward",
    "eval_loss": "heldout_loss",
    "eval_accuracy": "heldout_pairwise_accuracy",
    "eval_margin": "heldout_reward_margin",
    "eval_mean_reward": "heldout_mean_reward",
}


rename_metrics = metric_renamer(METRIC_NAMES)
# per-pair means TRL averages per batch: pooled over pairs instead (stages/training/callbacks.py)
POOLED_METRICS = ("accuracy", "margin", "mean_reward")


def training_arguments(config: RewardModelStageConfig, ctx, seed: int, evaluate: bool):
    """TRL's ``RewardConfig`` for this stage (``evaluate``: on the held-out pairs every ``eval_every`` steps)."""
    from trl import RewardConfig

    from stages.training.callbacks import device_arguments
    from stages.training.resume import resumable_arguments

    return RewardConfig(
        **resumable_arguments(ctx.resume_dir, config.save_steps),
        **schedule_arguments(config),
        center_rewards_coefficient=config.center_rewards_coefficient,
        gradient_checkpointing=False,
        logging_steps=config.logging_steps,
        eval_strategy="steps" if evaluate else "no",
        eval_steps=config.eval_every,
        report_to="none",
        seed=seed,
        data_seed=seed,
        dataloader_num_workers=0,
        **device_arguments(),
    )


def run(config: RewardModelStageConfig, inputs: StageInputs, ctx) -> dict:
    if config.level == "step":
        from stages.process_reward_model import train_step_scorer

        return train_step_scorer(config, inputs, ctx)
    import torch
    from trl import RewardTrainer

    from stages.models.lora import save_trained
    from stages.data.preferences import check_preference_records, split_heldout, trl_dataset
    from stages.training.callbacks import quiet_trainer, tracking_callback
    from stages.training.resume import train_measured

    seed = ctx.seed
    records = read_materialized(inputs.data)
    check_preference_records(records, f"stage data {inputs.data}")
    train, heldout = split_heldout(records, config.heldout_fraction, seed)
    torch.manual_seed(seed)  # the new score head
    model, tokenizer = load_sequence_scorer(inputs.model, inputs.trust_remote_code)
    tokenizer.padding_side = "right"

    args = training_arguments(config, ctx, seed, evaluate=bool(heldout))
    trainer = pooling_pair_metrics(RewardTrainer, POOLED_METRICS)(
        model=model, args=args, train_dataset=trl_dataset(train),
        eval_dataset=trl_dataset(heldout) if heldout else None, processing_class=tokenizer,
        peft_config=config.lora.peft_config("SEQ_CLS") if config.lora else None,  # SEQ_CLS: the head trains too
        callbacks=[tracking_callback(ctx, rename_metrics, f"reward model: {config.max_steps} steps")],
    )
    quiet_trainer(trainer)
    # args.world_size is the process group's: 2 only if two processes really joined it
    ctx.log_params({"pairs": len(records), "train_pairs": len(train), "heldout_pairs": len(heldout),
                    "resolved_seed": seed, "world_size": args.world_size})

    metrics: dict[str, float] = {}
    if heldout:
        before = trainer.evaluate()
        metrics["initial_heldout_pairwise_accuracy"] = float(before["eval_accuracy"])
    metrics.update(train_measured(trainer, ctx))
    if heldout:
        after = trainer.evaluate()  # logged at the last step through the tracking callback
        metrics["heldout_pairwise_accuracy"] = float(after["eval_accuracy"])
        metrics["heldout_reward_margin"] = float(after["eval_margin"])
    ctx.log_metrics({k: v for k, v in metrics.items() if not k.startswith("heldout_")})

    # stages/models/lora.py: with lora, also the adapter alone; a diverged model (or final loss) is refused
    outputs = save_trained(trainer.model, tokenizer, ctx, padding_side="right", final_loss=metrics["final_loss"])
    return {**outputs, "metrics": metrics}


KIND = StageKind("reward_model", RewardModelStageConfig, run,
                 ("heldout_pairwise_accuracy", "heldout_step_accuracy", "heldout_reward_margin", "steps"),
                 produces="reward_model",
                 world_issues=no_world_issues)
