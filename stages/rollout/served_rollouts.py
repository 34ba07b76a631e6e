"""GRPO's rollouts from a generation server (its TRL ``rollout_func``): a producer thread draws the next steps'
batches while the trainer trains, each by the weights of up to ``max_staleness`` optimizer steps before the step
that trains on it; synchronous at ``max_staleness: 0``. Design: docs/algorithms.md."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from stages.engines.server_client import ServerEngine

DRAWN_FILE = "drawn-ahead.pkl"  # in a checkpoint: the batches drawn by versions older than it


class ServedRollouts:
    """TRL ``rollout_func`` over a generation server: ``inner`` (a ``PolicyRollouts``) draws each batch, its
    policy sampler holding the server's engine (opened by ``inner``'s opener on first use); drawn ahead, the
    prompts ``ordered`` gives each generation call (stages/data/prompt_order.py ``GenerationPrompts``)."""

    def __init__(self, inner, ordered, max_staleness: int, step_metrics=None):
        self.inner, self.sampler, self.max_staleness = inner, inner.sampler, max_staleness
        self.ordered = ordered
        self.step_metrics = step_metrics
        self.calls = 0  # seeds each call's draws, and names its planned batch
        self.dropped = 0
        self.mispredicted = 0
        self._first: tuple[int, int] | None = None  # (call, step) of this execution's first call
        self._ready: dict[int, tuple[list, dict, int]] = {}  # call -> (its planned prompts, the batch, version)
        self._kept_through = -1  # the last call whose batch a checkpoint kept (a resumed execution)
        self._drawn_through = -1  # the producer's last finished call
        self._changed = threading.Condition()
        self._producer: threading.Thread | None = None
        self._failure: BaseException | None = None
        self._closing = False
        self._updates, self._last_call = 1, 0  # optimizer steps per generation call, the stage's last call
        self.startup_seconds = 0.0

    @property
    def engine(self) -> ServerEngine | None:
        return self.sampler.engine

    def opened_engine(self) -> ServerEngine:
        """The server's engine, started on first use."""
        if self.engine is None:
            self.startup_seconds = self.sampler.opened().server.startup_seconds
        return self.engine

    def save_drawn(self, checkpoint: Path, step: int) -> None:
        """Keep in checkpoint ``step``'s folder the batches planned for versions older than ``step``, which a
        resumed execution could not draw again."""
        if self._producer is None:
            return  # synchronous: every batch is drawn by the weights of the step that trains on it
        import pickle

        self._wait(lambda: self._drawn_through >= self._last_call_before(step))
        with self._changed:
            kept = {call: batch for call, batch in self._ready.items() if batch[2] < step}
        temporary = Path(checkpoint) / (DRAWN_FILE + ".tmp")
        temporary.write_bytes(pickle.dumps(kept))
        temporary.replace(Path(checkpoint) / DRAWN_FILE)

    def restore_drawn(self, checkpoint: Path) -> None:
        """The batches ``save_drawn`` kept in ``checkpoint``: trained on before anything is drawn."""
        import pickle

        saved = Path(checkpoint) / DRAWN_FILE
        self._ready = pickle.loads(saved.read_bytes()) if saved.is_file() else {}
        self._kept_through = max(self._ready, default=-1)

    def close(self) -> None:
        with self._changed:
            self._closing = True
            self._changed.notify_all()
        if self._producer is not None:
            self._producer.join(timeout=60)
        self.sampler.close()  # the engine and its server

    def sync(self, trainer) -> None:
        """Serve the weights ``trainer`` holds now (version: its optimizer steps), if not served yet; in full
        fine-tuning (one version served) after every batch planned for an older version is drawn."""
        engine = self.opened_engine()
        version = trainer.state.global_step
        if self.sampler.holds(version):
            return
        started = time.perf_counter()
        if not engine.lora and self._producer is not None:
            self._wait(lambda: self._drawn_through >= self._last_call_before(version))
        self.sampler.take(trainer.model, version)  # versions older than the last max_staleness + 1 unserved
        self._measure("ahead/sync_seconds", time.perf_counter() - started)
        with self._changed:
            self._changed.notify_all()

    def __call__(self, prompts: list, trainer) -> dict:
        self.sync(trainer)
        step, call = trainer.state.global_step, self.calls
        self.calls += 1
        started = time.perf_counter()
        ahead = self.max_staleness > 0 and trainer.model.training
        first = self._first is None
        if first:  # this execution's first batch: drawn ahead only where a checkpoint kept it
            self._first = (call, step)
            self._updates = trainer.num_iterations * trainer.args.steps_per_generation
        if not ahead:
            out, version = self._draw_now(prompts, call)
        elif first and call not in self._ready:
            out, version = self._draw_now(prompts, call, self.version_for(call, self._updates))
        else:  # drawn ahead, or (this execution's first) kept by the checkpoint it resumes from
            planned, out, version = self._take(call)
            if planned != list(prompts):  # TRL no longer taking its rows in order: drawn again, counted
                self.mispredicted += 1
                out, version = self._draw_now(prompts, call)
            elif step - version > self.max_staleness:
                self.dropped += len(out["completion_ids"])
                out, version = self._draw_now(prompts, call)
        if first and ahead:  # after the first batch: the producer's first batch would only queue behind it
            self._start(trainer, call + 1)
        staleness = step - version
        self._measure("ahead/wait_seconds", time.perf_counter() - started)
        self._measure("ahead/staleness_mean", float(staleness))
        self._measure("ahead/staleness_max", float(staleness))
        self._measure("ahead/dropped_samples", float(self.dropped))
        if self.max_staleness > 0:
            self._measure("ahead/mispredicted", float(self.mispredicted))
        self.inner.consumed(out, trainer)
        return out

    def _draw_now(self, prompts, call: int, version: int | None = None) -> tuple[dict, int]:
        """Call ``call``'s batch drawn now, by weights ``version`` (default: the newest served)."""
        engine = self.opened_engine()
        version = engine.weights_version if version is None else version
        return self.inner.draw(prompts, engine.at(version), call), version

    def _measure(self, name: str, value: float) -> None:
        if self.step_metrics is not None:
            self.step_metrics.add(name, value)

    def _take(self, call: int) -> tuple[list, dict, int]:
        self._wait(lambda: call in self._ready)
        with self._changed:
            return self._ready.pop(call)

    def _wait(self, done) -> None:
        with self._changed:
            while not done():
                if self._failure is not None:
                    raise RuntimeError(f"drawing rollouts ahead failed: {self._failure}") from self._failure
                if self.engine is not None:
                    self.engine.server.check()
                self._changed.wait(timeout=1.0)

    def version_for(self, call: int, updates_per_batch: int) -> int:
        """The weights version that draws call ``call``'s batch: ``max_staleness`` updates before the step that
        trains on it, none older than this execution's first step (a checkpoint kept those)."""
        first_call, first_step = self._first
        return max(first_step, (call - first_call) * updates_per_batch + first_step - self.max_staleness)

    def _last_call_before(self, version: int) -> int:
        """The last call whose batch is drawn by a version older than ``version``."""
        call = self._drawn_through + 1
        while self.version_for(call, self._updates) < version:
            call += 1
        return min(call - 1, self._last_call)

    def _start(self, trainer, from_call: int) -> None:
        first_call, first_step = self._first
        # the last call the stage will make: none is drawn for steps past max_steps
        self._last_call = first_call + -(-(trainer.state.max_steps - first_step) // self._updates) - 1
        from_call = max(from_call, self._kept_through + 1)  # a checkpoint's kept batches are drawn already
        self._drawn_through = from_call - 1
        self._producer = threading.Thread(target=self._produce, args=(self.inner.for_thread(), from_call),
                                          name="rollouts-ahead",
                                          daemon=True)
        self._producer.start()

    def _produce(self, inner, call: int) -> None:
        try:
            while call <= self._last_call:
                prompts = self.ordered.of_call(call)
                version = self.version_for(call, self._updates)
                with self._changed:
                    while self.engine.weights_version < version and not self._closing:
                        self._changed.wait(timeout=1.0)
                    if self._closing:
                        return
                out = inner.draw(prompts, self.engine.at(version), call)
                with self._changed:
                    self._ready[call] = (prompts, out, version)
                    self._drawn_through = call
                    self._changed.notify_all()
                call += 1
        except BaseException as error:  # the trainer raises it when it next waits
            with self._changed:
                if not self._closing:
                    self._failure = error
                self._changed.notify_all()
