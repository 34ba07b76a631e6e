"""A training stage that stops (Ctrl-C, kill -9, its time limit) continues where it stopped (docs/algorithms.md)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from pydantic import Field

from stages.context import RESUMED_TAG, StageTimeLimit
from stages.spec_model import SpecModel

STATE_FILE = "stage_state.json"
# TRL counters outside its checkpointed trainer state (TRL 1.16: ``num_tokens`` would restart from 0)
TRL_COUNTERS = ("_total_train_tokens",)


class Resumable(SpecModel):
    """The field of every trainer-backed stage kind that says how often it writes a resumable checkpoint."""

    save_steps: int | None = Field(
        50, ge=1,
        description="Write a resumable trainer checkpoint every N steps (kept only until the stage finishes); "
        "an interrupted or killed run resumes from the latest. Null: only on Ctrl-C.",
    )


def resumable_arguments(resume_dir: Path, save_steps: int | None) -> dict:
    """Trainer arguments that write a resumable checkpoint (only the latest kept) every ``save_steps``."""
    return {
        "output_dir": str(resume_dir),
        "save_strategy": "steps" if save_steps else "no",
        "save_steps": save_steps or 500,
        "save_total_limit": 1,
    }


def last_checkpoint(resume_dir: Path) -> str | None:
    """The newest trainer checkpoint in ``resume_dir`` with a readable ``trainer_state.json`` (written last)."""
    if not resume_dir.is_dir():
        return None
    found = sorted((int(p.name.rsplit("-", 1)[1]), p) for p in resume_dir.glob("checkpoint-*")
                   if p.is_dir() and p.name.rsplit("-", 1)[1].isdigit())
    for _, folder in reversed(found):
        try:
            json.loads((folder / "trainer_state.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        return str(folder)
    return None


class StageState:
    """What posttrain's code keeps across a trainer's steps: ``save()``/``restore(saved)`` as JSON, ``save_files``/
    ``restore_files`` as files in the checkpoint; ``every``: checkpoint only at multiples of this step."""

    def __init__(self, save: Callable[[], dict[str, Any]] = dict, restore: Callable[[dict], None] = lambda saved: None,
                 every: int = 1, save_files: Callable[[Path], None] | None = None,
                 restore_files: Callable[[Path], None] | None = None):
        self.save, self.restore, self.every = save, restore, every
        self.save_files, self.restore_files = save_files, restore_files


def train_resumably(trainer, ctx, state: StageState | None = None) -> tuple[Any, int]:
    """``trainer.train()`` resumed from ``ctx.resume_dir``, stopped gracefully on Ctrl-C or at the time limit:
    (its output, ``training_loss`` the mean since the stage began; the step it resumed from, 0 afresh)."""
    state = state or StageState()
    resume_from = last_checkpoint(ctx.resume_dir)
    saved = _read_state(resume_from) if resume_from else {}
    if resume_from:
        state.restore(saved.get("stage", {}))
        if state.restore_files is not None:
            state.restore_files(Path(resume_from))
        for name, value in saved.get("counters", {}).items():
            setattr(trainer, name, value)
        announce_resume(ctx, saved["step"], saved.get("run"), resume_from)
    with stop_gracefully(trainer, ctx):
        trainer.add_callback(_state_writer(trainer, state, saved.get("loss_sum", 0.0), getattr(ctx, "run_id", None)))
        result = trainer.train(resume_from_checkpoint=resume_from)
    resumed_step = int(resume_from.rsplit("-", 1)[-1]) if resume_from else 0
    steps = trainer.state.global_step
    if resumed_step and steps:  # the losses before the stop were summed into the checkpoint
        this_run = result.training_loss * (steps - resumed_step)
        result = result._replace(training_loss=(saved.get("loss_sum", 0.0) + this_run) / steps)
    return result, resumed_step


def train_measured(trainer, ctx, state: StageState | None = None) -> dict[str, float]:
    """``train_resumably``, then the summary every trainer stage logs (time, losses, steps, resumed step)."""
    started = time.perf_counter()
    result, resumed_step = train_resumably(trainer, ctx, state)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    mean_loss = float(result.training_loss)
    return {"train_seconds": time.perf_counter() - started, "train_loss": mean_loss,
            "first_loss": float(losses[0]) if losses else mean_loss,
            "final_loss": float(losses[-1]) if losses else mean_loss,
            "steps": float(trainer.state.global_step), "resumed_from_step": float(resumed_step)}


def _read_state(checkpoint: str) -> dict:
    path = Path(checkpoint) / STATE_FILE
    if not path.is_file():
        raise RuntimeError(f"the resumable checkpoint {checkpoint} has no {STATE_FILE}: it was written by an older "
                           f"posttrain; delete {Path(checkpoint).parent} to start the stage over")
    return json.loads(path.read_text(encoding="utf-8"))


def _state_writer(trainer, state: StageState, loss_sum_before: float, run_id: str | None):
    """A callback writing the stage's state into each checkpoint before the trainer's files (none at the end)."""
    from transformers import TrainerCallback

    class StateWriter(TrainerCallback):
        def on_step_end(self, args, train_state, control, **kwargs):
            if train_state.global_step >= train_state.max_steps or train_state.global_step % state.every:
                control.should_save = False  # finished (published, not resumed), or between two fresh batches
            if not (control.should_save and args.should_save):  # one process writes the checkpoint
                return control
            folder = Path(args.output_dir) / f"checkpoint-{train_state.global_step}"
            folder.mkdir(parents=True, exist_ok=True)
            # the trainer's sums cover this execution only; ``_tr_loss`` holds the steps since the last log
            loss_sum = loss_sum_before + trainer._total_loss_scalar + float(trainer._tr_loss)
            if state.save_files is not None:
                state.save_files(folder)
            saved = {"step": train_state.global_step, "run": run_id, "loss_sum": loss_sum, "stage": state.save(),
                     "counters": {name: getattr(trainer, name) for name in TRL_COUNTERS if hasattr(trainer, name)}}
            temporary = folder / (STATE_FILE + ".tmp")
            temporary.write_text(json.dumps(saved), encoding="utf-8")
            os.replace(temporary, folder / STATE_FILE)
            return control

    return StateWriter()


class StopRequest:
    """Ctrl-C or the time limit, a stop after this step: ``due()`` (agreed by all processes), then ``stop()`` raises."""

    def __init__(self, ctx):
        self.deadline = getattr(ctx, "deadline", None)
        self.interrupted = self.timed_out = False

    def due(self) -> bool:
        from stages.training.data_parallel import agreed_flags

        if self.deadline is not None and time.monotonic() >= self.deadline:
            self.timed_out = True
        self.interrupted, self.timed_out = agreed_flags(self.interrupted, self.timed_out)
        return self.interrupted or self.timed_out

    def stop(self, done: int, total: int) -> None:
        if self.interrupted:
            raise KeyboardInterrupt
        if self.timed_out:
            raise StageTimeLimit(f"time limit reached after {done} of {total} optimizer steps; a resumable "
                                 "checkpoint was saved and the next run of this stage resumes from it")


@contextmanager
def stop_requests(ctx) -> Iterator[StopRequest]:
    """A ``StopRequest`` for the block; a second Ctrl-C interrupts at once. Off the main thread no handler
    can be set: Ctrl-C interrupts at once and a later run resumes from the last periodic checkpoint."""
    request = StopRequest(ctx)

    def handler(signum, frame):
        if request.interrupted:
            raise KeyboardInterrupt
        request.interrupted = True
        print("\ninterrupted: stopping after this optimizer step and saving a checkpoint "
              "(Ctrl-C again to stop at once)", file=sys.stderr, flush=True)

    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, handler) if main else None
    try:
        yield request
    finally:
        if main:
            signal.signal(signal.SIGINT, previous)


@contextmanager
def stop_gracefully(trainer, ctx):
    """Stop ``trainer.train()`` between optimizer steps with a checkpoint on Ctrl-C or at the deadline."""
    from transformers import TrainerCallback

    with stop_requests(ctx) as request:
        class StopAtRequest(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if request.due():
                    control.should_save = control.should_training_stop = True
                return control

        callback = StopAtRequest()
        trainer.add_callback(callback)
        try:
            yield
        finally:
            trainer.remove_callback(callback)
    if request.interrupted or request.timed_out:
        request.stop(trainer.state.global_step, trainer.state.max_steps)


class LoopCheckpoints:
    """Checkpoints of posttrain's own loops: ``checkpoint-N/`` (``tensors.pt``, ``stage_state.json``), whole."""

    def __init__(self, ctx, save_steps: int | None):
        self.dir, self.save_steps, self.run_id = Path(ctx.resume_dir), save_steps, getattr(ctx, "run_id", None)

    def latest(self) -> tuple[int, dict, dict] | None:
        """(step, tensors, state) of the newest complete checkpoint, or None."""
        import torch

        found = sorted((int(p.name.rsplit("-", 1)[1]), p) for p in self.dir.glob("checkpoint-*")
                       if p.name.rsplit("-", 1)[1].isdigit() and (p / STATE_FILE).is_file())
        if not found:
            return None
        step, folder = found[-1]
        saved = json.loads((folder / STATE_FILE).read_text(encoding="utf-8"))
        return step, torch.load(folder / "tensors.pt", weights_only=False), saved

    def due(self, step: int, stopping: bool, last: bool) -> bool:
        """Every ``save_steps`` and when stopping; never after the last step."""
        return not last and (stopping or bool(self.save_steps and step % self.save_steps == 0))

    def save(self, step: int, tensors: dict, state: dict) -> None:
        import torch

        from stages.training.data_parallel import rank

        if rank() != 0:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        partial = self.dir / f".checkpoint-{step}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        torch.save(tensors, partial / "tensors.pt")
        (partial / STATE_FILE).write_text(json.dumps({"step": step, "run": self.run_id, "stage": state}),
                                          encoding="utf-8")
        final = self.dir / f"checkpoint-{step}"
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        for older in self.dir.glob("checkpoint-*"):
            if older != final:
                shutil.rmtree(older, ignore_errors=True)

    def resumed(self, ctx, step: int, saved: dict) -> None:
        announce_resume(ctx, step, saved.get("run"), str(self.dir / f"checkpoint-{step}"))


def announce_resume(ctx, step: int, run: str | None, checkpoint: str) -> None:
    """The ``resumed_from`` param and tag on the stage's run (the orchestrator's summary reads the tag)."""
    ctx.log_params({"resumed_from": checkpoint})
    ctx.set_tags({RESUMED_TAG: json.dumps({"step": step, "run": run, "checkpoint": checkpoint})})


class LoopState:
    """What a stage's own loop checkpoints: ``save()`` -> (tensors, JSON-able state), ``restore(tensors,
    state)``, and ``skip(n)`` to move the prompt batches past the ``n`` steps done."""

    def __init__(self, save: Callable[[], tuple[dict, dict]], restore: Callable[[dict, dict], None],
                 skip: Callable[[int], None]):
        self.save, self.restore, self.skip = save, restore, skip


def train_loop(ctx, name: str, config, step: Callable[[int], tuple[dict[str, float], list[dict]]],
               state: LoopState, watch) -> tuple[list[dict], int]:
    """Steps 1..``config.max_steps`` of a stage's own loop, resumed, logged, watched and checkpointed:
    (every step's record, the step it resumed from, 0 when afresh)."""
    checkpoints, history, done = LoopCheckpoints(ctx, config.save_steps), [], 0
    found = checkpoints.latest()
    if found is not None:
        done, tensors, saved = found
        state.restore(tensors, saved["stage"])
        history[:] = saved["stage"]["history"]
        watch.restore(saved["stage"]["watch"])
        state.skip(done)
        checkpoints.resumed(ctx, done, saved)
    last = config.max_steps
    with stop_requests(ctx) as request, ctx.progress(f"{name}: {last} steps", last) as bar:
        bar.advance(done)
        for number in range(done + 1, last + 1):
            metrics, rows = step(number)
            ctx.log_metrics(metrics, step=number)
            watch.report(ctx, number, metrics)
            history.append({"step": number, **metrics})
            if rows and (number in (1, last) or number % config.sample_every == 0):
                ctx.log_table(rows, f"samples/step_{number:05d}.json")
            bar.advance()
            stopping = request.due()
            if checkpoints.due(number, stopping, last=number == last):
                tensors, saved = state.save()
                checkpoints.save(number, tensors, {**saved, "history": history, "watch": watch.state()})
            if stopping:
                request.stop(number, last)
    return history, done
