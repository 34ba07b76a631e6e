#!/usr/bin/env bash
# GRPO with generation apart from training on a GPU machine: bench/async_grpo.py's layouts on CUDA, one process
# per layout, the GPU sampled every second (nvidia-smi dmon: the device; pmon: each process on it, so that the
# trainer's and vLLM's shares are told apart where they share a GPU).
#
#   bash bench/gpu_layouts.sh OUT_DIR [layout ...]     # default: colocated server-0 server-1 server-0-merged
#   STEPS=8 TIMEOUT_S=180 bash bench/gpu_layouts.sh OUT_DIR server-1
#
# Needs CUDA, PyPI's vllm and posttrain's dependencies. Every vLLM engine (colocated in the trainer's process, or
# a generation server of the stage's own) takes engine.gpu_memory_utilization of the GPU it runs on: with one GPU
# the server shares it with the trainer. Written to OUT_DIR: each layout's figures (<layout>.json) and log, the
# samplers' raw output (dmon.txt, pmon.txt, gpus.csv) and summary.json, which is also printed: per layout the
# stage's figures, the device's mean and peak SM utilisation over the layout's run, each side's mean SM
# utilisation (trainer: the stage's process; vllm: every other process on the GPU) and the seconds in which both
# were busy at once (generation overlapping training).
set -uo pipefail
out=${1:?usage: bash bench/gpu_layouts.sh OUT_DIR [layout ...]}
shift
layouts=("$@")
[ ${#layouts[@]} -eq 0 ] && layouts=(colocated server-0 server-1 server-0-merged)
steps=${STEPS:-8}
limit=${TIMEOUT_S:-180}
python=${PYTHON:-python3}
mkdir -p "$out"
# vLLM 0.25's GPU sampler imports flashinfer unless told not to, and fails the engine's start where it is absent
# (as in the wheels carried to the H200 on 2026-12-04); PyPI's vllm installs it, so this only matters then
"$python" -c "import flashinfer" 2>/dev/null || export VLLM_USE_FLASHINFER_SAMPLER=0
command -v nvidia-smi >/dev/null || { echo "gpu_layouts: no nvidia-smi: this machine has no NVIDIA GPU" >&2; exit 2; }
"$python" -c "import vllm, torch; assert torch.cuda.is_available()" \
  || { echo "gpu_layouts: needs torch with CUDA and PyPI's vllm" >&2; exit 2; }
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv > "$out/gpus.csv"
nvidia-smi dmon -s um -d 1 -o DT > "$out/dmon.txt" 2>&1 &
dmon=$!
nvidia-smi pmon -s u -d 1 -o DT > "$out/pmon.txt" 2>&1 &
pmon=$!
trap 'kill $dmon $pmon 2>/dev/null' EXIT
: > "$out/windows.txt"
for layout in "${layouts[@]}"; do
  started=$(date +%s)
  "$python" bench/async_grpo.py --steps "$steps" --layouts "$layout" --out "$out/$layout.json" \
    > "$out/$layout.log" 2>&1 &
  stage=$!
  (sleep "$limit"; kill -TERM "$stage" 2>/dev/null) &
  watchdog=$!
  wait "$stage"
  status=$?
  kill "$watchdog" 2>/dev/null
  echo "$layout $stage $started $(date +%s) $status" >> "$out/windows.txt"
  echo "gpu_layouts: $layout exit $status in $(( $(date +%s) - started )) s"
  [ "$status" -eq 0 ] || tail -n 30 "$out/$layout.log"
done
sleep 2
kill $dmon $pmon 2>/dev/null
"$python" - "$out" <<'PY'
import json
import sys
from datetime import datetime
from pathlib import Path

out = Path(sys.argv[1])


def table(path: Path) -> list[dict]:
    """nvidia-smi dmon / pmon output as rows keyed by its header's names, each with its epoch second."""
    rows, names = [], None
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            names = names or line.lstrip("#").split()
            continue
        fields = line.split()
        if names and len(fields) >= len(names) - 1:
            row = dict(zip(names, fields))
            row["t"] = datetime.strptime(row["Date"] + " " + row["Time"], "%Y%m%d %H:%M:%S").timestamp()
            rows.append(row)
    return rows


def number(value: str) -> float:
    return float(value) if value not in ("-", "") else 0.0


def mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 1) if values else None


device, processes = table(out / "dmon.txt"), table(out / "pmon.txt")
summary = {"gpus": (out / "gpus.csv").read_text().strip().splitlines()[1:]}
for line in (out / "windows.txt").read_text().splitlines():
    layout, stage, start, end, status = line.split()
    start, end = float(start), float(end)
    figures = json.loads((out / f"{layout}.json").read_text()).get(layout, {}) if status == "0" else {}
    sm = [number(row["sm"]) for row in device if start <= row["t"] <= end]
    seconds: dict[float, dict[str, float]] = {}
    for row in processes:
        if start <= row["t"] <= end and row.get("pid", "-") != "-":
            side = "trainer" if row["pid"] == stage else "vllm"
            busy = seconds.setdefault(row["t"], {"trainer": 0.0, "vllm": 0.0})
            busy[side] = max(busy[side], number(row["sm"]))
    summary[layout] = {"exit": int(status), "seconds": round(end - start), **figures,
                       "gpu_sm_mean": mean(sm), "gpu_sm_max": max(sm, default=None),
                       "gpu_memory_max_mib": max((number(r.get("fb", "0")) for r in device if start <= r["t"] <= end),
                                                 default=None),
                       "trainer_sm_mean": mean([s["trainer"] for s in seconds.values()]),
                       "vllm_sm_mean": mean([s["vllm"] for s in seconds.values()]),
                       "both_busy_seconds": sum(1 for s in seconds.values() if s["trainer"] > 0 and s["vllm"] > 0)}
base = summary.get("colocated", {}).get("without_startup")
for layout, row in summary.items():
    if isinstance(row, dict) and base and row.get("without_startup") and layout != "colocated":
        row["speed_vs_colocated_without_startup"] = round(base / row["without_startup"], 2)
(out / "summary.json").write_text(json.dumps(summary, indent=1))
print(json.dumps(summary, indent=1))
PY
