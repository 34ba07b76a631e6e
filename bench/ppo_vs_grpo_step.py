"""Our PPO step vs the GRPO step on the same batch (a report; the aim is PPO <= 2x GRPO).

    python bench/ppo_vs_grpo_step.py [--steps 20] [--ppo-epochs 2] [--minibatch-size 16]

Both start from the quickstart's untrained tiny model and train on the same 16 arithmetic
prompts, 8 completions each (128 sequences), at most 4 completion tokens, temperature 1,
lr 5e-4, kl_beta 0.01, one torch thread.

- GRPO step: one optimizer step of the real GRPO stage (``stages.rl.run``, TRL's
  GRPOTrainer underneath, quickstart settings: dapo loss, group-centred advantages): the
  generation of 128 completions, reward, reference log-probs, loss, backward and the
  optimizer step; timed from the trainer's ``on_step_begin`` to ``on_step_end``, so the
  MLflow logging after each step is outside it. The training set is exactly the 16 prompts,
  so every GRPO step sees them all.
- PPO step: ``PPORun.step`` (stages/ppo.py) on those same 16 prompts, as ``train_ppo``
  calls it: rollout through ``HFEngine``, reward, reference and critic forward
  passes with GAE, then ``ppo_epochs`` passes of ``minibatch_size`` minibatches updating
  the policy and the critic. MLflow logging is outside it here too. PPO's own knobs default
  to pipelines/ppo.yaml's (2 epochs of 16-sequence minibatches: 16 policy + critic updates).

The two alternate step by step in one process: a trainer callback runs and times one PPO
step after every GRPO step (the first two of each are warm-up). The PPO step is split by
wrapping the functions it calls: generation, scoring, targets (reference + critic forward
and GAE), update; the GRPO step into generate-and-score (TRL's
``_generate_and_score_completions``: sampling, reward, reference log-probs) and the rest.

Last line: ``ppo_step_vs_grpo_step_time_ratio`` = median over steps of PPO step seconds /
the GRPO step seconds that ran just before it (> 1 means PPO's step is slower).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common

SEED = 0
WARMUP = 2
SHARED = {"kind": "rl", "policy": "base", "reference": "base", "data": "train", "rewards": ["correct"],
          "kl_beta": 0.01, "sampling": {"temperature": 1.0, "max_tokens": 4, "attempts": 8},
          "prompts_per_step": 16, "lr": 5.0e-4, "sample_every": 25}


def timed(fn, bucket: list[float]):
    """``fn`` that also appends its seconds to ``bucket``."""

    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            bucket.append(time.perf_counter() - started)

    return wrapper


class PPOSteps:
    """A loaded ``PPORun`` whose step is split into phases by wrapping what it calls."""

    PHASES = ("generation", "scoring", "targets", "update")

    def __init__(self, config, inputs, records: list[dict]):
        import torch

        from stages import ppo

        self.records = records
        self.run = ppo.PPORun.load(config, inputs, SEED)
        self.generator = torch.Generator().manual_seed(SEED)
        self.phases: dict[str, list[float]] = defaultdict(list)
        self.totals: list[float] = []

        class TimedBackend(ppo.HFEngine):
            generate = timed(ppo.HFEngine.generate, self.phases["generation"])

        ppo.HFEngine = TimedBackend
        ppo.score_completions = timed(ppo.score_completions, self.phases["scoring"])
        ppo.compute_targets = timed(ppo.compute_targets, self.phases["targets"])
        ppo.ppo_update = timed(ppo.ppo_update, self.phases["update"])

    def step(self, number: int) -> None:
        started = time.perf_counter()
        self.run.step(number, self.records, self.generator)
        self.totals.append(time.perf_counter() - started)


def grpo_step_timer(ppo_steps: PPOSteps, grpo_times: list[float], grpo_generate: list[float]):
    """A trainer callback: time each GRPO step, then run one PPO step before the next."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        started = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            grpo_times.append(time.perf_counter() - self.started)
            ppo_steps.step(state.global_step)

    def install(trainer) -> None:
        trainer._generate_and_score_completions = timed(trainer._generate_and_score_completions, grpo_generate)
        trainer.add_callback(StepTimer())

    return install


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20, help="timed steps of each (after 2 warm-up steps)")
    parser.add_argument("--ppo-epochs", type=int, default=2, help="PPO passes over each rollout batch")
    parser.add_argument("--minibatch-size", type=int, default=16, help="PPO sequences per minibatch")
    args = parser.parse_args()

    home = _common.isolated_home()
    _common.one_thread()
    from stages import rl
    from stages.training import callbacks as trainer_callbacks
    from stages.data.sources import read_materialized
    from stages.rewards.spec import RewardSpec
    from stages.context import StageInputs
    from stages.rl_common import rl_stage_config

    checkpoint = _common.tiny_checkpoint(home, SEED)
    data = _common.arithmetic_data(home, SHARED["prompts_per_step"])  # exactly one batch of prompts
    inputs = StageInputs(policy=checkpoint, reference=checkpoint, datasets={"train": data},
                         rewards={"correct": RewardSpec(fn="exact_answer")})
    total_steps = args.steps + WARMUP
    ppo_config = rl_stage_config(**SHARED, algorithm="ppo", max_steps=total_steps, ppo_epochs=args.ppo_epochs,
                               minibatch_size=args.minibatch_size)
    grpo_config = rl_stage_config(**SHARED, algorithm="grpo", max_steps=total_steps, loss="dapo",
                                advantage="group_centered")
    ppo_steps = PPOSteps(ppo_config, inputs, read_materialized(data))

    grpo_times: list[float] = []
    grpo_generate: list[float] = []
    install = grpo_step_timer(ppo_steps, grpo_times, grpo_generate)
    original_quiet = trainer_callbacks.quiet_trainer

    def quiet_and_timed(trainer):
        original_quiet(trainer)
        install(trainer)

    trainer_callbacks.quiet_trainer = quiet_and_timed  # train_grpo imports it at call time
    sequences = SHARED["prompts_per_step"] * SHARED["sampling"]["attempts"]
    n_minibatches = -(-sequences // args.minibatch_size)
    print(f"{SHARED['prompts_per_step']} prompts x {SHARED['sampling']['attempts']} = {sequences} completions of <= "
          f"{SHARED['sampling']['max_tokens']} tokens per step, tiny quickstart model, 1 thread; PPO: "
          f"{args.ppo_epochs} epochs x {n_minibatches} minibatches of {args.minibatch_size}; GRPO: 1 optimizer step; "
          f"{args.steps} steps of each, alternating, after {WARMUP} warm-up steps", flush=True)
    rl.run(grpo_config, inputs, _common.StageContexts(home, "bench-step").make("grpo", SEED))

    grpo = grpo_times[WARMUP:]
    ppo = ppo_steps.totals[WARMUP:]
    grpo_gen = grpo_generate[WARMUP:]
    median = _common.median
    print(f"GRPO step  {_common.spread(grpo)}")
    print(f"  generate + score + reference log-probs  {median(grpo_gen):.3f}s "
          f"({median(grpo_gen) / median(grpo):.0%});  loss, backward, optimizer and the rest "
          f"{median(grpo) - median(grpo_gen):.3f}s")
    print(f"PPO step   {_common.spread(ppo)}")
    parts = {name: median(ppo_steps.phases[name][WARMUP:]) for name in PPOSteps.PHASES}
    for name, seconds in parts.items():
        print(f"  {name:<10} {seconds:.3f}s ({seconds / median(ppo):.0%})")
    other = median(ppo) - sum(parts.values())
    print(f"  {'other':<10} {other:.3f}s (rollout padding, metrics)")
    print(f"PPO update per minibatch (policy + critic forward, backward, 2 optimizer steps): "
          f"{1000 * parts['update'] / (args.ppo_epochs * n_minibatches):.0f} ms")
    print(f"ppo_step_vs_grpo_step_time_ratio={_common.paired_ratio(ppo, grpo):.2f}")


if __name__ == "__main__":
    main()
