"""How SFT time grows with the data: the sft stage on 1k, 4k and 16k examples, one epoch.

    python bench/growth.py

Each size runs `stages.sft.run` (batch 32, max_length 128, no packing) for one epoch in
this process, against a real MLflow context in a temporary POSTTRAIN_HOME. Per-step cost
is constant, so time should grow linearly with the number of examples; the last line is
the 16k / 1k time ratio (16 would be exactly linear). Evaluation's growth in attempts is
measured by bench/eval_sampling.py.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path


def main() -> None:
    home = Path(tempfile.mkdtemp())
    os.environ["POSTTRAIN_HOME"] = str(home)
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    from flows.recording.home import configure_environment
    from flows.recording.tracking import MlflowStageContext, Tracker
    from stages import sft
    from stages.context import StageInputs
    from stages.data.sources import ArithmeticData, materialize
    from stages.models.loading import TinyModelSpec, resolve_base_checkpoint
    from stages.sft import SFTStageConfig

    configure_environment()
    tracker = Tracker(home)
    experiment = tracker.experiment_id("growth", None)
    parent = tracker.start_pipeline_run(experiment, "growth", {})
    checkpoint = resolve_base_checkpoint(TinyModelSpec(init="tiny"), 0, home / "models", home)
    seconds = {}
    for n in (1000, 4000, 16000):
        data = materialize(ArithmeticData(generator="arithmetic", n=n, role="train"), home, home / "data")
        run_id = tracker.start_stage_run(experiment, parent, f"sft-{n}", {})
        ctx = MlflowStageContext(tracker, run_id, home / "work" / run_id, seed=0)
        config = SFTStageConfig(kind="sft", data="train", max_steps=None, epochs=1.0, batch_size=32, lr=3e-3)
        started = time.perf_counter()
        sft.run(config, StageInputs(model=checkpoint, datasets={"data": data}), ctx)
        ctx.flush()
        seconds[n] = time.perf_counter() - started
        print(f"sft, {n:>5} examples, 1 epoch ({n // 32} steps): {seconds[n]:.1f} s "
              f"({seconds[n] / (n / 32) * 1000:.0f} ms/step)", flush=True)
    print(f"4k/1k: {seconds[4000] / seconds[1000]:.2f}x, 16k/4k: {seconds[16000] / seconds[4000]:.2f}x "
          "(4.00x is linear)")
    print(f"sft_16k_vs_1k_time_ratio={seconds[16000] / seconds[1000]:.2f}")


if __name__ == "__main__":
    main()
