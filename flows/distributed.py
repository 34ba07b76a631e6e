"""Stages on several processes: ``resources: {processes: N}`` (CPU, gloo) or ``{gpus: N}``.

The orchestrating process keeps the stage's MLflow run and publication; the training
itself is launched as N processes of ``python -m flows.rank JOB.json`` (``flows/rank.py``):
- on CPU through ``torchrun`` (``torch.distributed.run``): ``accelerate launch --cpu
  --num_processes 2`` and a ``MULTI_CPU`` accelerate config were both seen to start ONE
  process on this machine, torchrun starts N (seen on this project's CI machine);
- on GPUs through ``accelerate launch`` with ``infra/accelerate/<ddp|fsdp|zero3>.yaml``.
Every rank runs the same stage function; rank 0 holds the real stage context (metrics,
params, the staged checkpoint), the others a silent one. The HF trainers see ``WORLD_SIZE``
and train data-parallel; the sft stage divides ``batch_size`` across ranks, so the global
batch is what the pipeline says whatever the process count.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
ACCELERATE_CONFIGS = ROOT / "infra" / "accelerate"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_command(resources, spec_path: Path) -> list[str]:
    entry = ["-m", "flows.rank", str(spec_path)]
    if resources.gpus > 1:
        config = ACCELERATE_CONFIGS / f"{resources.accelerate_config}.yaml"
        return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
                "--num_processes", str(resources.world_size()), "--main_process_port", str(_free_port()), *entry]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(resources.world_size()),
            "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), *entry]


def run_distributed(job, ctx) -> None:
    """Run the stage of ``job`` on ``world_size`` processes; fills ``ctx.staged`` from rank 0.

    Each rank receives the job itself (``flows/rank.py``), not the pipeline file."""
    rank_file = {
        "job": job.to_json(), "run_id": ctx.run_id, "work_dir": str(ctx.work_dir),
        "resume_dir": str(ctx.resume_dir),
        "seconds_left": (ctx.deadline - time.monotonic()) if ctx.deadline else None,
    }
    resources = job.resources
    spec_path = ctx.work_dir / "distributed.json"
    spec_path.write_text(json.dumps(rank_file), encoding="utf-8")
    result_path = ctx.work_dir / "distributed.result.json"
    log_path = ctx.work_dir / "distributed.log"
    ctx.flush()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(launch_command(resources, spec_path), stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    try:
        code = proc.wait()
    except BaseException:  # Ctrl-C, a time limit: the ranks go too
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise
    result = json.loads(result_path.read_text()) if result_path.exists() else {}
    if code != 0 or "staged" not in result:
        error = result.get("error") or log_path.read_text(errors="replace")[-3000:]
        if result.get("error_type") == "KeyboardInterrupt":
            raise KeyboardInterrupt
        raise RuntimeError(f"{resources.world_size()} training processes failed (exit {code}): {error}")
    ctx.staged.update(result["staged"])


class RankContext:
    """The stage context of ranks other than 0: computes like rank 0, records nothing."""

    def __init__(self, work_dir: Path, resume_dir: Path, seed: int, deadline: float | None):
        self.work_dir, self.resume_dir, self.seed, self.deadline = work_dir, resume_dir, seed, deadline
        self.staged: dict[str, str] = {}
        work_dir.mkdir(parents=True, exist_ok=True)

    def output_dir(self, name: str) -> Path:
        path = self.work_dir / "discard" / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def output_file(self, name: str) -> Path:
        (self.work_dir / "discard").mkdir(parents=True, exist_ok=True)
        return self.work_dir / "discard" / name

    def log_params(self, params: dict[str, Any]) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        pass

    def set_tags(self, tags: dict[str, str]) -> None:
        pass

    def log_table(self, rows, name: str) -> None:
        pass

    def log_figure(self, figure, name: str) -> None:
        pass

    def flush(self) -> None:
        pass

    @contextmanager
    def progress(self, description: str, total: int):
        class _Quiet:
            def advance(self, amount: int = 1) -> None:
                pass

        yield _Quiet()
