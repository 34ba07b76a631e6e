"""The stage kinds posttrain knows, one line each (each declares its ``KIND``, a ``StageKind``, in its
own module). Adding a kind: its module (config, ``run``, ``KIND``), its tests, and one line below."""

from __future__ import annotations

import os

from stages import benchmark, dpo, kto, online_dpo, reward_model, rl, sft
from stages import eval as evaluation
from stages.context import StageKind

STAGE_KINDS: dict[str, StageKind] = {kind.name: kind for kind in (
    sft.KIND,
    reward_model.KIND,
    rl.KIND,
    dpo.KIND,
    kto.KIND,
    online_dpo.KIND,
    evaluation.KIND,
    benchmark.KIND,
)}


def stage_runner(kind: str):
    """A stage kind's ``run(config, inputs, ctx)``, torch's CPU threads capped by ``POSTTRAIN_TORCH_THREADS``
    (several torch processes on a small machine: docs/benchmarks.md, "Figures behind choices in the code")."""
    run = STAGE_KINDS[kind].run
    threads = os.environ.get("POSTTRAIN_TORCH_THREADS")
    if not threads:
        return run

    def run_with_threads(config, inputs, ctx):
        import torch

        torch.set_num_threads(int(threads))
        return run(config, inputs, ctx)

    return run_with_threads
