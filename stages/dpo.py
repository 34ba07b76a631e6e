"""Stage kind ``dpo``: direct preference optimisation with TRL's ``DPOTrainer``.

The policy starts from ``model``; the reference is ``reference`` (default: the same
starting checkpoint), loaded once and frozen. With ``lora`` no reference is loaded: the
policy trains LoRA adapters and TRL scores the reference with them disabled (the starting
checkpoint itself, so ``reference`` must be left out); the checkpoint has the adapters
merged in, the ``adapter`` output holds them alone (stages/lora.py). Pairs are rendered with the chat template;
only the reply's tokens are scored. The loss is TRL's ``sigmoid`` DPO loss, -log
sigmoid(beta * ((log pi(y_c) - log pi_ref(y_c)) - (log pi(y_r) - log pi_ref(y_r)))) with
sequence log-probs summed over reply tokens (stages/preference_math.py ``dpo_loss``
restates it and tests/test_preferences.py checks the two agree); ``loss: ipo`` and
``hinge`` select TRL's variants. Per logging step: ``rewards/chosen`` and
``rewards/rejected`` (the implicit rewards beta * log-ratio), ``rewards/margin``,
``rewards/accuracy`` (share of pairs whose chosen implicit reward is higher) and the
reply log-probs. A seeded ``heldout_fraction`` of the pairs is kept out of training and
reported as ``heldout_pairwise_accuracy`` / ``heldout_reward_margin`` at the end, pooled
over all held-out pairs (TRL's own is a mean of per-batch means).

Departures from the paper: none in the loss by default; dropout is off in both models
(TRL's default). ``sft_weight > 0`` adds a token-mean negative log-likelihood of the chosen
replies (RPO, Pang et al. 2024): plain DPO on the tiny model lowers the chosen replies'
likelihood along with the rejected ones' and moves mass to replies neither side holds
(format errors 1% -> 14% in pipelines/dpo.yaml without it).

Stage kind ``kto`` (stages/kto.py) is TRL's ``KTOTrainer`` on the same pairs: TRL unpairs
them (chosen replies desirable, rejected ones undesirable) and estimates the KL reference
point from mismatched completions within a batch, so ``batch_size`` must be above 1.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import ConfigDict, Field, model_validator

from stages.context import ExecutionLimits
from stages.data import read_materialized
from stages.lora import LORA_DESCRIPTION, LoraSpec
from stages.trainer_callbacks import metric_renamer, pooling_pair_metrics, schedule_arguments


class PreferenceOptimisationConfig(ExecutionLimits):
    """What DPO and KTO stages share: a policy, a frozen reference, preference pairs."""

    model_config = ConfigDict(extra="forbid")
    trains: ClassVar[bool] = True
    produces_checkpoint: ClassVar[bool] = True
    data_records: ClassVar[str] = "preferences"

    model: str = Field(description="Stage whose checkpoint the policy starts from, or `base`.")
    reference: str | None = Field(
        None, description="Stage whose checkpoint is the frozen reference; default the policy's starting checkpoint "
        "(the only one allowed with `lora`).")
    data: str = Field(description="Preference pairs (name under `data:`); must not be `heldout`.")
    beta: float = Field(0.1, gt=0.0, description="Strength of the implicit KL anchor to the reference "
                        "(higher keeps the policy closer).")
    heldout_fraction: float = Field(
        0.1, ge=0.0, lt=1.0, description="Share of the pairs held out (seeded) to measure implicit-reward accuracy.")
    max_steps: int = Field(200, ge=1, description="Optimizer steps.")
    batch_size: int = Field(32, ge=1, le=65536, description="Pairs per optimizer step.")
    lr: float = Field(5e-4, gt=0, le=1.0, description="Peak learning rate.")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field("cosine", description="Learning-rate schedule.")
    warmup_ratio: float = Field(0.0, ge=0, lt=1, description="Share of steps spent warming up.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    max_length: int = Field(128, ge=8, description="Longest prompt + reply in tokens (longer ones are truncated).")
    logging_steps: int = Field(10, ge=1, description="Log loss and implicit rewards every N steps.")
    seed: int | None = Field(None, description="Training seed; default the pipeline seed.")
    lora: LoraSpec | None = Field(None, description=LORA_DESCRIPTION + " The reference is then the starting "
                                  "checkpoint with the adapters off (no second copy loaded).")

    @model_validator(mode="after")
    def _lora_reference(self):
        if self.lora is not None and self.reference not in (None, self.model):
            raise ValueError(f"with lora the reference is the policy's own starting weights (adapters off); "
                             f"reference {self.reference!r} must be left out or equal model {self.model!r}")
        return self

    def references(self) -> dict[str, str]:
        refs = {"model": self.model}
        if self.reference is not None:
            refs["reference"] = self.reference
        return refs

    def dataset_names(self) -> list[str]:
        return [self.data]

    def reward_names(self) -> list[str]:
        return []


class DPOStageConfig(PreferenceOptimisationConfig):
    """Direct preference optimisation of a policy on preference pairs."""

    kind: Literal["dpo"] = Field(description="Stage kind.")
    loss: Literal["sigmoid", "ipo", "hinge"] = Field("sigmoid", description="TRL loss_type: sigmoid is DPO.")
    sft_weight: float = Field(
        0.0, ge=0.0, description="Weight of a negative log-likelihood term on the chosen replies added to the "
        "loss (RPO, Pang et al. 2024; TRL loss_type `sft`): it keeps DPO from pushing the chosen replies' "
        "likelihood down with the rejected ones'. 0 is plain DPO.")


METRIC_NAMES = {
    "loss": "loss",
    "grad_norm": "grad_norm",
    "learning_rate": "lr",
    "rewards/chosen": "rewards/chosen",
    "rewards/rejected": "rewards/rejected",
    "rewards/margins": "rewards/margin",
    "rewards/accuracies": "rewards/accuracy",
    "logps/chosen": "logps/chosen",
    "logps/rejected": "logps/rejected",
    "entropy": "entropy",
    "kl": "kl",
    "eval_loss": "heldout_loss",
    "eval_rewards/accuracies": "heldout_pairwise_accuracy",
    "eval_rewards/margins": "heldout_reward_margin",
}


rename_metrics = metric_renamer(METRIC_NAMES)
# per-pair means TRL averages per batch: pooled over pairs instead (stages/trainer_callbacks.py)
POOLED_METRICS = ("rewards/accuracies", "rewards/margins", "rewards/chosen", "rewards/rejected",
                  "logps/chosen", "logps/rejected")


def build_dpo_config(config: DPOStageConfig, output_dir: Path, seed: int):
    from trl import DPOConfig

    from stages.trainer_callbacks import device_arguments

    return DPOConfig(
        output_dir=str(output_dir),
        **schedule_arguments(config),
        beta=config.beta,
        loss_type=[config.loss, "sft"] if config.sft_weight > 0 else [config.loss],
        loss_weights=[1.0, config.sft_weight] if config.sft_weight > 0 else None,
        gradient_checkpointing=False,
        logging_steps=config.logging_steps,
        eval_strategy="no",  # evaluated once at the end (and once before) by the stage
        save_strategy="no",
        report_to="none",
        seed=seed,
        data_seed=seed,
        dataloader_num_workers=0,
        **device_arguments(),
    )


def run(config: DPOStageConfig, inputs: dict, ctx) -> dict:
    from trl import DPOTrainer

    args = build_dpo_config(config, ctx.work_dir / "trainer", ctx.seed if config.seed is None else config.seed)
    return train_on_preferences(pooling_pair_metrics(DPOTrainer, POOLED_METRICS), args, config, inputs, ctx)


def train_on_preferences(trainer_class, args, config: PreferenceOptimisationConfig, inputs: dict, ctx,
                         to_dataset=None) -> dict:
    """Run a TRL preference trainer (DPO or KTO) from ``model`` against a frozen ``reference`` (with
    ``lora``: the adapters-off policy); ``to_dataset`` turns records into the trainer's dataset (default:
    conversational pairs)."""
    from transformers import AutoModelForCausalLM

    from stages.lora import save_trained
    from stages.models import load_model_and_tokenizer
    from stages.preferences import check_preference_records, split_heldout, trl_dataset
    from stages.trainer_callbacks import quiet_trainer, stop_gracefully, tracking_callback

    to_dataset = to_dataset or trl_dataset
    seed = ctx.seed if config.seed is None else config.seed
    records = read_materialized(Path(inputs["data"]))
    check_preference_records(records, f"stage data {inputs['data']}")
    train, heldout = split_heldout(records, config.heldout_fraction, seed)
    trust = inputs.get("trust_remote_code", False)
    model, tokenizer = load_model_and_tokenizer(Path(inputs["model"]), trust_remote_code=trust)
    # with lora TRL takes the reference log-probs from the policy with its adapters disabled
    reference = None if config.lora else AutoModelForCausalLM.from_pretrained(
        Path(inputs.get("reference") or inputs["model"]), trust_remote_code=trust)

    trainer = trainer_class(
        model=model, ref_model=reference, args=args, train_dataset=to_dataset(train),
        eval_dataset=to_dataset(heldout) if heldout else None, processing_class=tokenizer,
        peft_config=config.lora.peft_config() if config.lora else None,
        callbacks=[tracking_callback(ctx, rename_metrics, f"{config.kind}: {config.max_steps} steps")],
    )
    quiet_trainer(trainer)
    ctx.log_params({"pairs": len(records), "train_pairs": len(train), "heldout_pairs": len(heldout),
                    "resolved_seed": seed})

    started = time.perf_counter()
    with stop_gracefully(trainer, ctx, resumable=False):
        result = trainer.train()
    metrics: dict[str, float] = {"train_seconds": time.perf_counter() - started}
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    metrics.update({
        "train_loss": float(result.training_loss),
        "first_loss": float(losses[0]) if losses else float(result.training_loss),
        "final_loss": float(losses[-1]) if losses else float(result.training_loss),
        "steps": float(trainer.state.global_step),
    })
    if heldout:
        after = trainer.evaluate()  # logged at the last step through the tracking callback
        if "eval_rewards/accuracies" in after:  # KTO scores replies one by one: no pairwise accuracy
            metrics["heldout_pairwise_accuracy"] = float(after["eval_rewards/accuracies"])
        metrics["heldout_reward_margin"] = float(after["eval_rewards/margins"])
    ctx.log_metrics({k: v for k, v in metrics.items() if not k.startswith("heldout_")})

    # stages/lora.py: with lora, also the adapter alone; a diverged model (or final loss) is refused
    outputs = save_trained(trainer.model, tokenizer, ctx, final_loss=metrics["final_loss"])
    return {**outputs, "metrics": metrics}
