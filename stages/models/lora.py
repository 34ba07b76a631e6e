"""Optional LoRA adapters (PEFT) for every training stage. Design: docs/algorithms.md."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from stages.spec_model import SpecModel


class LoraSpec(SpecModel):
    """Low-rank adapters on the model's linear layers."""

    model_config = ConfigDict(extra="forbid")

    r: int = Field(8, ge=1, le=1024, description="Rank of each adapter.")
    alpha: float = Field(16.0, gt=0, description="Scale: the update is multiplied by alpha / r.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapter input.")
    target_modules: list[str] | str = Field(
        "all-linear", description="Module names to adapt, or `all-linear` (every linear layer but the LM head "
        "and a reward model's score head)."
    )

    def peft_config(self, task_type: Literal["CAUSAL_LM", "SEQ_CLS"] = "CAUSAL_LM"):
        """PEFT's ``LoraConfig``; ``SEQ_CLS`` (a reward model) also trains and saves the score head in full."""
        from peft import LoraConfig

        return LoraConfig(r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout,
                          target_modules=self.target_modules, task_type=task_type)


LORA_DESCRIPTION = ("Train LoRA adapters instead of all weights: the published `checkpoint` has them merged in, "
                    "`adapter` holds them alone (PEFT format).")


def wrap(model, spec: LoraSpec | None):
    """``model`` with fresh LoRA adapters (only they are trainable), or ``model`` itself without ``spec``."""
    if spec is None:
        return model
    from peft import get_peft_model

    return get_peft_model(model, spec.peft_config())


class TrainingDiverged(RuntimeError):
    """A trained model (or its final loss) holds NaN or infinity: it is never published."""


def check_finite(model, final_loss: float | None = None) -> None:
    """Raise TrainingDiverged naming the first non-finite value (the final loss, or a parameter)."""
    import math

    import torch

    if final_loss is not None and not math.isfinite(final_loss):
        raise TrainingDiverged(f"training diverged: the final loss is {final_loss}; the checkpoint is not published "
                               "(lower lr or weight_decay, or check the data)")
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                bad = int((~torch.isfinite(tensor)).sum())
                kind = "NaN" if bool(torch.isnan(tensor).any()) else "infinity"
                raise TrainingDiverged(f"training diverged: parameter {name} holds {kind} ({bad} of {tensor.numel()} "
                                       "values not finite); the checkpoint is not published (lower lr or "
                                       "weight_decay, or check the data)")


def save_trained(model, tokenizer, ctx, padding_side: str = "left", final_loss: float | None = None) -> dict[str, str]:
    """Save ``checkpoint`` (adapters merged, padding on ``padding_side``) and, with LoRA, ``adapter``: their paths
    by output name; a diverged model is refused. Merging changes the model in place: call this last."""
    from peft import PeftModel

    from stages.models.pretrained import set_padding_side

    check_finite(model, final_loss)
    outputs = {}
    if isinstance(model, PeftModel):
        adapter = ctx.output_dir("adapter")
        model.save_pretrained(adapter)  # before merging: merge_and_unload removes the adapters
        outputs["adapter"] = str(adapter)
        model = model.merge_and_unload()
    checkpoint = ctx.output_dir("checkpoint")
    model.save_pretrained(checkpoint)
    set_padding_side(tokenizer, padding_side)
    tokenizer.save_pretrained(checkpoint)
    return {"checkpoint": str(checkpoint), **outputs}


class AdaptersOff:
    """A LoRA policy's frozen reference: the policy with its adapters disabled (used under ``torch.no_grad`` only)."""

    def __init__(self, policy):
        self.policy = policy

    def __call__(self, **model_inputs):
        with self.policy.disable_adapter():
            return self.policy(**model_inputs)
