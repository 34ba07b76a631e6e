"""The entry of every pod of a stage's Kubernetes Job: ``python -m flows.execution.node PREFECT-COMMAND...``.

The GPU job template (``infra/prefect/gpu-k8s-job-template.json``) runs each stage as an indexed
Job of ``nodes`` pods (one for an ordinary stage) whose container command is this module and whose
arguments are the flow-run command Prefect's Kubernetes worker put there. The pod's environment
says its place: ``POSTTRAIN_NODE_RANK`` (the Job's completion index),
``MASTER_ADDR`` (pod 0, through the headless Service ``posttrain-nodes``) and ``MASTER_PORT``.

- Pod 0 runs the flow run itself (``flows.deployment.stage_flow``): it opens the stage's MLflow
  run, serves the rank file on ``MASTER_PORT + 1`` and launches its processes with
  ``--machine_rank 0`` (``flows/execution/distributed.py``).
- Pods 1..N-1 do not run the flow run (Prefect would see it executed N times): they wait for pod
  0's rank file, then launch their own processes with ``--machine_rank i`` against pod 0's
  rendezvous. Their exit status is the pod's, so a failed node fails the Job.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path


def node_command(prefect_command: list[str], env: dict[str, str]) -> tuple[list[str], str | None]:
    """What this pod runs, and the rank file it must write first (None on pod 0, the only pod of a one-node Job)."""
    if int(env.get("POSTTRAIN_NODE_RANK") or 0) == 0:
        if not prefect_command:
            raise SystemExit("flows.execution.node: no command to run (the job template passes Prefect's flow-run command "
                             "as the container's arguments)")
        return prefect_command, None
    return [], str(Path(tempfile.gettempdir()) / "posttrain-rank-file.json")


def main(argv: list[str]) -> int:
    from flows.execution.distributed import NodeRole, fetch_rank_file, launch_command
    from flows.planning.job import StageJob

    command, rank_file = node_command(argv, dict(os.environ))
    if rank_file is None:
        os.execvp(command[0], command)  # pod 0: the flow run, as on a one-node Job
    node = NodeRole.from_env()
    text = fetch_rank_file(node)
    Path(rank_file).write_text(text, encoding="utf-8")
    resources = StageJob.from_json(json.loads(text)["job"]).resources
    print(f"node {node.rank} of {resources.nodes}: joining {node.master_addr}:{node.master_port}", flush=True)
    launch = launch_command(resources, Path(rank_file), node)
    os.execvp(launch[0], launch)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
