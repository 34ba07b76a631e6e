"""Where a stage's frozen models live: ``placement: {reference: ..., reward_model: ...}`` (docs/algorithms.md)."""

from __future__ import annotations

import re

from pydantic import ConfigDict, Field, field_validator

from stages.spec_model import SpecModel

WHERE_PATTERN = r"^(policy|cpu|offload|cuda:\d+)$"
WHERE_HELP = ("`policy` (default: on the policy's device), `cpu`, `cuda:N` (that GPU) or `offload` (weights in CPU "
              "memory, moved to the policy's device for each forward pass)")


def _where(value: str) -> str:
    if not isinstance(value, str) or not re.fullmatch(WHERE_PATTERN, value):
        raise ValueError(f"{value!r} is no placement: use " + WHERE_HELP)
    return value


class ReferencePlacement(SpecModel):
    """Where the frozen reference of a preference stage lives."""

    model_config = ConfigDict(extra="forbid")

    reference: str = Field("policy", description="The frozen KL reference: " + WHERE_HELP + ".")

    _check_reference = field_validator("reference")(_where)


class Placement(ReferencePlacement):
    """Where an rl stage's frozen reference and reward models live."""

    reward_model: str = Field("policy", description="The reward models of its `fn: reward_model` rewards: "
                              + WHERE_HELP + ".")

    _check_reward_model = field_validator("reward_model")(_where)


def device_problem(where: str, cuda_devices: int) -> str | None:
    """Why ``where`` cannot be placed on a machine with ``cuda_devices`` GPUs (None when it can)."""
    match = re.fullmatch(r"cuda:(\d+)", where)
    if match and int(match.group(1)) >= cuda_devices:
        there = f"GPUs cuda:0..cuda:{cuda_devices - 1}" if cuda_devices else "no GPU"
        return f"{where} does not exist on this machine ({there})"
    return None


def check_devices(placement, what: str = "placement") -> None:
    """Refuse, before anything loads, a device this machine does not have."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for field in type(placement).model_fields:
        problem = device_problem(getattr(placement, field), count)
        if problem:
            raise ValueError(f"{what}.{field}: {problem}")


def place(module, where: str, policy_device):
    """``module`` (frozen, eval mode) hooked in place where ``where`` says, its tensors in and out on the caller's."""
    import torch
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    if where == "policy":
        return module.to(policy_device)
    if where == "offload":
        return _offload(module, torch.device(policy_device))
    device = torch.device(where)
    module.to(device)
    add_hook_to_module(module, AlignDevicesHook(execution_device=device, io_same_device=True))
    return module


def _offload(module, execution_device):
    """accelerate's ``cpu_offload``, the model preloaded, tied weights sent to ``meta`` too (docs/algorithms.md)."""
    from accelerate import cpu_offload
    from accelerate.utils import set_module_tensor_to_device

    module.to("cpu")
    weights = dict(module.state_dict())
    cpu_offload(module, execution_device=execution_device, state_dict=weights,
                preload_module_classes=[type(module).__name__])
    for name, parameter in module.named_parameters(remove_duplicate=False):
        if parameter.device.type != "meta" and name in weights:
            set_module_tensor_to_device(module, name, "meta")
    return module


def resident_devices(module) -> set[str]:
    """The devices ``module``'s parameters occupy now (``meta``: offloaded between forward passes)."""
    return {parameter.device.type if parameter.device.index is None else str(parameter.device)
            for parameter in module.parameters()}


def placement_params(reference=None, reward_fns=()) -> dict[str, str]:
    """``reference_device`` and ``reward_model_device`` params: where those models' parameters are once placed."""
    import torch

    params = {}
    if isinstance(reference, torch.nn.Module):
        params["reference_device"] = ",".join(sorted(resident_devices(reference)))
    scorers = [fn.scorer.model for fn in reward_fns if hasattr(fn, "scorer")]
    if scorers:
        params["reward_model_device"] = ",".join(sorted(set().union(*map(resident_devices, scorers))))
    return params
