"""Optional LoRA adapters (PEFT) for training stages.

A stage with ``lora:`` trains low-rank adapters instead of all weights. The adapters are
merged into the base weights before the checkpoint is published, so every downstream
stage (evaluation, the next round of training) reads an ordinary Hugging Face checkpoint.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class LoraSpec(BaseModel):
    """Low-rank adapters on the model's linear layers."""

    model_config = ConfigDict(extra="forbid")

    r: int = Field(8, ge=1, le=1024, description="Rank of each adapter.")
    alpha: float = Field(16.0, gt=0, description="Scale: the update is multiplied by alpha / r.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapter input.")
    target_modules: list[str] | str = Field(
        "all-linear", description="Module names to adapt, or `all-linear` (every linear layer but the LM head)."
    )

    def peft_config(self):
        from peft import LoraConfig

        return LoraConfig(r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout,
                          target_modules=self.target_modules, task_type="CAUSAL_LM")


def merged(model):
    """The plain model with adapters folded in (a no-op for a model without adapters)."""
    from peft import PeftModel

    return model.merge_and_unload() if isinstance(model, PeftModel) else model
