"""One rank of a multi-process stage: ``python -m flows.execution.rank JOB.json`` (launched by flows/execution/distributed.py).

The file holds the stage's ``StageJob`` and where rank 0 records (the stage run the
orchestrating process opened) and the input paths it resolved. Every rank runs the same stage
function as an in-process run (``flows.execute.run_stage_function``); rank 0 records
through the real stage context and writes back what it staged, the others compute silently.
A rank that fails writes ``distributed.error.rank<N>.json`` (its error and traceback), so the
launcher can name the rank that failed first rather than the ones its exit brought down.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

from flows.servers import startup
from flows.execution.distributed import RankContext
from flows.execution.execute import resolve_inputs, run_stage_function
from flows.recording.home import configure_environment
from flows.planning.job import StageJob
from flows.recording.tracking import MlflowStageContext, Tracker
from stages.context import StageInputs


def rank_inputs(job: StageJob, described: dict, home: Path) -> StageInputs:
    """The stage's inputs on this rank: rewards and checks rebuilt from the job (they are not JSON),
    every path as the launching process resolved it (an iterate round's failure-set data included).

    On the other nodes of a multi-node stage (``flows/execution/node.py``) those paths are node 0's disk: each
    node resolves the upstream outputs from MLflow (downloading them) and the datasets itself, as a
    pool worker does (``flows.deployment.stage_flow``)."""
    if int(os.environ.get("POSTTRAIN_NODE_RANK", "0")) > 0:
        tracker = Tracker(home)
        upstream = {u: tracker.outputs_of(tracker.get_run(run_id)) for u, run_id in job.upstream_runs.items()}
        return resolve_inputs(job.loaded, job.stage, upstream, home)
    return resolve_inputs(job.loaded, job.stage, job.upstream_outputs, home).with_paths(described["paths"])


def main(rank_file: str) -> int:
    described = json.loads(Path(rank_file).read_text(encoding="utf-8"))
    job = StageJob.from_json(described["job"])
    rank = int(os.environ.get("RANK", "0"))
    home = configure_environment()
    seconds_left = described["seconds_left"]
    deadline = time.monotonic() + seconds_left if seconds_left else None
    work_dir, resume_dir = Path(described["work_dir"]), Path(described["resume_dir"])
    result_path = work_dir / "distributed.result.json"
    try:
        inputs = rank_inputs(job, described, home)
        if rank == 0:
            ctx = MlflowStageContext(Tracker(home), described["run_id"], work_dir, job.seed, resume_dir=resume_dir)
            ctx.deadline = deadline
        else:
            ctx = RankContext(work_dir / f"rank{rank}", resume_dir, job.seed, deadline)
        returned = run_stage_function(job, inputs, ctx)
        ctx.flush()
    except BaseException as error:  # each rank says why it stopped; the launcher reports the first to fail
        (work_dir / f"distributed.error.rank{rank}.json").write_text(json.dumps({
            "rank": rank, "time": time.time(), "error": f"{type(error).__name__}: {error}"[:3000],
            "error_type": type(error).__name__, "traceback": traceback.format_exc()[-4000:]}))
        raise
    if rank == 0:
        result_path.write_text(json.dumps({"staged": ctx.staged, "metrics": ctx.result_metrics(returned)}))
    return 0


if __name__ == "__main__":
    startup.pause()  # until the stage's work starts (flows/servers/startup.py)
    sys.exit(main(sys.argv[1]))
