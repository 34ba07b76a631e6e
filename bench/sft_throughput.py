"""SFT throughput: the sft stage with packing vs a plain PyTorch loop over the same tokens.

    python bench/sft_throughput.py [--steps 60] [--trl-steps 8] [--rounds 2] [--threads 1]

Ours: ``stages.sft.run`` with a real MLflow stage context (SQLite in a temporary
POSTTRAIN_HOME) at the quickstart's model (~0.34M params) and data (4000 arithmetic
chats of ~17 tokens): ``packing: true``, the chat template, assistant-only loss, batch
32 x 128 tokens, gradient checkpointing off (the stage's default).

Plain loop: the same base checkpoint, ``torch.optim.AdamW`` at the same learning rate,
``model(input_ids, labels).loss.backward(); step()`` over 32 x 128 batches of the same
packed rows (built by ``stages.data.packing``, collated once, before timing), with plain
causal attention over each row: the cheapest loop over these tokens, with no document
separation, no gradient clipping, no logging.

TRL's default packing (the stage before the fix, for the record): ``SFTTrainer`` with
``packing=True`` (best-fit decreasing, padding-free) and the stage's other settings.

Interleaving: lockstep. Every time the trainer finishes a step (the stage's progress tick,
or a callback for TRL's trainer) the plain loop runs one step, so each trainer step sits
between two plain steps under the same load from other jobs. A trainer step is timed from
the end of one plain step to the next tick: all the trainer does per step, data loading,
metrics and MLflow logging included. After the first 3 steps of each run, each side's
tokens/s is the mean real (non-padding) tokens per step over its median step time.

Torch runs on one thread by default, as the other benches do: on this shared 2-core box
two spinning OpenMP threads made every step of both sides ~20x slower whenever another job
held a core (the ratio survived, the 5-minute budget did not). ``--threads 2`` to compare.

Last line: ``sft_stage_vs_plain_loop_tokens_per_s_ratio`` = ours / plain loop, the median
over rounds (aim: >= 0.8).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common

BATCH_SIZE, MAX_LENGTH, LR, WARMUP_STEPS = 32, 128, 3e-3, 3


class LockstepPlainLoop:
    """A plain PyTorch training loop that runs one step each time a trainer ticks ``advance``."""

    def __init__(self, checkpoint: Path, batches: list[dict]):
        import torch

        from stages.models.loading import load_model_and_tokenizer

        self.model, _ = load_model_and_tokenizer(checkpoint)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR, weight_decay=0.0)
        self.batches = batches
        self.trainer_seconds: list[float] = []
        self.plain_seconds: list[float] = []
        self._last_plain_end: float | None = None

    def advance(self, amount: int = 1) -> None:
        now = time.perf_counter()
        if self._last_plain_end is not None:
            self.trainer_seconds.append(now - self._last_plain_end)
        batch = self.batches[len(self.plain_seconds) % len(self.batches)]
        started = time.perf_counter()
        self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._last_plain_end = time.perf_counter()
        self.plain_seconds.append(self._last_plain_end - started)

    def medians(self) -> tuple[float, float]:
        """Median seconds per step of the trainer and of the plain loop, after warm-up."""
        return (statistics.median(self.trainer_seconds[WARMUP_STEPS:]),
                statistics.median(self.plain_seconds[WARMUP_STEPS:]))


def plain_batches(data: Path, checkpoint: Path, steps: int) -> tuple[list[dict], float]:
    """Batches of the same packed rows the stage trains on (shuffled once), and their mean real tokens."""
    import torch

    from stages.data.sources import read_materialized
    from stages.models.loading import load_model_and_tokenizer
    from stages.data.packing import PackedRowCollator, pack_documents, tokenize_conversations

    _, tokenizer = load_model_and_tokenizer(checkpoint)
    conversations = [record["messages"] for record in read_materialized(data)]
    rows = pack_documents(tokenize_conversations(conversations, tokenizer, True), MAX_LENGTH)
    collate = PackedRowCollator(tokenizer.pad_token_id, MAX_LENGTH, block_mask=False)
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(0)).tolist()
    chunks = [order[i : i + BATCH_SIZE] for i in range(0, len(rows) - BATCH_SIZE + 1, BATCH_SIZE)][:steps]
    batches = [collate([rows[i] for i in chunk]) for chunk in chunks]
    tokens = statistics.mean(sum(len(rows[i]["input_ids"]) for i in chunk) for chunk in chunks)
    return batches, tokens


def run_stage(contexts, checkpoint: Path, data: Path, loop: LockstepPlainLoop, steps: int) -> float:
    """The sft stage, packing on, with the plain loop ticking on its progress bar; real tokens per step."""
    from stages import sft
    from stages.context import StageInputs

    ctx = contexts.make("sft-packed")

    @contextmanager
    def lockstep_progress(description, total):
        yield loop

    ctx.progress = lockstep_progress  # the stage's tracking callback advances it once per optimizer step
    config = sft.SFTStageConfig(kind="sft", data="train", packing=True, max_steps=steps, batch_size=BATCH_SIZE,
                                max_length=MAX_LENGTH, lr=LR, assistant_only_loss=True, logging_steps=10)
    sft.run(config, StageInputs(model=checkpoint, datasets={"train": data}), ctx)
    last = ctx.metric_history("num_tokens")[-1]
    return last.value / last.step


def run_trl_default_packing(checkpoint: Path, data: Path, loop: LockstepPlainLoop, steps: int, home: Path) -> float:
    """TRL's SFTTrainer with its own (padding-free) packing, as the stage ran before; real tokens per step."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from stages.data.sources import read_materialized
    from stages.models.loading import load_model_and_tokenizer
    from stages.training.callbacks import quiet_trainer

    class Lockstep(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            loop.advance()

    model, tokenizer = load_model_and_tokenizer(checkpoint)
    tokenizer.padding_side = "right"
    dataset = Dataset.from_list([{"messages": r["messages"]} for r in read_materialized(data)])
    args = SFTConfig(output_dir=str(home / "trl-default"), max_steps=steps, per_device_train_batch_size=BATCH_SIZE,
                     learning_rate=LR, lr_scheduler_type="cosine", max_length=MAX_LENGTH, packing=True,
                     assistant_only_loss=True, gradient_checkpointing=False, logging_steps=10, save_strategy="no",
                     use_cpu=not torch.cuda.is_available(), bf16=False, report_to="none", seed=0,
                     dataloader_num_workers=0, disable_tqdm=True)
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                         callbacks=[Lockstep()])
    quiet_trainer(trainer)
    trainer.train()
    rows = trainer.train_dataset
    return BATCH_SIZE * sum(sum(lengths) for lengths in rows["seq_lengths"]) / len(rows)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps per run of the stage")
    parser.add_argument("--trl-steps", type=int, default=8, help="steps per run of TRL's default packing (slow)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of (stage, TRL default)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's default)")
    args = parser.parse_args()
    if min(args.steps, args.trl_steps) < WARMUP_STEPS + 2:
        parser.error(f"--steps and --trl-steps must be at least {WARMUP_STEPS + 2} "
                     f"(the first {WARMUP_STEPS} are warm-up)")

    home = _common.isolated_home()
    import datasets
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    datasets.disable_progress_bars()  # TRL's and our packing's per-dataset bars

    checkpoint = _common.tiny_checkpoint(home)
    data = _common.arithmetic_data(home, 4000)
    contexts = _common.StageContexts(home, "sft-throughput")
    batches, plain_tokens = plain_batches(data, checkpoint, args.steps)
    print(f"threads {torch.get_num_threads()}; batch {BATCH_SIZE} x {MAX_LENGTH}; plain loop: "
          f"{plain_tokens:.0f} real tokens per step", flush=True)

    results: dict[str, list[tuple[float, float, float]]] = {"stage": [], "trl_default": []}
    for round_ in range(args.rounds):
        for name in ("stage", "trl_default") if round_ % 2 == 0 else ("trl_default", "stage"):
            loop = LockstepPlainLoop(checkpoint, batches)
            if name == "stage":
                tokens = run_stage(contexts, checkpoint, data, loop, args.steps)
            else:
                tokens = run_trl_default_packing(checkpoint, data, loop, args.trl_steps, home)
            trainer_step, plain_step = loop.medians()
            ours, plain = tokens / trainer_step, plain_tokens / plain_step
            results[name].append((ours, plain, ours / plain))
            print(f"  round {round_ + 1} {name:<11}: {trainer_step * 1000:7.1f} ms/step {ours:8.0f} tok/s | "
                  f"plain loop {plain_step * 1000:6.1f} ms/step {plain:8.0f} tok/s | ratio {ours / plain:.2f}",
                  flush=True)

    print(f"{'':<24}{'tokens/s':>10}{'plain loop':>12}{'ratio':>8}")
    labels = {"stage": "sft stage (packing)", "trl_default": "TRL default packing"}
    for name, rows in results.items():
        ours, plain, ratio = (statistics.median(column) for column in zip(*rows))
        print(f"{labels[name]:<24}{ours:>10.0f}{plain:>12.0f}{ratio:>8.2f}")
    trl_ratio = statistics.median(r for _, _, r in results["trl_default"])
    print(f"trl_default_packing_vs_plain_loop_tokens_per_s_ratio={trl_ratio:.2f}")
    stage_ratio = statistics.median(r for _, _, r in results["stage"])
    print(f"sft_stage_vs_plain_loop_tokens_per_s_ratio={stage_ratio:.2f}")


if __name__ == "__main__":
    main()
