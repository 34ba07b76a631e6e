"""The ``Engine`` protocol, a ``Sample``, the one seed scheme, and how a prompt is tokenised and sized for an engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from stages.sampling import SamplingSettings

SEED_STRIDE = 100_003  # draw d of a stage is seeded stage seed + d * SEED_STRIDE + prompt index


def draw_offset(draw: int, first_prompt: int = 0) -> int:
    """What draw ``draw`` (0: a stage's first generation call) adds to the seed of a shard from ``first_prompt``."""
    return draw * SEED_STRIDE + first_prompt


@dataclass
class Sample:
    text: str
    token_ids: list[int]
    logprobs: list[float]  # the sampler's, per token; empty when the engine was asked not to keep them
    truncated: bool
    # optimizer updates applied to the weights that drew it (0: the checkpoint as loaded)
    weights_version: int = 0


class Engine(Protocol):
    name: str  # its backend
    why: str  # how that backend was chosen

    def generate(self, prompts: list[list[dict]], settings: SamplingSettings) -> list[list[Sample]]:
        """``settings.attempts`` samples for every prompt (a list of chat messages)."""

    def generate_ids(self, prompt_ids: list[list[int]], settings: SamplingSettings,
                     seed_offset: int = 0) -> list[list[Sample]]:
        """Like ``generate``, from prompts already tokenised, seeded ``settings.seed + seed_offset``."""

    def take_weights(self, model, version: int) -> bool:
        """Sample ``model``'s weights, after ``version`` optimizer updates, from now on; whether any were pushed."""

    def close(self) -> None:
        """Free the model (and its GPU memory, or its server) before the next stage of the same process loads one."""


def prompt_token_ids(tokenizer, prompts: list[list[dict]]) -> list[list[int]]:
    """Each conversation rendered with the chat template, tokenised without special tokens: the one encoding."""
    texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]


def context_length(tokenizer, prompts: list[list[dict]], max_tokens: int) -> int:
    """Tokens the engine must hold for the longest rendered prompt plus the completion budget."""
    longest = max(len(ids) for ids in prompt_token_ids(tokenizer, prompts))
    return longest + max_tokens + 8


def rollout_budget(config) -> int:
    """Tokens a rollout may add after its prompt: ``sampling.max_tokens``, or an episode's budget + 64 (tools line)."""
    environment = getattr(config, "environment", None)
    return config.sampling.max_tokens if environment is None else environment.max_episode_tokens + 64
