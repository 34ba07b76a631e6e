"""Peak resident memory of the quickstart, and of each of its stages run alone.

    python bench/memory.py [PIPELINE]

In a fresh POSTTRAIN_HOME: a full `posttrain run` (peak RSS of the process that runs
every stage), then `posttrain run --only STAGE` for each stage in its own process, and a
fully cached run (what a posttrain process holds with no stage in it: Python, imports,
MLflow). Peaks are the child processes' ru_maxrss (Linux: KiB). Last line: the full run's
peak in MiB.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def peak_mib(cmd, env) -> float:
    """Peak RSS of one command run in a fresh process (a wait4 on it alone)."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} failed")
    return usage.ru_maxrss / 1024


def main() -> None:
    pipeline = sys.argv[1] if len(sys.argv) > 1 else str(ROOT / "pipelines" / "quickstart.yaml")
    import yaml

    stages = list(yaml.safe_load(Path(pipeline).read_text())["stages"])
    with tempfile.TemporaryDirectory() as home:
        env = dict(os.environ, POSTTRAIN_HOME=home)
        env.pop("MLFLOW_TRACKING_URI", None)
        run = [sys.executable, "-m", "flows.cli", "run", pipeline]
        full = peak_mib(run, env)
        print(f"full run (every stage in one process): {full:.0f} MiB")
        cached = peak_mib(run, env)
        print(f"cached run (no stage executes): {cached:.0f} MiB")
        for stage in stages:
            alone = peak_mib(run + ["--only", stage], env)
            print(f"--only {stage}: {alone:.0f} MiB (+{alone - cached:.0f} MiB over the cached run)")
    print(f"quickstart_peak_rss_mib={full:.0f}")


if __name__ == "__main__":
    main()
