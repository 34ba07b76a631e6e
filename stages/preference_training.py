"""What the preference-optimisation stage kinds (``dpo``, ``kto``) share: their config fields,
metric names, and the training run around a TRL preference trainer (data, policy, frozen
reference or adapters-off policy, held-out pairs, publication); with ``online_dpo`` too, what
a policy trained against a frozen reference declares (``PolicyAgainstReference``)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import ConfigDict, Field, model_validator

from stages.context import ExecutionLimits, StageInputs, references_to
from stages.training.resume import Resumable
from stages.data.sources import read_materialized
from stages.models.lora import LORA_DESCRIPTION, LoraSpec
from stages.models.placement import ReferencePlacement, check_devices, place, placement_params
from stages.training.callbacks import metric_renamer


class PolicyAgainstReference:
    """A preference stage's config (dpo, kto, online_dpo) with fields ``model``, ``reference``, ``data`` and
    ``lora``: the policy starts from ``model`` and is held to the frozen ``reference``."""

    def lora_reference_rule(self) -> None:
        if self.lora is not None and self.reference not in (None, self.model):
            raise ValueError(f"with lora the reference is the policy's own starting weights (adapters off); "
                             f"reference {self.reference!r} must be left out or equal model {self.model!r}")

    def references(self) -> dict[str, str]:
        return references_to(model=self.model, reference=self.reference)

    def dataset_names(self) -> list[str]:
        return [self.data]


class PreferenceOptimisationConfig(PolicyAgainstReference, ExecutionLimits, Resumable):
    """What DPO and KTO stages share: a policy, a frozen reference, preference pairs."""

    model_config = ConfigDict(extra="forbid")
    data_records: ClassVar[str] = "preferences"

    model: str = Field(description="Stage whose checkpoint the policy starts from, or `base`.")
    reference: str | None = Field(
        None, description="Stage whose checkpoint is the frozen reference; default the policy's starting checkpoint "
        "(the only one allowed with `lora`).")
    placement: ReferencePlacement = Field(
        default_factory=ReferencePlacement, description="Where the frozen reference lives (stages/models/placement.py): "
        "on the policy's device (default), `cpu`, `cuda:N`, or `offload`.")
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
        self.lora_reference_rule()
        if self.lora is not None and self.placement.reference != "policy":
            raise ValueError("with lora the reference is the policy itself with its adapters off: "
                             "placement.reference must be left at `policy`")
        return self

    def reward_names(self) -> list[str]:
        return []


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


def train_on_preferences(trainer_class, args, config: PreferenceOptimisationConfig, inputs: StageInputs, ctx,
                         to_dataset=None) -> dict:
    """Run a TRL preference trainer (DPO or KTO) from ``model`` against a frozen ``reference`` (with
    ``lora``: the adapters-off policy); ``to_dataset`` turns records into the trainer's dataset (default:
    conversational pairs)."""
    from stages.models.lora import save_trained
    from stages.models.loading import load_policy_and_reference
    from stages.data.preferences import check_preference_records, split_heldout, trl_dataset
    from stages.training.callbacks import quiet_trainer, tracking_callback
    from stages.training.resume import train_measured

    to_dataset = to_dataset or trl_dataset
    seed = ctx.seed
    records = read_materialized(inputs.data)
    check_preference_records(records, f"stage data {inputs.data}")
    train, heldout = split_heldout(records, config.heldout_fraction, seed)
    trust = inputs.trust_remote_code
    check_devices(config.placement)  # before anything loads
    model, reference, tokenizer = load_policy_and_reference(inputs.model, inputs.reference, config.lora, trust,
                                                            trainer_adds_adapters=True)

    trainer = trainer_class(
        model=model, ref_model=reference, args=args, train_dataset=to_dataset(train),
        eval_dataset=to_dataset(heldout) if heldout else None, processing_class=tokenizer,
        peft_config=config.lora.peft_config() if config.lora else None,
        callbacks=[tracking_callback(ctx, rename_metrics, f"{config.kind}: {config.max_steps} steps")],
    )
    quiet_trainer(trainer)
    if trainer.ref_model is not None:  # TRL put it on the policy's device: now where the stage says
        trainer.ref_model = place(trainer.ref_model, config.placement.reference, trainer.accelerator.device)
    ctx.log_params({"pairs": len(records), "train_pairs": len(train), "heldout_pairs": len(heldout),
                    "resolved_seed": seed, "world_size": args.world_size,  # the process group's
                    **placement_params(trainer.ref_model)})

    metrics = train_measured(trainer, ctx)
    if heldout:
        after = trainer.evaluate()  # logged at the last step through the tracking callback
        if "eval_rewards/accuracies" in after:  # KTO scores replies one by one: no pairwise accuracy
            metrics["heldout_pairwise_accuracy"] = float(after["eval_rewards/accuracies"])
        metrics["heldout_reward_margin"] = float(after["eval_rewards/margins"])
    ctx.log_metrics({k: v for k, v in metrics.items() if not k.startswith("heldout_")})

    # stages/models/lora.py: with lora, also the adapter alone; a diverged model (or final loss) is refused
    outputs = save_trained(trainer.model, tokenizer, ctx, final_loss=metrics["final_loss"])
    return {**outputs, "metrics": metrics}
