"""Which backend samples, decided once (``choose_backend``), and its engine opened (``open_engine``): on a
checkpoint (eval, a difficulty filter, a judge) or a training stage's policy, in process or on its own server."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from stages.engines.machine import Machine, resolve_dtype, this_machine, vllm_problem
from stages.engines.settings import EngineSettings

# what draws a training stage's rollouts on each backend (what a sampler correction corrects for)
SAMPLERS = {"hf": "the training model", "vllm": "the vLLM engine", "vllm_server": "the generation server"}


class Backend(NamedTuple):
    """The backend an engine is opened on: ``hf``, ``vllm`` or ``vllm_server``, and how it was chosen."""

    name: str
    why: str

    @property
    def on_server(self) -> bool:
        return self.name == "vllm_server"

    @property
    def sampler(self) -> str:
        """What draws a training stage's rollouts on this backend."""
        return SAMPLERS[self.name]

    @property
    def samples_apart(self) -> bool:
        """Whether a training stage's rollouts are drawn by another engine than its training model."""
        return self.name != "hf"


def choose_backend(declared: str, checkpoint: Path | None = None, dtype: str = "auto", *, server: bool = False,
                   processes: int = 1, machine: Machine | None = None, refuse: bool = True) -> Backend:
    """The one decision of which backend samples ``checkpoint`` (the rule: docs/algorithms.md). ``refuse``: a
    declared ``vllm`` (or a server) that cannot serve the checkpoint here fails, saying why."""
    if server:
        _refuse_unservable(checkpoint)
        return Backend("vllm_server", "generation mode server")
    if processes > 1 and declared == "auto":
        return Backend("hf", f"auto: {processes} training processes, each samples its shard with HF generate")
    if declared != "auto":
        if refuse and declared == "vllm":
            _refuse_unservable(checkpoint)
        return Backend(declared, "declared")
    problem = vllm_problem(checkpoint)
    if problem is not None:
        return Backend("hf", f"auto: {problem}")
    machine = machine or this_machine()
    if machine.gpu:
        return Backend("vllm", "auto: vLLM serves this model on this GPU")
    resolved, _ = resolve_dtype(dtype, checkpoint, machine)
    if resolved == "bfloat16" and not machine.bfloat16:
        return Backend("hf", "auto: HF generate, as bfloat16 was asked for and this CPU has no native bfloat16 "
                             "(vLLM's CPU engine emulating it is slower than HF generate)")
    computing = f"bfloat16 natively ({machine.bfloat16})" if resolved == "bfloat16" else resolved
    return Backend("vllm", f"auto: vLLM serves this model here, computing in {computing}")


def _refuse_unservable(checkpoint: Path | None) -> None:
    if (problem := vllm_problem(checkpoint)) is not None:
        raise RuntimeError(f"backend vllm: {problem}; use `backend: hf` or `auto`")


def stage_backend(config, checkpoint: Path, ctx) -> Backend:
    """``choose_backend`` for a training stage's rollouts, logged (on a server also how weights reach it and, on
    a CPU-only machine drawing ahead, how the cores are shared)."""
    from stages.engines.server_process import cpu_split
    from stages.training.data_parallel import world_size

    backend = choose_backend(config.backend, checkpoint, config.engine.dtype,
                             server=config.generation.mode == "server", processes=world_size())
    if backend.on_server:
        if config.lora is None:
            sync = "full weights reloaded from disk"
        else:
            sync = "lora adapter over HTTP" if config.generation.lora_weights == "adapter" else \
                "lora merged, full weights reloaded from disk"
        ctx.log_params({"weight_sync": sync})
        server_cpus, trainer_threads = cpu_split(config.generation)
        if server_cpus:
            ctx.log_params({"generation_server_cpus": ",".join(map(str, server_cpus)),
                            "trainer_threads": trainer_threads})
    return backend


def open_engine(backend: Backend | str, checkpoint: Path, *, engine: EngineSettings | None = None, stage=None,
                tokenizer=None, prompts: list[list[dict]] | None = None, work_dir: Path | None = None, policy=None,
                trust_remote_code: bool = False, prompt_batch_size: int = 32, progress=None,
                keep_logprobs: bool = True, max_model_len: int | None = None):
    """The engine of ``backend`` (a name: decided here) on ``checkpoint``; for a training stage, ``stage`` is its
    config (context for ``prompts`` and its rollout budget), ``policy`` the model it trains (``hf`` samples it)."""
    from stages.engines.interface import context_length, rollout_budget

    engine = stage.engine if stage is not None else (engine or EngineSettings())
    if not isinstance(backend, Backend):
        backend = choose_backend(backend, checkpoint, engine.dtype)
    if backend.on_server:
        from stages.engines.server_client import ServerEngine
        from stages.engines.server_process import start_server

        server = start_server(stage, checkpoint, tokenizer, prompts, work_dir, trust_remote_code)
        opened = ServerEngine(server, tokenizer, folder=Path(work_dir) / "served",
                              keep=stage.generation.max_staleness + 1, owns_server=True)
    elif backend.name == "vllm":
        from stages.engines.in_process_vllm import VLLMEngine

        if stage is not None:
            max_model_len = context_length(tokenizer, prompts, rollout_budget(stage))
        opened = VLLMEngine(checkpoint, trust_remote_code=trust_remote_code, progress=progress,
                            keep_logprobs=keep_logprobs or stage is not None, engine=engine,
                            max_model_len=max_model_len)
    elif policy is not None:
        from stages.engines.hf_generate import HFEngine

        opened = HFEngine(policy, tokenizer, None, keep_logprobs=keep_logprobs)
    else:
        opened = _load_hf_engine(checkpoint, engine, trust_remote_code, prompt_batch_size, progress, keep_logprobs)
    opened.why = backend.why
    return opened


def _load_hf_engine(checkpoint: Path, engine: EngineSettings, trust_remote_code: bool, prompt_batch_size: int,
                    progress, keep_logprobs: bool):
    import torch

    from stages.engines.hf_generate import HFEngine
    from stages.models.loading import load_model_and_tokenizer

    # HF generate: a declared dtype, else the checkpoint's own, so evaluations keep their settings hash
    dtype = None if engine.dtype == "auto" else engine.dtype
    model, tokenizer = load_model_and_tokenizer(checkpoint, for_generation=True, dtype=dtype,
                                                trust_remote_code=trust_remote_code)
    if torch.cuda.is_available():
        model.to("cuda")
    opened = HFEngine(model, tokenizer, prompt_batch_size, progress=progress, keep_logprobs=keep_logprobs)
    if dtype is not None:
        opened.dtype, opened.dtype_why = dtype, "declared"
    return opened


def close_engine(engine, ctx) -> None:
    """Stop a training stage's engine or generation server, logging the server's start-up."""
    if engine is None:
        return
    engine.close()
    server = getattr(engine, "server", None)
    if server is not None:
        ctx.log_metrics({"generation_server_startup_seconds": server.startup_seconds})

