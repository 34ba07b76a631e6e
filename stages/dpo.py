"""Stage kind ``dpo``: direct preference optimisation with TRL's ``DPOTrainer`` (docs/algorithms.md).
Departs from the paper in the loss only when ``sft_weight > 0`` (RPO's NLL of the chosen replies)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from stages.context import StageInputs, StageKind, no_world_issues
from stages.preference_training import PreferenceOptimisationConfig, train_on_preferences  # shared with kto
from stages.training.callbacks import pooling_pair_metrics, schedule_arguments


class DPOStageConfig(PreferenceOptimisationConfig):
    """Direct preference optimisation of a policy on preference pairs."""

    kind: Literal["dpo"] = Field(description="Stage kind.")
    loss: Literal["sigmoid", "ipo", "hinge"] = Field("sigmoid", description="TRL loss_type: sigmoid is DPO.")
    sft_weight: float = Field(
        0.0, ge=0.0, description="Weight of a negative log-likelihood term on the chosen replies added to the "
        "loss (RPO, Pang et al. 2024; TRL loss_type `sft`): it keeps DPO from pushing the chosen replies' "
        "likelihood down with the rejected ones'. 0 is plain DPO.")


# per-pair means TRL averages per batch: pooled over pairs instead (stages/training/callbacks.py)
POOLED_METRICS = ("rewards/accuracies", "rewards/margins", "rewards/chosen", "rewards/rejected",
                  "logps/chosen", "logps/rejected")


def build_dpo_config(config: DPOStageConfig, output_dir: Path, seed: int):
    from trl import DPOConfig

    from stages.training.callbacks import device_arguments
    from stages.training.resume import resumable_arguments

    return DPOConfig(
        **resumable_arguments(output_dir, config.save_steps),
        **schedule_arguments(config),
        beta=config.beta,
        loss_type=[config.loss, "sft"] if config.sft_weight > 0 else [config.loss],
        loss_weights=[1.0, config.sft_weight] if config.sft_weight > 0 else None,
        gradient_checkpointing=False,
        logging_steps=config.logging_steps,
        eval_strategy="no",  # evaluated once at the end (and once before) by the stage
        report_to="none",
        seed=seed,
        data_seed=seed,
        dataloader_num_workers=0,
        **device_arguments(),
    )


def run(config: DPOStageConfig, inputs: StageInputs, ctx) -> dict:
    from trl import DPOTrainer

    args = build_dpo_config(config, ctx.resume_dir, ctx.seed)
    return train_on_preferences(pooling_pair_metrics(DPOTrainer, POOLED_METRICS), args, config, inputs, ctx)


KIND = StageKind("dpo", DPOStageConfig, run, ("heldout_pairwise_accuracy", "rewards/margin", "steps"),
                 produces="policy", world_issues=no_world_issues)
