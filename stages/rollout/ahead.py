"""GRPO's rollouts from a generation server, drawn up to ``max_staleness`` optimizer steps ahead of training.

``ServedRollouts`` is the TRL ``rollout_func`` of an rl stage with ``generation: {mode: server}``
(stages/rollout/server.py). After every optimizer step it pushes the policy's weights to the server as a new
version (version k: the weights after k updates). With ``max_staleness: 0`` each step's rollouts are drawn
when TRL asks for them, by the weights being trained: synchronous, on-policy up to the server's numerics.

With ``max_staleness: S > 0`` a producer thread draws the next steps' rollouts while the trainer trains.
Which prompts those are is known in advance: TRL's ``RepeatSampler`` is a pure function of its seed, so a
second copy of it (``planned_batches``) yields the batches the trainer's dataloader will yield, in order;
the rollouts TRL asks for are checked against the plan prompt for prompt, and a batch the plan got wrong is
drawn again on the spot (counted, ``ahead/mispredicted``). The batch of generation call ``c``, trained at
step ``c * updates_per_batch``, is drawn by exactly version ``max(first, c * updates_per_batch - S)``, so a
rerun draws the same samples whatever the timing (vLLM seeds each request): at most S steps stale, and with
S = 1 generation of step k+1's rollouts overlaps training on step k's. The staleness bound is checked again
when the batch is used; a batch past it would be dropped, counted (``ahead/dropped_samples``) and drawn
again by the current weights, which the pinned versions above never need.

A resumed stage draws as the stage never stopped would. With LoRA, each checkpoint at step k keeps the adapters
of versions k - S .. k - 1 (``save_versions``: the server's own copies, under ``served-versions/``), and the
resumed execution serves them again before its first batch (``restore_versions``), so its batches are drawn by
the same versions as the uninterrupted stage's, from its first one. Full weights are one file of the model's
size per version and the server holds one at a time: a resumed stage in full fine-tuning draws its first batch
by the checkpoint's weights and the S batches after it by versions no older than those (fresher than the
uninterrupted stage's).

Logged every step: ``ahead/staleness_mean`` and ``ahead/staleness_max`` (optimizer steps between the
weights that drew a sample and the weights it trains), ``ahead/dropped_samples``, ``ahead/sync_seconds``
(pushing the weights to the server) and ``ahead/wait_seconds`` (the trainer waiting for rollouts). The
sampler is not the trainer (another process, its own numerics, older weights): the stage's ``correction``
weighs each token by pi_trainer / pi_sampler (stages/grpo.py ``sampler_corrected``), on by default.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from stages.rollout.generation import draw_offset
from stages.rollout.server import ServerBackend


def planned_batches(trainer):
    """The prompts of each generation batch the trainer's dataloader will yield, in order, from a copy of
    TRL's sampler (same seed, same permutations): one per ``updates_per_batch`` steps, epoch after epoch."""
    sampler = trainer._get_train_sampler(trainer.train_dataset)
    size = trainer._train_batch_size * trainer.args.steps_per_generation
    prompts = trainer.train_dataset["prompt"]
    while True:
        indices = list(iter(sampler))
        batches = [indices[i:i + size] for i in range(0, len(indices), size)]
        for batch in batches[::trainer.num_iterations * trainer.args.steps_per_generation]:
            yield [prompts[i] for i in batch]


class ServedRollouts:
    """TRL ``rollout_func`` over a generation server; ``inner`` (stages/rollout/training.py GRPORollouts or
    EpisodeRollouts) draws a batch from a given backend, and reads what a used batch measured."""

    def __init__(self, inner, open_backend, max_staleness: int, folder: Path, step_metrics=None):
        self.inner, self.open_backend, self.max_staleness = inner, open_backend, max_staleness
        self.folder, self.step_metrics = Path(folder), step_metrics
        self.backend: ServerBackend | None = None
        self.calls = 0  # generation calls so far: seeds each call's draws, and names its planned batch
        self.syncs = 0
        self.dropped = 0
        self.mispredicted = 0
        self._first: tuple[int, int] | None = None  # (call, step) of this execution's first call
        self._restored: dict[int, Path] = {}  # versions a resumed execution serves again, and their adapters
        self._ready: dict[int, tuple[list, dict, int]] = {}
        self._drawn_through = -1  # the producer's last finished call
        self._changed = threading.Condition()
        self._producer: threading.Thread | None = None
        self._failure: BaseException | None = None
        self._closing = False
        self._updates, self._last_call = 1, 0  # optimizer steps per generation call, the stage's last call
        self._floor = 0  # the oldest version this execution serves (``_oldest_served``)
        self.startup_seconds = 0.0  # the server's, once started

    # -- the trainer's side -------------------------------------------------------------------------------
    def open(self) -> ServerBackend:
        if self.backend is None:
            self.backend = self.open_backend()
            self.startup_seconds = self.backend.server.startup_seconds
            if self.backend.lora:
                for version, adapter in sorted(self._restored.items()):
                    self.backend.serve_adapter(version, adapter, self.folder)
            self._restored = {}
        return self.backend

    def save_versions(self, checkpoint: Path, step: int) -> None:
        """Keep in checkpoint ``step``'s folder the adapters of the versions its next batches are drawn by."""
        if self.backend is None or not self.backend.lora or self.max_staleness == 0:
            return
        import shutil

        for version in range(max(1, step - self.max_staleness), step):  # version 0: the base model, always served
            source = self.folder / f"v{version}"
            if source.is_dir():
                shutil.copytree(source, Path(checkpoint) / "served-versions" / f"v{version}", dirs_exist_ok=True)

    def restore_versions(self, checkpoint: Path) -> None:
        """The adapters ``save_versions`` kept in ``checkpoint``: served again once the server is up."""
        saved = Path(checkpoint) / "served-versions"
        self._restored = {int(p.name[1:]): p for p in saved.glob("v*") if p.name[1:].isdigit()} \
            if saved.is_dir() else {}

    def close(self) -> None:
        with self._changed:
            self._closing = True
            self._changed.notify_all()
        if self._producer is not None:
            self._producer.join(timeout=60)
        if self.backend is not None:
            self.backend.close()
            self.backend.server.close()
            self.backend = None

    def sync(self, trainer) -> None:
        """Serve the weights ``trainer`` holds now (version: its optimizer steps), if not served yet. In full
        fine-tuning the server holds one version, so the push first waits for every planned batch that
        must be drawn by an older one."""
        backend = self.open()
        version = trainer.state.global_step
        if backend.weights_version >= version:
            return
        started = time.perf_counter()
        if not backend.lora and self._producer is not None:
            self._wait(lambda: self._drawn_through >= self._last_call_before(version))
        backend.push(trainer.model, version, self.folder, keep=self.max_staleness + 1)
        self.syncs += 1
        self._measure("ahead/sync_seconds", time.perf_counter() - started)
        with self._changed:
            self._changed.notify_all()

    def __call__(self, prompts: list, trainer) -> dict:
        self.sync(trainer)
        step, call = trainer.state.global_step, self.calls
        self.calls += 1
        started = time.perf_counter()
        if self._first is None:  # this execution's first batch: nothing was drawn ahead of it
            self._first = (call, step)
            self._floor = self._oldest_served(step)
            if self.max_staleness > 0 and trainer.model.training:
                self._start(trainer, call + 1)
                out, version = self._draw_now(prompts, call, self.version_for(call, self._updates))
            else:
                out, version = self._draw_now(prompts, call)
        elif self.max_staleness == 0 or not trainer.model.training:
            out, version = self._draw_now(prompts, call)
        else:
            planned, out, version = self._take(call)
            if planned != list(prompts):  # the plan is a copy of TRL's sampler: a mismatch is drawn again
                self.mispredicted += 1
                out, version = self._draw_now(prompts, call)
            elif step - version > self.max_staleness:
                self.dropped += len(out["completion_ids"])
                out, version = self._draw_now(prompts, call)
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
        backend = self.open()
        version = backend.weights_version if version is None else version
        return self.inner.draw(prompts, backend.at(version), draw_offset(call)), version

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
                if self.backend is not None:
                    self.backend.server.check()
                self._changed.wait(timeout=1.0)

    # -- the producer's side ------------------------------------------------------------------------------
    def version_for(self, call: int, updates_per_batch: int) -> int:
        """The weights version that draws generation call ``call``'s batch: ``max_staleness`` updates before the
        step that trains on it, but none older than this execution can serve."""
        first_call, first_step = self._first
        return max(self._floor, (call - first_call) * updates_per_batch + first_step - self.max_staleness)

    def _oldest_served(self, step: int) -> int:
        """The oldest version this execution serves from its first step on: ``step`` (its own weights), or
        with the versions before it served again (a resumed stage, LoRA), ``step - max_staleness``."""
        oldest = step
        while oldest > max(0, step - self.max_staleness) and oldest - 1 in self.backend.served:
            oldest -= 1
        return oldest

    def _last_call_before(self, version: int) -> int:
        """The last call whose batch is drawn by a version older than ``version``."""
        call = self._drawn_through + 1
        while self.version_for(call, self._updates) < version:
            call += 1
        return min(call - 1, self._last_call)  # none is drawn past the stage's last step

    def _start(self, trainer, from_call: int) -> None:
        self._updates = trainer.num_iterations * trainer.args.steps_per_generation
        first_call, first_step = self._first
        # the last call the stage will make: none is drawn for steps past max_steps
        self._last_call = first_call + -(-(trainer.state.max_steps - first_step) // self._updates) - 1
        self._drawn_through = from_call - 1
        plan = planned_batches(trainer)
        for _ in range(from_call):  # the batches this execution already had (a resumed stage)
            next(plan)
        self._producer = threading.Thread(target=self._produce, args=(self.inner.for_thread(), plan, from_call),
                                          name="rollouts-ahead",
                                          daemon=True)
        self._producer.start()

    def _produce(self, inner, plan, call: int) -> None:
        try:
            for prompts in plan:
                if call > self._last_call:
                    return
                version = self.version_for(call, self._updates)
                with self._changed:
                    while self.backend.weights_version < version and not self._closing:
                        self._changed.wait(timeout=1.0)
                    if self._closing:
                        return
                out = inner.draw(prompts, self.backend.at(version), draw_offset(call))
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
