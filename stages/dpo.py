"""Stage kind ``dpo``: direct preference optimisation with TRL's ``DPOTrainer``.

The policy starts from ``model``; the reference is ``reference`` (default: the same
starting checkpoint), loaded once and frozen. With ``lora`` no reference is loaded: the
policy trains LoRA adapters and TRL scores the reference with them disabled (the starting
checkpoint itself, so ``reference`` must be left out); the checkpoint has the adapters
merged in, the ``adapter`` output holds them alone (stages/models/lora.py). Pairs are rendered with the chat template;
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

Stage kind ``kto`` (stages/kto.py) is TRL's ``KTOTrainer`` on the same pairs (what the two
share is in stages/preference_training.py): TRL unpairs
them (chosen replies desirable, rejected ones undesirable) and estimates the KL reference
point from mismatched completions within a batch, so ``batch_size`` must be above 1.
"""

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
