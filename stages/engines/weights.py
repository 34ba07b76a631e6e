"""The one place a training stage's weights are exported (in its checkpoint's naming, LoRA merged or alone) and
synced into the in-process vLLM engine or a generation server, from the engines' ``take_weights``."""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def adapters_merged(model):
    """A PEFT ``model``'s LoRA adapters folded into its base weights inside the block, unfolded after."""
    peft = hasattr(model, "merge_adapter") and hasattr(model, "peft_config")
    if peft:
        model.merge_adapter()
    try:
        yield model
    finally:
        if peft:
            model.unmerge_adapter()


def merged_named_weights(model):
    """``(name, tensor)`` of the policy's state dict (tied LM head too) in checkpoint naming; adapters: merge first."""
    named = []
    for name, tensor in model.state_dict().items():
        if "lora_" in name or "modules_to_save" in name:
            continue
        named.append((name.removeprefix("base_model.model.").replace(".base_layer.", "."), tensor))
    return named



def save_weights(model, folder: Path, dtype: str | None = None) -> None:
    """The policy's weights as one safetensors file, a tied LM head included, floats cast to ``dtype``."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    cast = getattr(torch, dtype) if dtype else None
    seen: set[int] = set()
    tensors = {}
    for name, tensor in merged_named_weights(model):
        tensor = tensor.detach().to("cpu", cast if cast and tensor.is_floating_point() else None).contiguous()
        if tensor.data_ptr() in seen:  # safetensors refuses shared storage: the tied copy gets its own
            tensor = tensor.clone()
        seen.add(tensor.data_ptr())
        tensors[name] = tensor
    save_file(tensors, str(folder / "model.safetensors"))


def _remove(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)



def load_in_process(engine, model, version: int) -> None:
    """Replace the in-process vLLM ``engine``'s weights with ``model``'s (LoRA merged), prefix cache dropped."""
    with adapters_merged(model):
        named = merged_named_weights(model)
        engine.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(list(named))})
        engine.llm.reset_prefix_cache()
        engine.weights_version = version


def push_to_server(engine, model, version: int, folder: Path, keep: int = 1) -> float:
    """Serve ``model``'s weights as ``version`` (an adapter beside the newest ``keep``, or all reloaded): seconds."""
    from stages.engines.server_process import BASE_NAME

    started = time.perf_counter()
    target = Path(folder) / f"v{version}"
    server = engine.server
    if engine.lora:
        model.save_pretrained(str(target))  # a PEFT model: the adapter alone
        name = f"{BASE_NAME}-v{version}"  # its own served model, beside the versions served
        server.request("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(target)})
        engine.served[version] = name
        engine.weights_version = max(engine.weights_version, version)
        for old in [v for v in engine.served if 0 < v < version - keep]:
            server.request("/v1/unload_lora_adapter", {"lora_name": engine.served.pop(old)})
            _remove(Path(folder) / f"v{old}")
    else:
        with adapters_merged(model):  # lora_weights: merged
            save_weights(model, target, server.dtype)
        with engine.slot:  # reloaded in place, not under a batch being drawn: the one version served
            server.request("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(target)}})
            server.request("/reset_prefix_cache")
            engine.served = {version: BASE_NAME}
            engine.weights_version = version
        _remove(target)  # the server copied the weights in
    return time.perf_counter() - started
