"""The HF engine: transformers' ``model.generate`` on a checkpoint or a training stage's own policy. Departs from
generate's defaults: a neutral generation config, so a checkpoint's generation_config.json shapes no sample."""

from __future__ import annotations

from contextlib import contextmanager

from stages.engines.interface import Sample
from stages.sampling import SamplingSettings


def neutral_generation_config(**settings):
    """A ``GenerationConfig`` with exactly ``settings`` and every other sampling knob neutral."""
    from transformers import GenerationConfig

    neutral = {"repetition_penalty": 1.0, **({"top_k": 0} if settings.get("do_sample") else {})}
    return GenerationConfig(**{**neutral, **settings})


@contextmanager
def generation_config_as(model, config):
    """``model.generation_config`` is ``config`` inside the block (transformers fills a passed one's gaps from it)."""
    target = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT: the wrapped model
    saved = target.generation_config
    target.generation_config = config
    try:
        yield model
    finally:
        target.generation_config = saved


def cut_at_stop(text: str, stop: list[str]) -> tuple[str, bool]:
    """``text`` up to the first stop string, and whether one was found."""
    cuts = [i for i in (text.find(s) for s in stop if s) if i >= 0]
    return (text[: min(cuts)], True) if cuts else (text, False)


class HFEngine:
    """Batched sampling with ``model.generate``: all attempts of ``prompt_batch_size`` prompts in one call."""

    name = "hf"
    why = "declared"

    dtype: str | None = None  # a declared compute dtype; None: the checkpoint's own
    dtype_why = "auto: the checkpoint's own"

    def identity(self) -> dict:
        """A declared dtype, else nothing beyond the sampling settings."""
        return {} if self.dtype is None else {"dtype": self.dtype}

    def __init__(self, model, tokenizer, prompt_batch_size: int | None = 32, progress=None, keep_logprobs: bool = True,
                 weights_version: int = 0, seeded: bool = True):
        self.model = model
        self.tokenizer = tokenizer
        self.prompt_batch_size = prompt_batch_size
        self.progress = progress
        # Evaluation needs no log-probs; keeping them stacks (rows x tokens x vocab) scores.
        self.keep_logprobs = keep_logprobs
        self.weights_version = weights_version
        # False: draw from the caller's random stream (a GRPO trainer's) instead of seeding each draw
        self.seeded = seeded

    def take_weights(self, model, version: int) -> bool:
        """Sample the training model ``model`` itself from now on: no weights are pushed."""
        self.model, self.weights_version = model, version
        return False

    def close(self) -> None:
        import torch

        self.model = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    @contextmanager
    def _random_stream(self, seed: int):
        """A seeded engine seeds the global RNG generate() draws from inside a fork; an unseeded one leaves it be."""
        import torch

        if not self.seeded:
            yield
            return
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            yield

    def generate(self, prompts: list[list[dict]], settings: SamplingSettings) -> list[list[Sample]]:
        results: list[list[Sample]] = []
        with self._random_stream(settings.seed):
            size = self.prompt_batch_size or len(prompts)
            for start in range(0, len(prompts), size):
                batch = prompts[start : start + size]
                results.extend(self._generate_batch(batch, settings))
                if self.progress is not None:
                    self.progress.advance(len(batch))
        return results

    def generate_ids(self, prompt_ids: list[list[int]], settings: SamplingSettings,
                     seed_offset: int = 0) -> list[list[Sample]]:
        """Like ``generate``, from prompts already tokenised, seeded ``settings.seed + seed_offset``."""
        import torch

        results: list[list[Sample]] = []
        with self._random_stream(settings.seed + seed_offset):
            size = self.prompt_batch_size or len(prompt_ids)
            for start in range(0, len(prompt_ids), size):
                batch = prompt_ids[start : start + size]
                width = max(len(ids) for ids in batch)
                pad = self.tokenizer.pad_token_id
                input_ids = torch.tensor([[pad] * (width - len(ids)) + list(ids) for ids in batch])
                attention = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch])
                encoded = {"input_ids": input_ids.to(self.model.device), "attention_mask": attention.to(self.model.device)}
                results.extend(self._generate_encoded(encoded, len(batch), settings))
                if self.progress is not None:
                    self.progress.advance(len(batch))
        return results

    def _generate_batch(self, prompts: list[list[dict]], settings: SamplingSettings) -> list[list[Sample]]:
        tok = self.tokenizer
        texts = [tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
        tok.padding_side = "left"
        encoded = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(self.model.device)
        return self._generate_encoded(encoded, len(prompts), settings)

    def _generate_encoded(self, encoded, n_prompts: int, settings: SamplingSettings) -> list[list[Sample]]:
        import torch

        tok = self.tokenizer
        config = neutral_generation_config(
            do_sample=not settings.greedy,
            temperature=1.0 if settings.greedy else settings.temperature,
            top_p=settings.nucleus,
            max_new_tokens=settings.max_tokens,
            num_return_sequences=settings.draws,
            return_dict_in_generate=True,
            output_scores=self.keep_logprobs,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
            stop_strings=settings.stop or None,
        )
        with torch.no_grad(), generation_config_as(self.model, config):
            out = self.model.generate(**encoded, generation_config=config,
                                      **({"tokenizer": tok} if settings.stop else {}))
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
                # a row that stopped on a stop string is padded to the batch's length
                kept = ids
                while settings.stop and kept and kept[-1] == tok.pad_token_id:
                    kept = kept[:-1]
                truncated, text_ids = True, kept
            text, stopped = cut_at_stop(tok.decode(text_ids, skip_special_tokens=True), settings.stop)
            samples.append(
                Sample(
                    text=text,
                    token_ids=kept,
                    logprobs=logprobs_N_T[row, : len(kept)].tolist() if logprobs_N_T is not None else [],
                    truncated=truncated and not stopped,
                    weights_version=self.weights_version,
                )
            )
        k = settings.draws
        return [settings.every_attempt(samples[i * k : (i + 1) * k]) for i in range(n_prompts)]

