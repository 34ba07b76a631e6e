"""The GRPO stage vs TRL's GRPOTrainer driven directly with the same settings (aim: >= 0.95x).

    python bench/grpo_vs_trl.py [--steps 25] [--repeats 5]

Ours: ``stages.rl.run`` with ``algorithm: grpo`` at the quickstart's settings (16 prompts x
8 completions per step, 4 completion tokens, kl_beta 0.01, dapo loss, group-centred
advantages, lr 5e-4) on the quickstart's untrained tiny model, with a real MLflow stage
context: per-step metrics to SQLite, sample tables every 25 steps, reward wrappers, the
ratio metric, curves PNG and checkpoint at the end.

TRL: the same checkpoint loaded with plain transformers, a plain ``GRPOConfig`` with the
same settings (checked field by field against the stage's own ``build_grpo_config``), a
plain Python exact-answer reward and ``GRPOTrainer.train()``; its console printer and
tqdm bar removed, as the stage removes them. Then the model is saved, as the stage does.

Two timings per run, both side by side in one process, alternating ours and TRL:
- train loop: the seconds inside ``Trainer.train()`` (a timing wrapper on transformers'
  ``Trainer.train``, the same for both). For ours this holds everything the stage adds per
  step (MLflow logging, sample tables, reward wrappers); it leaves out model loading,
  dataset building and trainer construction on both sides. This is the headline.
- end to end: for ours the whole ``rl.run`` call; for TRL model + tokenizer load, dataset,
  trainer construction, train and save.

Last line: ``grpo_stage_vs_trl_speed_ratio`` = TRL train-loop seconds / ours (steps/s of
ours over steps/s of TRL; > 1 means ours is faster), the median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common

# The quickstart's grpo stage, minus check_rewards (a one-off check before training).
STAGE = {"kind": "rl", "algorithm": "grpo", "policy": "base", "reference": "base", "data": "train",
         "rewards": ["correct"], "kl_beta": 0.01, "advantage": "group_centered",
         "sampling": {"temperature": 1.0, "max_tokens": 4, "attempts": 8},
         "loss": "dapo", "prompts_per_step": 16, "lr": 5.0e-4, "sample_every": 25,
         "save_steps": None}  # no periodic resumable checkpoints: the plain trainer writes none either
SAMPLING = STAGE["sampling"]
SEED = 0
TRAIN_SECONDS: dict[str, float] = {}


def time_trainer_train() -> None:
    """Record how long each ``Trainer.train()`` call takes (ours and TRL's alike)."""
    import transformers

    original = transformers.Trainer.train

    def timed(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            TRAIN_SECONDS["last"] = time.perf_counter() - started

    transformers.Trainer.train = timed


_INTEGER = re.compile(r"-?\d+")


def plain_exact_answer(completions, answer, **_):
    """TRL-style reward: 1.0 when the reply is exactly the reference integer, else 0.0."""
    scores = []
    for completion, reference in zip(completions, answer):
        text = completion[-1]["content"].strip()
        scores.append(1.0 if _INTEGER.fullmatch(text) and int(text) == int(reference) else 0.0)
    return scores


def plain_grpo_config(output_dir: str, max_steps: int):
    """The stage's settings written out as a plain GRPOConfig, as a TRL user would."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=output_dir, max_steps=max_steps, learning_rate=STAGE["lr"], lr_scheduler_type="constant",
        per_device_train_batch_size=STAGE["prompts_per_step"] * SAMPLING["attempts"],
        gradient_accumulation_steps=1, steps_per_generation=1, num_generations=SAMPLING["attempts"],
        max_completion_length=SAMPLING["max_tokens"], temperature=SAMPLING["temperature"], top_p=1.0,
        beta=STAGE["kl_beta"], loss_type=STAGE["loss"], scale_rewards="none", epsilon=0.2,
        logging_steps=1, save_strategy="no", report_to="none", seed=SEED, data_seed=SEED, use_cpu=True,
        log_completions=False, dataloader_num_workers=0,
        # GRPOConfig defaults to bf16 and gradient checkpointing; the stage turns both off on CPU
        bf16=False, gradient_checkpointing=False,
    )


def check_same_settings(ours, theirs) -> None:
    """Every GRPOConfig field the stage sets must match the plain config, or the race is unfair."""
    mine, plain = ours.to_dict(), theirs.to_dict()
    differ = {k: (mine[k], plain.get(k)) for k in mine  # save_total_limit: moot where nothing is saved
              if k not in ("output_dir", "logging_dir", "save_total_limit") and mine[k] != plain.get(k)}
    if differ:
        raise SystemExit(f"settings differ between the stage and the plain TRL config: {differ}")


class Race:
    def __init__(self, home: Path, steps: int):
        from stages.context import StageInputs
        from stages.rewards.spec import RewardSpec

        self.home, self.steps = home, steps
        self.checkpoint = _common.tiny_checkpoint(home, SEED)
        self.data = _common.arithmetic_data(home, 4000)
        self.contexts = _common.StageContexts(home, "bench-grpo")
        self.inputs = StageInputs(policy=self.checkpoint, reference=self.checkpoint, datasets={"train": self.data},
                                  rewards={"correct": RewardSpec(fn="exact_answer")})
        self.end_to_end: dict[str, list[float]] = {"ours": [], "trl": []}
        self.tracking_seconds: list[float] = []  # ours, per run: all MLflow calls (metrics, tables, figure)
        self.log_metrics_seconds: list[float] = []  # ours, per call: the per-step metrics
        self.last_ours_checkpoint: str | None = None
        self.last_trl_model = None

    def ours(self) -> float:
        from stages import rl
        from stages.rl_common import rl_stage_config

        config = rl_stage_config(**STAGE, max_steps=self.steps)
        ctx = self.contexts.make("grpo", SEED)
        tracking = _common.time_tracking_calls(ctx)
        started = time.perf_counter()
        outputs = rl.run(config, self.inputs, ctx)
        self.tracking_seconds.append(sum(sum(calls) for calls in tracking.values()))
        self.log_metrics_seconds.extend(tracking["log_metrics"])
        self.end_to_end["ours"].append(time.perf_counter() - started)
        self.last_ours_checkpoint = outputs["checkpoint"]
        return TRAIN_SECONDS["last"]

    def trl(self) -> float:
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.trainer_callback import PrinterCallback, ProgressCallback
        from trl import GRPOTrainer

        from stages.data.sources import read_materialized

        started = time.perf_counter()
        out = tempfile.mkdtemp(dir=self.home)
        tokenizer = AutoTokenizer.from_pretrained(self.checkpoint)
        tokenizer.padding_side = "left"
        model = AutoModelForCausalLM.from_pretrained(self.checkpoint)
        records = read_materialized(self.data)
        dataset = Dataset.from_list([{"prompt": r["messages"][:-1], "answer": r["answer"]} for r in records])
        trainer = GRPOTrainer(model=model, reward_funcs=[plain_exact_answer], args=plain_grpo_config(out, self.steps),
                              train_dataset=dataset, processing_class=tokenizer)
        trainer.remove_callback(PrinterCallback)
        trainer.remove_callback(ProgressCallback)
        trainer.train()
        trainer.model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        self.end_to_end["trl"].append(time.perf_counter() - started)
        self.last_trl_model = trainer.model
        return TRAIN_SECONDS["last"]


def same_weights(ours_checkpoint: str, trl_model) -> bool:
    """Did both runs compute the same thing? (Same seed, data order, settings: they should.)"""
    import torch
    from transformers import AutoModelForCausalLM

    ours = AutoModelForCausalLM.from_pretrained(ours_checkpoint).state_dict()
    theirs = trl_model.state_dict()
    return all(torch.allclose(ours[k], theirs[k].cpu(), atol=1e-6) for k in ours)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=25, help="GRPO steps per timed run")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of each, alternating")
    args = parser.parse_args()

    home = _common.isolated_home()
    _common.one_thread()
    time_trainer_train()
    from stages.grpo import build_grpo_config
    from stages.rl_common import rl_stage_config

    check_same_settings(build_grpo_config(rl_stage_config(**STAGE, max_steps=args.steps), home / "x", SEED),
                        plain_grpo_config(str(home / "x"), args.steps))
    race = Race(home, args.steps)
    completions = STAGE["prompts_per_step"] * SAMPLING["attempts"]
    print(f"GRPO, {args.steps} steps x {completions} completions ({STAGE['prompts_per_step']} prompts x "
          f"{SAMPLING['attempts']}), {SAMPLING['max_tokens']} tokens, tiny quickstart model, 1 thread; "
          f"{args.repeats} alternating rounds after a 2-step warm-up of each", flush=True)
    race.steps = 2
    race.ours(), race.trl()
    race.steps = args.steps
    e2e = race.end_to_end = {"ours": [], "trl": []}
    race.tracking_seconds, race.log_metrics_seconds = [], []
    times = _common.interleaved({"ours": race.ours, "trl": race.trl}, args.repeats, warmup=False)

    for name, label in (("ours", "GRPO stage (rl.run)"), ("trl", "plain TRL GRPOTrainer")):
        per_step = _common.median(times[name]) / args.steps
        print(f"{label:<22} train loop {_common.spread(times[name])}  = {1 / per_step:.2f} steps/s, "
              f"{completions / per_step:.0f} completions/s;  end to end {_common.spread(e2e[name])}")
    print(f"ours: MLflow calls (per-step metrics, sample tables, params, curves PNG) took "
          f"{_common.spread(race.tracking_seconds)} per run; one step's log_metrics "
          f"{1000 * _common.median(race.log_metrics_seconds):.0f} ms (median of {len(race.log_metrics_seconds)})")
    print(f"same final weights as TRL (same seed and settings): {same_weights(race.last_ours_checkpoint, race.last_trl_model)}")
    print(f"end-to-end speed ratio (ours / TRL, incl. load, set-up, save): "
          f"{_common.paired_ratio(e2e['trl'], e2e['ours']):.2f}")
    print(f"grpo_stage_vs_trl_speed_ratio={_common.paired_ratio(times['trl'], times['ours']):.2f}")


if __name__ == "__main__":
    main()
