"""Stage kind ``sft``: supervised fine-tuning with TRL's ``SFTTrainer``. Design: docs/algorithms.md."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from stages.context import ExecutionLimits, StageInputs, StageKind, no_world_issues
from stages.data.sources import read_materialized
from stages.models.lora import LORA_DESCRIPTION, LoraSpec
from stages.training.resume import Resumable


class SFTStageConfig(ExecutionLimits, Resumable):
    """Supervised fine-tuning on demonstrations."""

    model_config = ConfigDict(extra="forbid")

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
    packing: bool = Field(
        False,
        description="Pack several conversations into each row of `max_length` tokens (best-fit decreasing; "
        "documents in a row never attend to each other). `batch_size` then counts packed rows.",
    )
    assistant_only_loss: bool = Field(True, description="Train only on the assistant's tokens.")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward to save memory.")
    logging_steps: int = Field(10, ge=1, description="Log loss and learning rate every N steps.")
    seed: int | None = Field(None, description="Training seed; default the pipeline seed.")
    lora: LoraSpec | None = Field(None, description=LORA_DESCRIPTION)

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


def run(config: SFTStageConfig, inputs: StageInputs, ctx) -> dict:
    from trl import SFTTrainer

    from stages.models.lora import save_trained
    from stages.models.loading import load_model_and_tokenizer
    from stages.training.callbacks import quiet_trainer, tracking_callback
    from stages.training.resume import train_measured

    seed = ctx.seed
    world_size = int(os.environ.get("WORLD_SIZE", "1"))  # > 1 when launched data-parallel (flows/execution/distributed.py)
    model, tokenizer = load_model_and_tokenizer(inputs.model,
                                                trust_remote_code=inputs.trust_remote_code)
    tokenizer.padding_side = "right"
    records = read_materialized(inputs.data)
    conversations = [r["messages"] for r in records]
    if config.packing:
        train_dataset, collator, path_args, params = packed_inputs(config, conversations, tokenizer, model)
    else:
        train_dataset, collator, params = unpacked_dataset(conversations), None, {}
        path_args = {"assistant_only_loss": config.assistant_only_loss}

    args = training_arguments(config, ctx, seed, world_size, path_args)
    # args.world_size is the process group's: 2 only if two processes really joined it
    ctx.log_params({"examples": len(records), "resolved_seed": seed, "world_size": args.world_size, **params})  # the config is logged by flows
    trainer_class = packed_sft_trainer_class() if config.packing else SFTTrainer
    trainer = trainer_class(
        model=model, args=args, train_dataset=train_dataset, processing_class=tokenizer, data_collator=collator,
        peft_config=config.lora.peft_config() if config.lora else None,
        callbacks=[tracking_callback(ctx, rename_metrics, f"sft: {args.max_steps} steps")],
    )
    quiet_trainer(trainer)
    metrics = train_measured(trainer, ctx)
    ctx.log_metrics(metrics)

    outputs = save_trained(trainer.model, tokenizer, ctx, final_loss=metrics["final_loss"])
    return {**outputs, "metrics": metrics}


def training_arguments(config: SFTStageConfig, ctx, seed: int, world_size: int, path_args: dict):
    """TRL's ``SFTConfig`` for this stage: resumable, the global batch split over ``world_size`` processes."""
    from trl import SFTConfig

    from stages.training.callbacks import device_arguments
    from stages.training.resume import resumable_arguments

    return SFTConfig(
        **resumable_arguments(ctx.resume_dir, config.save_steps),
        max_steps=config.max_steps if config.max_steps is not None else -1,
        num_train_epochs=config.epochs,
        per_device_train_batch_size=config.batch_size // world_size,  # the global batch stays batch_size
        learning_rate=config.lr,
        lr_scheduler_type=config.lr_schedule,
        warmup_steps=config.warmup_ratio,  # a float in [0, 1) is a ratio of total steps
        weight_decay=config.weight_decay,
        max_length=config.max_length,
        packing=False,  # TRL's packing is padding-free: one batch-long row (see stages/data/packing.py)
        gradient_checkpointing=config.gradient_checkpointing,
        logging_steps=config.logging_steps,
        **device_arguments(),
        report_to="none",
        seed=seed,
        data_seed=seed,
        dataloader_num_workers=0,
        **path_args,
    )


def unpacked_dataset(conversations: list[list[dict]]):
    """One conversation per row; TRL tokenises it, builds assistant-only labels and pads."""
    from datasets import Dataset

    return Dataset.from_list([{"messages": messages} for messages in conversations])


def packed_inputs(config: SFTStageConfig, conversations: list[list[dict]], tokenizer, model):
    """(packed rows, their collator, SFTConfig arguments, params to log) for ``packing: true``."""
    from stages.data.packing import PackedRowCollator, pack_documents, tokenize_conversations

    documents = tokenize_conversations(conversations, tokenizer, config.assistant_only_loss)
    rows = pack_documents(documents, config.max_length)
    packed_documents = sum(len(lengths) for lengths in rows["seq_lengths"])
    packed_tokens = sum(len(ids) for ids in rows["input_ids"])
    collator = PackedRowCollator(
        pad_token_id=tokenizer.pad_token_id,
        max_length=config.max_length,
        # SDPA takes the block-diagonal mask as built; other kernels derive it from position_ids
        block_mask=model.config._attn_implementation == "sdpa",
        count_tokens=True,
    )
    # The labels already hold the assistant-only mask: TRL must neither re-tokenise nor re-pack.
    args = {"assistant_only_loss": False, "dataset_kwargs": {"skip_prepare_dataset": True}}
    params = {
        "packed_rows": len(rows),
        "packed_fill": round(packed_tokens / (len(rows) * config.max_length), 4),
        "dropped_examples": len(conversations) - packed_documents,  # no trained token within max_length
    }
    return rows, collator, args, params


def packed_sft_trainer_class():
    """SFTTrainer over ``PackedRowCollator`` batches, ``num_tokens`` as the collator counts them (TRL's: a 2D mask)."""
    from trl import SFTTrainer

    class PackedSFTTrainer(SFTTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            real_tokens = inputs.pop("num_real_tokens")
            counted = self._total_train_tokens
            result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            if model.training:
                self._total_train_tokens = counted + int(self.accelerator.gather_for_metrics(real_tokens).sum())
                self._metrics["train"]["num_tokens"] = [self._total_train_tokens]
            return result

    return PackedSFTTrainer


KIND = StageKind("sft", SFTStageConfig, run, ("first_loss", "final_loss", "steps"), produces="policy",
                 reads="demonstrations", world_issues=no_world_issues)
