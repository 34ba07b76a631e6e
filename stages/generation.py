"""Generation backends: one interface for evaluation and for posttrain's PPO rollouts.

``generate(prompts, settings)`` takes chat conversations and returns, per prompt,
``settings.attempts`` samples drawn in one call, each with its text, the sampled token ids
(ending with the end-of-turn token when the model stopped there) and their
log-probabilities under the sampling distribution (after temperature / top-p), so
nothing is retokenised from text later. Prompts are rendered with the model's chat
template by the backend, the same way for both.

- ``HFGenerateBackend``: transformers' ``generate`` on any device; the CPU path and the
  fallback.
- ``VLLMBackend``: vLLM on a GPU worker; each prompt carries its own seed
  (``settings.seed + prompt index``), so a prompt's samples do not depend on batching.
  vLLM is imported only when this backend is built: a machine without it imports this
  module, and every pipeline that does not ask for vLLM runs, unchanged.

``backend: auto`` is vLLM when it imports and a GPU is present, else HF generate.
Stop strings end a completion where they first appear (the string itself is cut from the
text; its tokens stay in ``token_ids``), and such a completion is not truncated.
"""

from __future__ import annotations

import importlib.util
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

BackendName = Literal["auto", "hf", "vllm"]


class SamplingSettings(BaseModel):
    """Fixed sampling settings: everything that changes a score is declared here."""

    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(1.0, ge=0.0, le=10.0, description="Sampling temperature; 0 is greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    max_tokens: int = Field(16, ge=1, le=32768, description="Token budget per completion; hitting it is truncation.")
    attempts: int = Field(8, ge=1, le=1024, description="Samples per prompt (the k of pass@k).")
    seed: int = Field(0, description="Seed of the sampler.")
    stop: list[str] = Field(default_factory=list, description="Strings that end a completion where they first "
                            "appear (cut from its text); the model's end-of-turn token always does.")

    def identity(self) -> dict:
        """The settings as hashed: ``stop`` only when set, so hashes from before it existed stay valid."""
        payload = self.model_dump(mode="json")
        if not payload["stop"]:
            del payload["stop"]
        return payload


@dataclass
class Sample:
    text: str
    token_ids: list[int]
    logprobs: list[float]  # empty when the backend was asked not to keep them
    truncated: bool


class GenerationBackend(Protocol):
    name: str

    def generate(self, prompts: list[list[dict]], settings: SamplingSettings) -> list[list[Sample]]:
        """``settings.attempts`` samples for every prompt (a list of chat messages)."""

    def close(self) -> None:
        """Free the model (and its GPU memory) before the next stage of the same process loads one."""


def vllm_problem() -> str | None:
    """Why vLLM cannot be used in this process, or None (checked without importing vLLM)."""
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed here (GPU workers install it: pip install -e '.[gpu]')"
    import torch

    if not torch.cuda.is_available():
        return "vLLM needs a CUDA GPU and this machine has none"
    return None


def resolve_backend(name: str) -> str:
    """``auto`` -> ``vllm`` when vLLM imports and a GPU is present, else ``hf``."""
    if name == "auto":
        return "vllm" if vllm_problem() is None else "hf"
    return name


def open_backend(name: str, checkpoint: Path, *, trust_remote_code: bool = False, prompt_batch_size: int = 32,
                 progress=None, keep_logprobs: bool = True, gpu_memory_utilization: float = 0.5):
    """A backend for ``checkpoint`` by name (``auto``, ``hf`` or ``vllm``)."""
    chosen = resolve_backend(name)
    if chosen == "vllm":
        if (problem := vllm_problem()) is not None:
            raise RuntimeError(f"backend vllm: {problem}; use `backend: hf` or `auto`")
        return VLLMBackend(checkpoint, trust_remote_code=trust_remote_code, progress=progress,
                           keep_logprobs=keep_logprobs, gpu_memory_utilization=gpu_memory_utilization)
    import torch

    from stages.models import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(checkpoint, for_generation=True, trust_remote_code=trust_remote_code)
    if torch.cuda.is_available():
        model.to("cuda")
    return HFGenerateBackend(model, tokenizer, prompt_batch_size, progress=progress, keep_logprobs=keep_logprobs)


def neutral_generation_config(**settings):
    """A ``GenerationConfig`` with exactly ``settings`` and every other sampling knob neutral.

    A checkpoint's generation_config.json may set ``min_p``, ``repetition_penalty``,
    ``top_k``, ``suppress_tokens`` and more; those are not declared in the spec, not hashed,
    and vLLM ignores them, so they must not shape our samples (nor make the sampler's
    log-probs differ from the tempered distribution PPO trains on)."""
    from transformers import GenerationConfig

    neutral = {"repetition_penalty": 1.0, **({"top_k": 0} if settings.get("do_sample") else {})}
    return GenerationConfig(**{**neutral, **settings})


@contextmanager
def generation_config_as(model, config):
    """``model.generation_config`` is ``config`` inside the block, the checkpoint's own after it.

    transformers fills every field a passed config leaves unset (``min_p``,
    ``suppress_tokens``, ``bad_words_ids``, ...) from ``model.generation_config``, so passing
    a neutral config is not enough; the checkpoint keeps its own for saving."""
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


class HFGenerateBackend:
    """Batched sampling with ``model.generate``: all attempts of a prompt batch in one call."""

    name = "hf"

    def __init__(self, model, tokenizer, prompt_batch_size: int = 32, progress=None, keep_logprobs: bool = True):
        self.model = model
        self.tokenizer = tokenizer
        self.prompt_batch_size = prompt_batch_size
        self.progress = progress
        # Evaluation needs no log-probs; keeping them stacks (rows x tokens x vocab) scores.
        self.keep_logprobs = keep_logprobs

    def close(self) -> None:
        import torch

        self.model = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

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
        config = neutral_generation_config(
            do_sample=not greedy,
            temperature=1.0 if greedy else settings.temperature,
            top_p=1.0 if greedy else settings.top_p,
            max_new_tokens=settings.max_tokens,
            num_return_sequences=1 if greedy else settings.attempts,  # greedy: one, repeated below
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
                )
            )
        if greedy:  # every attempt of a greedy decode is the same completion
            samples = [sample for sample in samples for _ in range(settings.attempts)]
        k = settings.attempts
        return [samples[i * k : (i + 1) * k] for i in range(len(prompts))]


class VLLMBackend:
    """Sampling with vLLM: every prompt's attempts in one request (``n``), all prompts in one call."""

    name = "vllm"

    def __init__(self, checkpoint: Path, *, trust_remote_code: bool = False, progress=None, keep_logprobs: bool = True,
                 gpu_memory_utilization: float = 0.5):
        from transformers import AutoTokenizer
        from vllm import LLM

        self.tokenizer = AutoTokenizer.from_pretrained(checkpoint, trust_remote_code=trust_remote_code)
        self.progress = progress
        self.keep_logprobs = keep_logprobs
        arguments = dict(model=str(checkpoint), tokenizer=str(checkpoint), trust_remote_code=trust_remote_code,
                         gpu_memory_utilization=gpu_memory_utilization, seed=0, enable_prefix_caching=True)
        try:  # log-probs after temperature / top-p, as HF's processed scores (vLLM >= 0.10.2)
            self.llm = LLM(**arguments, logprobs_mode="processed_logprobs")
            self.logprobs_mode = "processed_logprobs"
        except TypeError:
            self.llm = LLM(**arguments)
            self.logprobs_mode = "raw_logprobs"

    def close(self) -> None:
        """Shut the engine down: a later stage in this process may start its own (an eval
        after an eval, GRPO's colocated engine), and vLLM sizes itself from free memory."""
        import gc

        import torch

        engine, self.llm = self.llm, None
        shutdown = getattr(getattr(engine, "llm_engine", None), "shutdown", None)
        if callable(shutdown):
            shutdown()
        del engine
        try:
            from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

            destroy_model_parallel()
            destroy_distributed_environment()
        except Exception:  # older or newer vLLM without these: the collection below still frees the weights
            pass
        gc.collect()
        torch.cuda.empty_cache()

    def generate(self, prompts: list[list[dict]], settings: SamplingSettings) -> list[list[Sample]]:
        from vllm import SamplingParams

        tok = self.tokenizer
        # rendered and tokenised exactly as HFGenerateBackend does
        texts = [tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
        requests = [{"prompt_token_ids": tok(text, add_special_tokens=False)["input_ids"]} for text in texts]
        greedy = settings.temperature == 0.0
        params = [
            SamplingParams(n=settings.attempts, temperature=settings.temperature, top_p=1.0 if greedy else settings.top_p,
                           max_tokens=settings.max_tokens, seed=settings.seed + i, stop=list(settings.stop) or None,
                           logprobs=0 if self.keep_logprobs else None, skip_special_tokens=True)
            for i in range(len(prompts))
        ]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        if self.progress is not None:
            self.progress.advance(len(prompts))
        results = []
        for request in outputs:
            group = []
            for completion in request.outputs:
                ids = list(completion.token_ids)
                logprobs = ([entry[token].logprob for token, entry in zip(ids, completion.logprobs)]
                            if self.keep_logprobs and completion.logprobs else [])
                group.append(Sample(text=completion.text, token_ids=ids, logprobs=logprobs,
                                    truncated=completion.finish_reason == "length"))
            results.append(group)
        return results
