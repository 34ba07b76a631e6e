"""Generation backends: one interface for evaluation (and, later, RL rollouts).

``HFGenerateBackend`` samples with transformers' ``generate`` on any device and is the
CPU path. Every sample keeps its token ids and their log-probabilities under the sampling
distribution (after temperature / top-p), so nothing is retokenised from text later.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field


class SamplingSettings(BaseModel):
    """Fixed sampling settings: everything that changes a score is declared here."""

    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(1.0, ge=0.0, le=10.0, description="Sampling temperature; 0 is greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    max_tokens: int = Field(16, ge=1, le=32768, description="Token budget per completion; hitting it is truncation.")
    attempts: int = Field(8, ge=1, le=1024, description="Samples per prompt (the k of pass@k).")
    seed: int = Field(0, description="Seed of the sampler.")


@dataclass
class Sample:
    text: str
    token_ids: list[int]
    logprobs: list[float]  # empty when the backend was asked not to keep them
    truncated: bool


class GenerationBackend(Protocol):
    def generate(self, prompts: list[list[dict]], settings: SamplingSettings) -> list[list[Sample]]:
        """``settings.attempts`` samples for every prompt (a list of chat messages)."""


class HFGenerateBackend:
    """Batched sampling with ``model.generate``: all attempts of a prompt batch in one call."""

    def __init__(self, model, tokenizer, prompt_batch_size: int = 32, progress=None, keep_logprobs: bool = True):
        self.model = model
        self.tokenizer = tokenizer
        self.prompt_batch_size = prompt_batch_size
        self.progress = progress
        # Evaluation needs no log-probs; keeping them stacks (rows x tokens x vocab) scores.
        self.keep_logprobs = keep_logprobs

    def generate(self, prompts: list[list[dict]], settings: SamplingSettings) -> list[list[Sample]]:
        import torch

        results: list[list[Sample]] = []
        # generate() draws from the global RNG: seed it inside a fork so the caller's
        # random state (a training loop's) is left as it was.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(settings.seed)
            for start in range(0, len(prompts), self.prompt_batch_size):
                batch = prompts[start : start + self.prompt_batch_size]
                results.extend(self._generate_batch(batch, settings))
                if self.progress is not None:
                    self.progress.advance(len(batch))
        return results

    def _generate_batch(self, prompts: list[list[dict]], settings: SamplingSettings) -> list[list[Sample]]:
        import torch

        tok = self.tokenizer
        texts = [tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
        tok.padding_side = "left"
        encoded = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(self.model.device)
        greedy = settings.temperature == 0.0
        with torch.no_grad():
            out = self.model.generate(
                **encoded,
                do_sample=not greedy,
                temperature=None if greedy else settings.temperature,
                top_p=None if greedy else settings.top_p,
                top_k=None,
                max_new_tokens=settings.max_tokens,
                num_return_sequences=settings.attempts,
                return_dict_in_generate=True,
                output_scores=self.keep_logprobs,
                pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id,
            )
        prompt_len = encoded["input_ids"].shape[1]
        new_tokens_N_T = out.sequences[:, prompt_len:]
        logprobs_N_T = None
        if self.keep_logprobs:
            # scores are the processed logits (after temperature / top-p): the sampling policy
            logprobs_N_T = torch.stack([
                torch.log_softmax(step_V.float(), dim=-1).gather(-1, new_tokens_N_T[:, t : t + 1]).squeeze(-1)
                for t, step_V in enumerate(out.scores)
            ], dim=1)
        samples = []
        for row in range(new_tokens_N_T.shape[0]):
            ids = new_tokens_N_T[row].tolist()
            if tok.eos_token_id in ids:
                end = ids.index(tok.eos_token_id)
                kept, truncated = ids[: end + 1], False
                text_ids = ids[:end]
            else:
                kept, truncated = ids, True
                text_ids = ids
            samples.append(
                Sample(
                    text=tok.decode(text_ids, skip_special_tokens=True),
                    token_ids=kept,
                    logprobs=logprobs_N_T[row, : len(kept)].tolist() if logprobs_N_T is not None else [],
                    truncated=truncated,
                )
            )
        k = settings.attempts
        return [samples[i * k : (i + 1) * k] for i in range(len(prompts))]
