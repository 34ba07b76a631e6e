"""The one schema of every ``sampling:`` and each sampling place's rules; it imports only the config base class."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BeforeValidator, ConfigDict, Field

from stages.spec_model import SpecModel


class SamplingSettings(SpecModel):
    """How completions are sampled: the one schema of every ``sampling:`` a pipeline declares. Eval takes
    it as it is; rollouts and judges take it through ``sampling_with`` (their defaults and rules)."""

    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(1.0, ge=0.0, le=10.0, description="Sampling temperature; 0 is greedy (refused for "
                               "rollouts and a difficulty filter, whose attempts of a prompt would all be alike).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    max_tokens: int = Field(16, ge=1, le=32768, description="Token budget per completion (per turn in an "
                            "environment); hitting it is truncation. Rollouts and judges default to 8.")
    attempts: int = Field(8, ge=1, le=1024, description="Samples per prompt: the k of pass@k; GRPO's group (>= 2), "
                          "over which advantages are centred; PPO's samples per prompt; a judge's is 1.")
    seed: int = Field(0, description="Seed of the sampler (eval, judge, difficulty filter: default its stage's "
                      "seed). Rollouts are seeded by their stage's `seed`, so rl and online_dpo refuse this field.")
    stop: list[str] = Field(default_factory=list, description="Strings that end a completion where they first "
                            "appear (cut from its text); the model's end-of-turn token always does. Not for "
                            "rollouts, which end at the end-of-turn token or their budget.")

    def identity(self) -> dict:
        """The settings as hashed: ``stop`` only when set, so hashes from before it existed stay valid."""
        payload = self.model_dump(mode="json")
        if not payload["stop"]:
            del payload["stop"]
        return payload

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def draws(self) -> int:
        """Samples an engine draws per prompt: greedy decodes once, as every attempt would be alike."""
        return 1 if self.greedy else self.attempts

    @property
    def nucleus(self) -> float:
        """The top-p an engine is asked for: none under greedy decoding."""
        return 1.0 if self.greedy else self.top_p

    def every_attempt(self, drawn: list) -> list:
        """A prompt's ``draws`` samples as its ``attempts``: greedy repeats its one sample."""
        return [drawn[0]] * self.attempts if self.greedy else drawn

    def seeded(self, seed: int, **update) -> SamplingSettings:
        """What a backend is asked for: these settings drawing from ``seed``, ``update`` replacing other fields."""
        return self.model_copy(update={"seed": seed, **update})


def sampling_with(defaults: dict, rules=None):
    """``SamplingSettings`` as one place takes it: ``defaults`` for the fields a pipeline leaves out, then
    ``rules`` (settings -> settings, or a ValueError saying what the place cannot honour)."""

    def fill(value):
        return {**defaults, **value} if isinstance(value, dict) else value

    checks = [BeforeValidator(fill)] + ([AfterValidator(rules)] if rules else [])
    return Annotated[(SamplingSettings, *checks)]


def _rollout_rules(sampling: SamplingSettings) -> SamplingSettings:
    if sampling.temperature == 0:
        raise ValueError("temperature must be above 0 for rollouts: greedy completions of a prompt are all alike, "
                         "so they would carry no signal")
    if "seed" in sampling.model_fields_set:
        raise ValueError("seed is not a rollout setting: the stage's own `seed` (default the pipeline's) seeds "
                         "its sampler; set that instead")
    if sampling.stop:
        raise ValueError("stop is not a rollout setting: a rollout ends at the end-of-turn token or its budget "
                         "(max_tokens)")
    return sampling


def _judge_rules(sampling: SamplingSettings) -> SamplingSettings:
    if sampling.attempts != 1:
        raise ValueError(f"attempts must be 1 for a judge, which reads one reply per conversation "
                         f"(got {sampling.attempts})")
    return sampling


ROLLOUT_DEFAULTS = {"max_tokens": 8}
JUDGE_DEFAULTS = {"temperature": 0.0, "max_tokens": 8, "attempts": 1}
# how rl and online_dpo stages take `sampling:` (their rollouts), and how a judge reward does
ROLLOUT_SAMPLING = sampling_with(ROLLOUT_DEFAULTS, _rollout_rules)
JUDGE_SAMPLING = sampling_with(JUDGE_DEFAULTS, _judge_rules)
