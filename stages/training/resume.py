"""A trainer-backed stage that stops (Ctrl-C, kill -9, its time limit) continues where it stopped.

Every ``save_steps`` optimizer steps, and when it is stopped gracefully, a stage writes a
checkpoint of everything its next step depends on into the stage's resume dir (kept until
the stage is published; keyed by fingerprint, so the next execution of the same stage finds
it): the trainer's own (weights, optimizer and scheduler state, the RNG states, the step
counter and the data position it implies) and the stage's (``stage_state.json``: the run that wrote it, what
posttrain's code keeps across steps, such as GRPO's curves and its rollout seed counter, and
the sum of the losses so far). The next execution resumes from the newest complete one, says so
(the ``resumed_from`` param, the ``posttrain.resumed_from`` tag naming the step and the run that
stopped, ``resumed_from_step``, and a line under the run's summary), and ends with the same weights
and metrics as an execution never stopped (tests/test_resume.py).

A checkpoint is complete once the trainer's ``trainer_state.json`` is written, which it
writes last; the stage's state is written into the checkpoint's folder before the trainer
writes its own files, so a complete checkpoint always has it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

from pydantic import Field

from stages.context import RESUMED_TAG
from stages.spec_model import SpecModel

STATE_FILE = "stage_state.json"
# what TRL's trainers count across steps outside the trainer state a checkpoint holds (TRL 1.16: the tokens
# trained on, logged as ``num_tokens``, restart from 0 on a resumed run otherwise)
TRL_COUNTERS = ("_total_train_tokens",)


class Resumable(SpecModel):
    """The field of every trainer-backed stage kind that says how often it writes a resumable checkpoint."""

    save_steps: int | None = Field(
        50, ge=1,
        description="Write a resumable trainer checkpoint every N steps (kept only until the stage finishes); "
        "an interrupted or killed run resumes from the latest. Null: only on Ctrl-C.",
    )


def resumable_arguments(resume_dir: Path, save_steps: int | None) -> dict:
    """Trainer arguments that write resumable checkpoints (model, optimizer, scheduler, RNG
    states; only the latest kept) into the stage's resume dir every ``save_steps`` steps."""
    return {
        "output_dir": str(resume_dir),
        "save_strategy": "steps" if save_steps else "no",
        "save_steps": save_steps or 500,
        "save_total_limit": 1,
    }


def last_checkpoint(resume_dir: Path) -> str | None:
    """The newest complete trainer checkpoint an earlier, interrupted execution left, if any."""
    from transformers.trainer_utils import get_last_checkpoint

    if not resume_dir.is_dir():
        return None
    found = get_last_checkpoint(str(resume_dir))
    # a checkpoint whose writing was cut short has no trainer_state.json (written last): skip it
    if found and not (Path(found) / "trainer_state.json").is_file():
        return None
    return found


class StageState:
    """What posttrain's code keeps across a trainer's steps: ``save()`` gives it as JSON-able values,
    ``restore(saved)`` puts it back on resume. The default keeps nothing of the stage's own.
    ``every``: checkpoints only at multiples of this step (GRPO reusing one batch of rollouts for several
    updates: the batch is not in a checkpoint, so one is written only where a fresh batch is due)."""

    def __init__(self, save: Callable[[], dict[str, Any]] = dict, restore: Callable[[dict], None] = lambda saved: None,
                 every: int = 1):
        self.save, self.restore, self.every = save, restore, every


def train_resumably(trainer, ctx, state: StageState | None = None) -> tuple[Any, int]:
    """``trainer.train()``, resumed from the newest checkpoint in ``ctx.resume_dir`` if an earlier execution
    left one, stopping gracefully with a checkpoint on Ctrl-C and at the time limit
    (stages/training/callbacks.py ``stop_gracefully``). Returns the train output, with ``training_loss``
    the mean over every step since the stage began (not only those of this execution), and the step it
    resumed from (0: from the start). The trainer's ``output_dir`` must be ``ctx.resume_dir``
    (``resumable_arguments``)."""
    from stages.training.callbacks import stop_gracefully

    state = state or StageState()
    resume_from = last_checkpoint(ctx.resume_dir)
    saved = _read_state(resume_from) if resume_from else {}
    if resume_from:
        state.restore(saved.get("stage", {}))
        for name, value in saved.get("counters", {}).items():
            setattr(trainer, name, value)
        ctx.log_params({"resumed_from": resume_from})
        ctx.set_tags({RESUMED_TAG: json.dumps({"step": saved["step"], "run": saved.get("run"),
                                               "checkpoint": resume_from})})
    with stop_gracefully(trainer, ctx):
        trainer.add_callback(_state_writer(trainer, state, saved.get("loss_sum", 0.0), getattr(ctx, "run_id", None)))
        result = trainer.train(resume_from_checkpoint=resume_from)
    resumed_step = int(resume_from.rsplit("-", 1)[-1]) if resume_from else 0
    steps = trainer.state.global_step
    if resumed_step and steps:  # the losses before the stop were summed into the checkpoint
        this_run = result.training_loss * (steps - resumed_step)
        result = result._replace(training_loss=(saved.get("loss_sum", 0.0) + this_run) / steps)
    return result, resumed_step


def _read_state(checkpoint: str) -> dict:
    path = Path(checkpoint) / STATE_FILE
    if not path.is_file():
        raise RuntimeError(f"the resumable checkpoint {checkpoint} has no {STATE_FILE}: it was written by an older "
                           f"posttrain; delete {Path(checkpoint).parent} to start the stage over")
    return json.loads(path.read_text(encoding="utf-8"))


def _state_writer(trainer, state: StageState, loss_sum_before: float, run_id: str | None):
    """A callback that writes the stage's state into each checkpoint's folder as the trainer decides to save
    it (before the trainer's own files, so a checkpoint with ``trainer_state.json`` has it), and keeps the
    final step from writing one: a finished stage is published, not resumed. (Under data parallelism the
    loss sum is the writing process's: the trainer averages its logged losses over processes.)"""
    from transformers import TrainerCallback

    class StateWriter(TrainerCallback):
        def on_step_end(self, args, train_state, control, **kwargs):
            if train_state.global_step >= train_state.max_steps or train_state.global_step % state.every:
                control.should_save = False  # finished (published, not resumed), or between two fresh batches
            if not (control.should_save and args.should_save):  # one process writes the checkpoint
                return control
            folder = Path(args.output_dir) / f"checkpoint-{train_state.global_step}"
            folder.mkdir(parents=True, exist_ok=True)
            # the loss sum since the stage began: the trainer's own sums only cover this execution's steps
            # (``_tr_loss`` holds the steps since the last log, already including this one)
            loss_sum = loss_sum_before + trainer._total_loss_scalar + float(trainer._tr_loss)
            saved = {"step": train_state.global_step, "run": run_id, "loss_sum": loss_sum, "stage": state.save(),
                     "counters": {name: getattr(trainer, name) for name in TRL_COUNTERS if hasattr(trainer, name)}}
            temporary = folder / (STATE_FILE + ".tmp")
            temporary.write_text(json.dumps(saved), encoding="utf-8")
            os.replace(temporary, folder / STATE_FILE)
            return control

    return StateWriter()
