"""What every Hugging Face-style trainer in a stage reports: metrics under our names, one progress bar."""

from __future__ import annotations

from typing import Callable


class StepMetrics:
    """Metrics measured inside a trainer's step, logged (each one's mean) with the trainer's own at its next log."""

    def __init__(self):
        self._values: dict[str, list[float]] = {}

    def add(self, name: str, value: float) -> None:
        self._values.setdefault(name, []).append(float(value))

    def update(self, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self.add(name, value)

    def drain(self) -> dict[str, float]:
        """The mean of every metric added since the last drain (and forget them)."""
        values, self._values = self._values, {}
        return {name: sum(v) / len(v) for name, v in values.items() if v}


def tracking_callback(ctx, rename: Callable[[dict], dict[str, float]], description: str, on_metrics=None,
                      step_metrics: StepMetrics | None = None):
    """Logs a trainer's logs (``rename``d) and ``step_metrics`` to the stage's run; drives its progress line."""
    from transformers import TrainerCallback

    class TrackingCallback(TrainerCallback):
        def __init__(self):
            self._bar = None
            self._progress = None

        def on_train_begin(self, args, state, control, **kwargs):
            self._progress = ctx.progress(description, state.max_steps)
            self._bar = self._progress.__enter__()
            if state.global_step:  # resumed from a checkpoint
                self._bar.advance(state.global_step)

        def on_step_end(self, args, state, control, **kwargs):
            if self._bar is not None:
                self._bar.advance(1)

        def on_train_end(self, args, state, control, **kwargs):
            if self._progress is not None:
                self._progress.__exit__(None, None, None)
                self._progress = self._bar = None

        def on_log(self, args, state, control, logs=None, **kwargs):
            metrics = rename(logs or {})
            if step_metrics is not None and metrics:
                metrics.update(step_metrics.drain())
            if metrics:
                ctx.log_metrics(metrics, step=state.global_step)
            if on_metrics is not None:
                on_metrics(state, metrics)

    return TrackingCallback()


def metric_renamer(names: dict[str, str]) -> Callable[[dict], dict[str, float]]:
    """A ``rename`` for ``tracking_callback``: the trainer's numeric logs named in ``names``, under our names."""

    def rename(logs: dict) -> dict[str, float]:
        return {names[k]: float(v) for k, v in logs.items() if k in names and isinstance(v, (int, float))}

    return rename


def pooling_pair_metrics(trainer_class, keys: tuple[str, ...]):
    """``trainer_class`` (a TRL pairwise trainer) whose logged per-pair means ``keys`` are pooled over every
    pair since the last log, where TRL averages batch means (a short last batch weighing as much as a full one)."""

    class PooledPairMetrics(trainer_class):
        def compute_loss(self, model, inputs, *args, **kwargs):
            mode = "train" if self.model.training else "eval"
            before = {key: len(self._metrics[mode].get(key, ())) for key in keys}
            result = super().compute_loss(model, inputs, *args, **kwargs)
            pairs = inputs["input_ids"].shape[0] // 2
            weights = self.__dict__.setdefault("_pair_weights", {"train": {}, "eval": {}})[mode]
            for key in keys:
                if len(self._metrics[mode].get(key, ())) == before[key] + 1:
                    weights.setdefault(key, []).append(pairs)
            return result

        def log(self, logs: dict[str, float], *args, **kwargs) -> None:
            mode = "train" if self.model.training else "eval"
            weights = self.__dict__.get("_pair_weights", {}).get(mode, {})
            for key in keys:
                values, counts = self._metrics[mode].get(key), weights.pop(key, [])
                if values and len(counts) == len(values):
                    self._metrics[mode][key] = [sum(v * n for v, n in zip(values, counts)) / sum(counts)]
            super().log(logs, *args, **kwargs)

    PooledPairMetrics.__name__ = f"Pooled{trainer_class.__name__}"
    return PooledPairMetrics


def schedule_arguments(config) -> dict:
    """Trainer arguments the reward-model and preference configs share; ``batch_size`` global, split over processes."""
    from stages.training.data_parallel import world_size

    world = world_size()
    return {
        "max_steps": config.max_steps,
        "per_device_train_batch_size": config.batch_size // world,
        "per_device_eval_batch_size": max(max(config.batch_size, 64) // world, 1),
        "learning_rate": config.lr,
        "lr_scheduler_type": config.lr_schedule,
        "warmup_steps": config.warmup_ratio,  # a float in [0, 1) is a ratio of total steps
        "weight_decay": config.weight_decay,
        "max_length": config.max_length,
    }


def device_arguments() -> dict:
    """fp32 on a CPU (TRL's bf16 default refuses to start there), bf16 on a GPU that has it."""
    import torch

    cuda = torch.cuda.is_available()
    return {"use_cpu": not cuda, "bf16": cuda and torch.cuda.is_bf16_supported()}


def quiet_trainer(trainer) -> None:
    """Drop the trainer's console printer and tqdm bar (our callback shows progress)."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
