"""Stage kind ``sft``: supervised fine-tuning with TRL's ``SFTTrainer``.

Conversations are rendered with the tokenizer's chat template; with ``assistant_only_loss``
only the assistant's tokens (its end-of-turn token included) carry loss. Packing is TRL's.
Loss and learning rate are logged per logging step to the stage's run, and the checkpoint
is saved into a staging dir the orchestrator publishes only when training finished.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from stages.data import read_materialized
from stages.lora import LoraSpec


class SFTStageConfig(BaseModel):
    """Supervised fine-tuning on demonstrations."""

    model_config = ConfigDict(extra="forbid")
    trains: ClassVar[bool] = True
    produces_checkpoint: ClassVar[bool] = True

    kind: Literal["sft"] = Field(description="Stage kind.")
    model: str = Field("base", description="Stage whose checkpoint to start from, or `base` for the pipeline's model.")
    data: str = Field(description="Training dataset (name under `data:`); must not be `heldout`.")
    max_steps: int | None = Field(200, ge=1, description="Optimizer steps; set null to train by `epochs`.")
    epochs: float = Field(1.0, gt=0, description="Passes over the data when `max_steps` is null.")
    batch_size: int = Field(32, ge=1, le=65536, description="Sequences (or packed rows) per optimizer step.")
    lr: float = Field(1e-3, gt=0, le=1.0, description="Peak learning rate.")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field("cosine", description="Learning-rate schedule.")
    warmup_ratio: float = Field(0.0, ge=0, lt=1, description="Share of steps spent warming up.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    max_length: int = Field(128, ge=8, description="Longest sequence (or packed row) in tokens.")
    packing: bool = Field(False, description="Pack several conversations into each row (TRL packing).")
    assistant_only_loss: bool = Field(True, description="Train only on the assistant's tokens.")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward to save memory.")
    logging_steps: int = Field(10, ge=1, description="Log loss and learning rate every N steps.")
    seed: int | None = Field(None, description="Training seed; default the pipeline seed.")
    lora: LoraSpec | None = Field(None, description="Train LoRA adapters instead of all weights (merged on save).")

    @model_validator(mode="after")
    def _steps_or_epochs(self):
        if self.max_steps is None and self.epochs <= 0:
            raise ValueError("set max_steps or a positive epochs")
        return self

    def references(self) -> dict[str, str]:
        return {"model": self.model}

    def dataset_names(self) -> list[str]:
        return [self.data]

    def reward_names(self) -> list[str]:
        return []


def rename_metrics(logs: dict) -> dict[str, float]:
    values = {k: float(v) for k, v in logs.items() if isinstance(v, (int, float))}
    return {("lr" if k == "learning_rate" else k): v for k, v in values.items()}


def run(config: SFTStageConfig, inputs: dict, ctx) -> dict:
    import torch
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from stages.lora import merged
    from stages.models import load_model_and_tokenizer, set_padding_side
    from stages.trainer_callbacks import quiet_trainer, tracking_callback

    seed = ctx.seed if config.seed is None else config.seed
    model, tokenizer = load_model_and_tokenizer(Path(inputs["model"]))
    tokenizer.padding_side = "right"
    records = read_materialized(Path(inputs["data"]))
    dataset = Dataset.from_list([{"messages": r["messages"]} for r in records])

    args = SFTConfig(
        output_dir=str(ctx.work_dir / "trainer"),
        max_steps=config.max_steps if config.max_steps is not None else -1,
        num_train_epochs=config.epochs,
        per_device_train_batch_size=config.batch_size,
        learning_rate=config.lr,
        lr_scheduler_type=config.lr_schedule,
        warmup_steps=config.warmup_ratio,  # a float in [0, 1) is a ratio of total steps
        weight_decay=config.weight_decay,
        max_length=config.max_length,
        packing=config.packing,
        assistant_only_loss=config.assistant_only_loss,
        gradient_checkpointing=config.gradient_checkpointing,
        logging_steps=config.logging_steps,
        save_strategy="no",
        use_cpu=not torch.cuda.is_available(),
        bf16=torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
        report_to="none",
        seed=seed,
        data_seed=seed,
        dataloader_num_workers=0,
    )
    ctx.log_params({"examples": len(records), "resolved_seed": seed})  # the config itself is logged by flows
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
        peft_config=config.lora.peft_config() if config.lora else None,
        callbacks=[tracking_callback(ctx, rename_metrics, f"sft: {args.max_steps} steps")],
    )
    quiet_trainer(trainer)
    started = time.perf_counter()
    result = trainer.train()
    seconds = time.perf_counter() - started

    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    metrics = {
        "train_loss": float(result.training_loss),
        "final_loss": float(losses[-1]) if losses else float(result.training_loss),
        "first_loss": float(losses[0]) if losses else float(result.training_loss),
        "steps": float(trainer.state.global_step),
        "train_seconds": seconds,
    }
    ctx.log_metrics(metrics)

    checkpoint = ctx.output_dir("checkpoint")
    merged(trainer.model).save_pretrained(checkpoint)
    set_padding_side(tokenizer, "left")
    tokenizer.save_pretrained(checkpoint)
    return {"checkpoint": str(checkpoint), "metrics": metrics}
