"""What every Hugging Face-style trainer in a stage reports: metrics to the run, a progress bar.

The trainers' own console printing (a dict per logging step) is replaced by a single
progress bar; every logged value goes to the stage's MLflow run under our metric names.
"""

from __future__ import annotations

from typing import Callable


def tracking_callback(ctx, rename: Callable[[dict], dict[str, float]], description: str, on_metrics=None):
    from transformers import TrainerCallback

    class TrackingCallback(TrainerCallback):
        def __init__(self):
            self._bar = None
            self._progress = None

        def on_train_begin(self, args, state, control, **kwargs):
            self._progress = ctx.progress(description, state.max_steps)
            self._bar = self._progress.__enter__()

        def on_step_end(self, args, state, control, **kwargs):
            if self._bar is not None:
                self._bar.advance(1)

        def on_train_end(self, args, state, control, **kwargs):
            if self._progress is not None:
                self._progress.__exit__(None, None, None)
                self._progress = self._bar = None

        def on_log(self, args, state, control, logs=None, **kwargs):
            metrics = rename(logs or {})
            if metrics:
                ctx.log_metrics(metrics, step=state.global_step)
            if on_metrics is not None:
                on_metrics(state, metrics)

    return TrackingCallback()


def device_arguments() -> dict:
    """Trainer arguments for the machine at hand: the CPU with fp32 when there is no GPU
    (TRL's configs default to bf16, which refuses to start on a CPU), bf16 on a GPU that has it."""
    import torch

    cuda = torch.cuda.is_available()
    return {"use_cpu": not cuda, "bf16": cuda and torch.cuda.is_bf16_supported()}


def quiet_trainer(trainer) -> None:
    """Drop the trainer's console printer and tqdm bar (our callback shows progress)."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
