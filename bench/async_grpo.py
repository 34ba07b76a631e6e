"""GRPO with generation apart from training: a vLLM server, synchronous and up to 2 steps ahead, against the
in-process (colocated) vLLM engine, on SmolLM2-135M-Instruct.

    python bench/async_grpo.py                      # 8 steps per layout, this CPU
    python bench/async_grpo.py --steps 20 --layouts colocated server-1

The smollm2-reasoning pipeline's GRPO stage (LoRA r16 on all linear layers, chain_sum prompts, reasoning-gym's
verifier, rollouts in bfloat16 at temperature 1.0 and 24 tokens, 8 attempts) from the instruct model itself
(no SFT: this measures the systems, not the learning), without dynamic sampling (it cannot be drawn ahead).
The instruct model never writes the verifier's <answer> tags (reward 0 on every sample), so a length
penalty (0.02 a character past 20) is added: the groups carry signal and the policy moves, which is what
makes stale samples differ from the trainer's policy. One run per layout, one after the other in
this process, same seed:

- colocated: posttrain's in-process vLLM engine, the policy's merged weights pushed into it before each step;
- server-0: a vLLM server of the stage's own, the LoRA adapter pushed over HTTP after each step, each step's
  rollouts drawn when TRL asks (synchronous);
- server-1, server-2: the same, with the next 1 or 2 steps' rollouts drawn while the trainer trains;
- server-0-merged: server-0 with ``lora_weights: merged`` (the policy with its adapter folded in, reloaded
  from disk after each step: vLLM generates with plain weights instead of applying the adapter per token).

Printed per layout: the stage's seconds (and without the server's start-up), the ratio of the colocated
stage's seconds over it (> 1: faster than colocated), seconds the trainer waited for rollouts and spent
pushing weights per step, mean staleness, the mean reward of the steps, and the sampler/trainer mismatch
the correction saw (mean |delta log p| per token).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import StageContexts, isolated_home, print_summary  # noqa: E402
from bench.backends import SMOLLM2  # noqa: E402

LAYOUTS = {"colocated": {"mode": "colocated"}, "server-0": {"mode": "server", "max_staleness": 0},
           "server-1": {"mode": "server", "max_staleness": 1}, "server-2": {"mode": "server", "max_staleness": 2},
           "server-0-merged": {"mode": "server", "max_staleness": 0, "lora_weights": "merged"}}
TRAIN = {"reasoning_gym": "chain_sum", "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2},
         "n": 400, "seed": 0, "answer_format": "answer_tags", "role": "train"}


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    home = isolated_home()
    from pydantic import TypeAdapter

    from stages import rl
    from stages.context import StageInputs
    from stages.data.sources import DataSpec, materialize
    from stages.models.loading import ModelSpec, resolve_base_checkpoint
    from stages.rewards.spec import RewardSpec
    from stages.rl_common import rl_stage_config

    checkpoint = resolve_base_checkpoint(TypeAdapter(ModelSpec).validate_python(SMOLLM2), 0, home / "cache", home)
    data = materialize(TypeAdapter(DataSpec).validate_python(TRAIN), Path("."), home / "data")
    inputs = StageInputs(policy=checkpoint, datasets={"data": data},
                         rewards={"correct": RewardSpec(fn="reasoning_gym", kwargs={"binary": True}),
                                  "short": RewardSpec(fn="length_penalty", kwargs={"target_chars": 20, "per_char": 0.02})})
    contexts = StageContexts(home, "bench-async-grpo")
    results = {}
    for layout in args.layouts:
        config = rl_stage_config(
            kind="rl", algorithm="grpo", policy="base", data="train", rewards=["correct", "short"], kl_beta=0.02,
            lora={"r": 16, "alpha": 32, "target_modules": "all-linear"}, lr=3e-4, max_steps=args.steps,
            prompts_per_step=args.prompts_per_step, sampling={"temperature": 1.0, "max_tokens": 24, "attempts": 8},
            backend="vllm", engine={"dtype": "bfloat16"}, generation=LAYOUTS[layout], save_steps=None,
            sample_every=1000)
        ctx = contexts.make(layout)
        started = time.perf_counter()
        rl.run(config, inputs, ctx)
        seconds = time.perf_counter() - started
        metrics = ctx.recorded_run().data.metrics
        history = {name: [p.value for p in ctx.metric_history(name)] for name in (
            "reward/mean", "ahead/wait_seconds", "ahead/sync_seconds", "ahead/staleness_mean",
            "correction/logp_diff_abs_mean", "kl")}
        startup = metrics.get("generation_server_startup_seconds", 0.0)
        results[layout] = {"stage_seconds": round(seconds, 1), "without_startup": round(seconds - startup, 1),
                           "server_startup_seconds": round(startup, 1),
                           "wait_seconds_per_step": round(mean(history["ahead/wait_seconds"]), 2),
                           "sync_seconds_per_step": round(mean(history["ahead/sync_seconds"]), 2),
                           "staleness_mean": round(mean(history["ahead/staleness_mean"]), 2),
                           "reward_mean": round(mean(history["reward/mean"]), 3),
                           "reward_last3": round(mean(history["reward/mean"][-3:]), 3),
                           "kl_last": round(history["kl"][-1], 4) if history["kl"] else None,
                           "logp_diff_abs_mean": round(mean(history["correction/logp_diff_abs_mean"]), 4)}
        print(layout, json.dumps(results[layout]), flush=True)
    base = results.get("colocated")
    for layout, row in results.items():
        if base and layout != "colocated":
            row["speed_vs_colocated"] = round(base["stage_seconds"] / row["stage_seconds"], 2)
            row["speed_vs_colocated_without_startup"] = round(base["without_startup"] / row["without_startup"], 2)
    print_summary(results, args.out)


if __name__ == "__main__":
    main()
