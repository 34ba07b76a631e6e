"""Stages on several processes: ``resources: {processes: N}`` (CPU, gloo) or ``{gpus: N}``.

The orchestrating process keeps the stage's MLflow run and publication; the training
itself is launched as N processes of ``python -m flows.execution.rank JOB.json`` (``flows/execution/rank.py``):
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

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
ACCELERATE_CONFIGS = ROOT / "infra" / "accelerate"


def world_issues(config, resources, runs_here: bool) -> list[str]:
    """Why ``config`` cannot train on ``resources.world_size()`` processes (empty when it can).

    ``runs_here``: the stage runs on this machine (no work pool), so what it needs installed is checked here."""
    from stages.registry import STAGE_KINDS

    world = resources.world_size()
    kind = STAGE_KINDS[config.kind]
    if kind.world_issues is None:
        several = [k.name for k in STAGE_KINDS.values() if k.world_issues is not None]
        return [f"more than one process or GPU is for training stages ({', '.join(several)}); "
                f"{config.kind} runs on one"]
    issues = node_issues(config, resources)
    if resources.strategy != "ddp" and resources.gpus * resources.nodes <= 1:
        issues.append(f"strategy {resources.strategy} needs GPUs (`gpus: N`): on CPU processes the trainers "
                      "fall back to DDP without a word (seen with transformers' fsdp on gloo), so only `ddp` is "
                      "accepted there")
    if resources.strategy == "zero3" and runs_here and importlib.util.find_spec("deepspeed") is None:
        issues.append("strategy zero3 needs DeepSpeed, which is not installed here (the `gpu` extra)")
    batch = getattr(config, "batch_size", None)
    if isinstance(batch, int) and batch % world:
        issues.append(f"batch_size {batch} must divide evenly over {world} processes (each takes an equal "
                      "share of the global batch)")
    return issues + kind.world_issues(config, world, resources)


def node_issues(config, resources) -> list[str]:
    """Why ``resources.nodes`` machines cannot train ``config`` together (empty when they can, or for one node).

    Whether the pool is a Kubernetes pool is known only to the Prefect server: ``posttrain run``
    and ``posttrain deploy`` check it there (``flows.deployment.require_pool``)."""
    if resources.nodes <= 1:
        return []
    issues = []
    if not resources.pool:
        issues.append(f"nodes: {resources.nodes} needs a Kubernetes work pool (`pool:`, created from "
                      "infra/prefect/gpu-k8s-job-template.json): without one the stage runs on this machine alone")
    if resources.gpus == 0:
        issues.append("several nodes train on GPUs: set `gpus: M` (per node); CPU processes across machines "
                      "(gloo over the network) are slower than one machine's and are refused")
    if resources.processes > 1:
        issues.append("`processes` counts CPU processes on one machine; on several nodes the processes are the "
                      "`gpus` of each node")
    return issues


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class NodeRole:
    """This machine's place in a multi-node stage, from the environment the pool's indexed Job gives each
    pod (infra/prefect/gpu-k8s-job-template.json): its completion index, and pod 0's address and port."""

    rank: int
    master_addr: str
    master_port: int

    @classmethod
    def from_env(cls) -> "NodeRole":
        missing = [key for key in ("POSTTRAIN_NODE_RANK", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(key)]
        if missing:
            raise RuntimeError("a stage on several nodes runs in its work pool's indexed Job (the Kubernetes job "
                               f"template in infra/prefect/), which sets {', '.join(missing)}; unset here")
        return cls(int(os.environ["POSTTRAIN_NODE_RANK"]), os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))

    @property
    def store_port(self) -> int:
        """Where node 0 hands the other nodes the stage's rank file (next to torchrun's rendezvous port)."""
        return self.master_port + 1


RANK_FILE_KEY = "posttrain/rank-file"


def launch_command(resources, spec_path: Path, node: NodeRole | None = None) -> list[str]:
    """The launcher of this machine's training processes; ``node``: its role in a multi-node stage."""
    entry = ["-m", "flows.execution.rank", str(spec_path)]
    if node is not None:  # GPUs on every node (validated); accelerate passes these on to torchrun
        config = ACCELERATE_CONFIGS / f"{resources.strategy}.yaml"
        return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
                "--num_machines", str(resources.nodes), "--machine_rank", str(node.rank),
                "--num_processes", str(resources.world_size()), "--main_process_ip", node.master_addr,
                "--main_process_port", str(node.master_port), *entry]
    if resources.gpus > 1:
        config = ACCELERATE_CONFIGS / f"{resources.strategy}.yaml"
        return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
                "--num_processes", str(resources.world_size()), "--main_process_port", str(_free_port()), *entry]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(resources.world_size()),
            "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), *entry]


def serve_rank_file(node: NodeRole, text: str, timeout_s: float = 1800):
    """Node 0: hold the rank file in a TCP store the other nodes read (``flows/execution/node.py``); keep the
    returned store alive while training."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    store = TCPStore("0.0.0.0", node.store_port, is_master=True, wait_for_workers=False,
                     timeout=timedelta(seconds=timeout_s))
    store.set(RANK_FILE_KEY, text)
    return store


def fetch_rank_file(node: NodeRole, timeout_s: float = 1800) -> str:
    """Nodes 1..N-1: the rank file node 0 serves, waiting for it (node 0 first opens the stage's run)."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    store = TCPStore(node.master_addr, node.store_port, is_master=False, timeout=timedelta(seconds=timeout_s))
    return store.get(RANK_FILE_KEY).decode("utf-8")


def run_distributed(job, ctx, inputs) -> dict[str, float]:
    """Run the stage of ``job`` on ``world_size`` processes; fills ``ctx.staged`` from rank 0 and
    returns the metrics rank 0 reported.

    Each rank receives the job itself (``flows/execution/rank.py``), not the pipeline file, and the input
    paths this process resolved: an iterate round's training data is the failure set built here,
    which the job alone would not give back."""
    rank_file = {
        "job": job.to_json(), "paths": inputs.paths(),
        "run_id": ctx.run_id, "work_dir": str(ctx.work_dir),
        "resume_dir": str(ctx.resume_dir),
        "seconds_left": (ctx.deadline - time.monotonic()) if ctx.deadline else None,
    }
    resources = job.resources
    spec_path = ctx.work_dir / "distributed.json"
    text = json.dumps(rank_file)
    spec_path.write_text(text, encoding="utf-8")
    node = NodeRole.from_env() if resources.nodes > 1 else None
    store = serve_rank_file(node, text) if node else None  # noqa: F841 (kept open while the ranks train)
    result_path = ctx.work_dir / "distributed.result.json"
    log_path = ctx.work_dir / "distributed.log"
    for stale in [result_path, *ctx.work_dir.glob("distributed.error.rank*.json")]:
        stale.unlink(missing_ok=True)
    ctx.flush()
    python_path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    # PYTHONSAFEPATH: as for the CLI, the caller's directory is not on sys.path (a project's flows/ shadows ours)
    env = {**os.environ, "PYTHONPATH": python_path, "PYTHONSAFEPATH": "1"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(launch_command(resources, spec_path, node), stdout=log, stderr=subprocess.STDOUT, env=env)
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
        raise_first_failure(ctx.work_dir, resources.world_size(), code, log_path)
    ctx.staged.update(result["staged"])
    return result.get("metrics", {})


def raise_first_failure(work_dir: Path, world: int, code: int, log_path: Path) -> None:
    """Raise the error of the rank that failed first (the others usually fail because it left the
    process group), with its traceback; without any rank's report, the launcher's log tail."""
    reports = sorted((json.loads(path.read_text()) for path in work_dir.glob("distributed.error.rank*.json")),
                     key=lambda report: report["time"])
    if not reports:
        raise RuntimeError(f"{world} training processes failed (exit {code}); the launcher's log ({log_path}) "
                           f"ends:\n{log_path.read_text(errors='replace')[-3000:]}")
    first = reports[0]
    if first["error_type"] == "KeyboardInterrupt":
        raise KeyboardInterrupt
    others = [str(report["rank"]) for report in reports[1:]]
    also = f"; rank(s) {', '.join(others)} failed after it" if others else ""
    raise RuntimeError(f"rank {first['rank']} of {world} training processes failed first (exit {code}{also}): "
                       f"{first['error']}\n{first['traceback']}\nall ranks' output: {log_path}")


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
