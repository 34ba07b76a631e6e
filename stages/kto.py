"""Stage kind ``kto``: Kahneman-Tversky optimisation with TRL's ``KTOTrainer``. Design: docs/algorithms.md."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from stages.context import StageInputs, StageKind
from stages.preference_training import PreferenceOptimisationConfig, train_on_preferences


class KTOStageConfig(PreferenceOptimisationConfig):
    """Kahneman-Tversky optimisation of a policy on desirable / undesirable replies."""

    kind: Literal["kto"] = Field(description="Stage kind.")
    desirable_weight: float = Field(1.0, gt=0, description="Weight of the loss on desirable (chosen) replies.")
    undesirable_weight: float = Field(1.0, gt=0, description="Weight of the loss on undesirable (rejected) replies.")

    @model_validator(mode="after")
    def _batch_for_kl(self):
        if self.batch_size < 2:
            raise ValueError(f"kto estimates its KL reference point within a batch: batch_size must be >= 2 "
                             f"(got {self.batch_size})")
        return self


def build_kto_config(config: KTOStageConfig, output_dir, seed: int):
    from trl import KTOConfig

    from stages.training.callbacks import device_arguments, schedule_arguments
    from stages.training.resume import resumable_arguments

    return KTOConfig(
        **resumable_arguments(output_dir, config.save_steps),
        **schedule_arguments(config),
        beta=config.beta,
        desirable_weight=config.desirable_weight,
        undesirable_weight=config.undesirable_weight,
        gradient_checkpointing=False,
        logging_steps=config.logging_steps,
        eval_strategy="no",
        report_to="none",
        seed=seed,
        data_seed=seed,
        dataloader_num_workers=0,
        **device_arguments(),
    )


def run(config: KTOStageConfig, inputs: StageInputs, ctx) -> dict:
    from trl import KTOTrainer

    seed = ctx.seed
    args = build_kto_config(config, ctx.resume_dir, seed)
    return train_on_preferences(KTOTrainer, args, config, inputs, ctx, lambda records: unpaired(records, seed))


def unpaired(records: list[dict], seed: int):
    """Desirable (chosen) and undesirable (rejected) replies, one per row, shuffled."""
    import random

    from datasets import Dataset

    rows = [{"prompt": r["prompt"], "completion": r[side], "label": side == "chosen"}
            for r in records for side in ("chosen", "rejected")]
    random.Random(seed).shuffle(rows)
    return Dataset.from_list(rows)


def _world_issues(config: KTOStageConfig, world: int, resources) -> list[str]:
    if config.batch_size % world == 0 and config.batch_size // world < 2:
        return [f"kto estimates its KL reference point within each process's share of the batch: "
                f"batch_size {config.batch_size} over {world} processes leaves fewer than 2 per process"]
    return []


KIND = StageKind("kto", KTOStageConfig, run, ("heldout_reward_margin", "rewards/margin", "kl", "steps"),
                 produces="policy", world_issues=_world_issues)
