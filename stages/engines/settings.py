"""What a stage declares of its engine (``engine:``) and of where its rollouts are drawn (``generation:``)."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from stages.spec_model import SpecModel, applies_when

BackendName = Literal["auto", "hf", "vllm"]

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




class GenerationSettings(SpecModel):
    """Where a stage's rollouts (rl, online_dpo) are generated, and how far ahead of training."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["colocated", "server"] = Field(
        "colocated", description="colocated: in the training process (`backend`: HF generate or the in-process "
        "vLLM engine). server: a vLLM OpenAI-compatible server that posttrain starts on 127.0.0.1 for the stage "
        "in processes of its own and stops with it (stages/engines/server_process.py); the policy's weights are "
        "pushed to it after every optimizer step (a LoRA adapter over HTTP, full weights by reload from disk).")
    max_staleness: int = Field(
        0, ge=0, le=8, json_schema_extra=applies_when(
            {"generation.mode": "server", "algorithm": "grpo"},
            why="a colocated engine samples inside the training process, between its steps, and PPO and "
                "online_dpo draw each step's samples when the step starts, by the weights of the update before"),
        description="How many optimizer steps older than the policy being trained a step's samples may "
        "be. 0 is synchronous (each step's rollouts drawn by the current weights); k lets generation of the next "
        "k steps' rollouts overlap training, each step's drawn by the weights of k steps before "
        "(stages/rollout/served_rollouts.py); older ones are dropped, counted and drawn again. Either way the server "
        "takes each batch in whole, so a rerun draws the same samples.")
    lora_weights: Literal["adapter", "merged"] = Field(
        "adapter", json_schema_extra=applies_when(
            {"generation.mode": "server", "lora": {"set": True}},
            why="it says how a LoRA policy's weights reach a generation server (full fine-tuning pushes the whole "
                "weights)"),
        description="How each version of a LoRA policy reaches the server. "
        "adapter: the adapter alone over HTTP; several versions are served side by side, and vLLM applies the "
        "adapter unmerged at every token. merged: the policy with its adapters folded in, reloaded in place "
        "from disk as in full fine-tuning; one version at a time (a push waits for batches drawn ahead by the "
        "one before; a checkpoint keeps those batches, so a resumed stage draws as the uninterrupted one). On a "
        "CPU merged generates faster, at the cost of a push through the disk; a push writes the weights in the "
        "server's dtype (measured: docs/benchmarks.md, Systems benchmarks).")
    startup_timeout_s: float = Field(600.0, gt=0, le=7200, allow_inf_nan=False, json_schema_extra=applies_when(
                                     {"generation.mode": "server"}, why="a colocated engine starts no server"),
                                     description="Seconds to wait for the server to answer /health.")
    server_cpus: int | None = Field(
        None, ge=1, le=4096, json_schema_extra=applies_when(
            {"generation.mode": "server", "generation.max_staleness": {"min": 1}},
            why="the cores are split between server and trainer only while generation overlaps training; "
                "otherwise they take turns on every core"),
        description="On a machine without a GPU, generating while the trainer trains: CPU cores given to the "
        "server, the trainer keeping the rest (default half, at least 1). Two processes each running a thread per "
        "core on the same cores slow each other several times over (docs/benchmarks.md).")


def generation_rules(generation: GenerationSettings, backend: str) -> None:
    """What every stage with a ``generation:`` field keeps, whatever its kind (a ValueError saying which)."""
    if generation.mode == "server" and backend == "hf":
        raise ValueError("generation mode server samples with vLLM in a server of its own; backend hf samples "
                         "with the training model: remove one of them")


