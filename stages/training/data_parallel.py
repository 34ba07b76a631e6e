"""A stage trained by several processes at once (``resources: {processes: N}``; docs/algorithms.md)."""

from __future__ import annotations

import os

import torch


def world_size() -> int:
    """Processes training this stage together, as torchrun or accelerate set ``WORLD_SIZE``."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def joined_world() -> int:
    """The process group's size: more than 1 only if the processes really joined one."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _group_ready() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def join_process_group() -> None:
    """Join the stage's process group (gloo on CPU) if launched on several processes and not joined yet."""
    import torch.distributed as dist

    if world_size() > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")


def all_sum(values: torch.Tensor) -> torch.Tensor:
    """``values`` summed element-wise over the processes (a new tensor; the input is left as it was)."""
    import torch.distributed as dist

    total = values.detach().clone()
    if _group_ready():
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total


def all_max(values: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    top = values.detach().clone()
    if _group_ready():
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
    return top


def agreed_flags(*flags: bool) -> tuple[bool, ...]:
    """Each flag, raised if any process raised it: every rank stops after the same step, none left waiting."""
    import torch.distributed as dist

    if not _group_ready():
        return flags
    raised = torch.tensor([float(flag) for flag in flags])
    if dist.get_backend() == "nccl":
        raised = raised.cuda()
    return tuple(bool(value) for value in all_max(raised).tolist())


def broadcast_parameters(*modules: torch.nn.Module) -> None:
    """Every process starts from rank 0's weights (seeded initialisation already agrees; this makes sure)."""
    import torch.distributed as dist

    if not _group_ready():
        return
    for module in modules:
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor.data, src=0)


def sum_gradients(*modules: torch.nn.Module) -> None:
    """Each parameter's gradient summed over the processes (one flat all-reduce per module): with every
    rank's loss already divided by the global normaliser, the sum is the global batch's gradient."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    if not _group_ready():
        return
    for module in modules:
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        if not grads:
            continue
        flat = all_sum(_flatten_dense_tensors(grads))
        for grad, summed in zip(grads, _unflatten_dense_tensors(flat, grads)):
            grad.copy_(summed)


def global_means(pairs: dict[str, tuple[float, float]]) -> dict[str, float]:
    """``{name: (sum, count)}`` of this process -> ``{name: global sum / global count}`` (0 for no count)."""
    names = list(pairs)
    if not names:
        return {}
    totals = all_sum(torch.tensor([[float(pairs[n][0]), float(pairs[n][1])] for n in names], dtype=torch.float64))
    return {n: float(total / count) if count else 0.0 for n, (total, count) in zip(names, totals.tolist())}


def shard(items: list, world: int | None = None, index: int | None = None) -> list:
    """This process's contiguous equal share of ``items`` (its length is validated to divide)."""
    world = world_size() if world is None else world
    index = rank() if index is None else index
    size = len(items) // world
    return items[index * size : (index + 1) * size]
