"""A training stage stopped part-way and resumed ends as if it had never stopped.

For each training kind at tiny scale (sft, reward_model, dpo, kto and grpo through TRL's trainers,
grpo on an environment's episodes, ppo and online_dpo through posttrain's own loop): one run to the
end; one stopped by a real SIGINT (the stage's own Ctrl-C handling: it stops after the optimizer
step in progress and writes a checkpoint) and a second execution that resumes from it; and one
whose process group is killed with SIGKILL after a periodic checkpoint, then resumed. The resumed
stage's final weights equal the uninterrupted stage's bit for bit, every metric it reports is equal
(the mean training loss to float rounding, 1e-9 relative), and the per-step metrics of the stopped
and the resumed run together are the uninterrupted run's, each step logged once.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from conftest import torch_threads
from stages.context import StageInputs
from stages.data.sources import ArithmeticData, ArithmeticPreferenceData, materialize
from stages.rewards.spec import RewardSpec

pytestmark = pytest.mark.slow

KINDS = ["sft", "reward_model", "dpo", "kto", "grpo", "grpo_agent", "ppo", "online_dpo"]
STEPS = 10
SAVE_EVERY = 3  # periodic checkpoints at 3, 6, 9; the SIGINT lands after the one at 3
TIMING = ("train_seconds", "resumed_from_step", "step_time", "runtime", "per_second")


def stage(kind: str, home: Path, checkpoint: Path):
    """(run, config, inputs) of a tiny ``kind`` stage that logs every step and checkpoints every SAVE_EVERY."""
    every = {"max_steps": STEPS, "save_steps": SAVE_EVERY, "logging_steps": 1}
    if kind == "sft":
        from stages import sft

        data = materialize(ArithmeticData(generator="arithmetic", n=120, role="train"), Path("."), home / "data")
        config = sft.SFTStageConfig(kind="sft", data="train", batch_size=8, lr=5e-3, **every)
        return sft.run, config, StageInputs(model=checkpoint, datasets={"data": data})
    if kind == "ppo":
        from stages.ppo import train_ppo
        from stages.rl_common import rl_stage_config

        data = materialize(ArithmeticData(generator="arithmetic", n=40, role="train"), Path("."), home / "data")
        config = rl_stage_config(kind="rl", algorithm="ppo", policy="base", data="train", rewards=["short"],
                                 kl_beta=0.05, kl_target=0.5, kl_horizon=100, sampling={"attempts": 4, "max_tokens": 4},
                                 prompts_per_step=2, ppo_epochs=2, minibatch_size=4, max_steps=STEPS,
                                 save_steps=SAVE_EVERY, lr=1e-3, sample_every=4)
        rewards = {"short": RewardSpec(fn="length_penalty", kwargs={"target_chars": 0, "per_char": 0.5})}
        return train_ppo, config, StageInputs(policy=checkpoint, datasets={"train": data}, rewards=rewards)
    if kind == "online_dpo":
        from stages import online_dpo

        data = materialize(ArithmeticData(generator="arithmetic", n=40, role="train"), Path("."), home / "data")
        config = online_dpo.OnlineDPOStageConfig(
            kind="online_dpo", model="base", data="train", rewards=["short"], prompts_per_step=2,
            sampling={"attempts": 4, "max_tokens": 4}, max_steps=STEPS, save_steps=SAVE_EVERY, lr=1e-3, sample_every=4)
        rewards = {"short": RewardSpec(fn="length_penalty", kwargs={"target_chars": 0, "per_char": 0.5})}
        return online_dpo.run, config, StageInputs(model=checkpoint, datasets={"train": data}, rewards=rewards)
    if kind == "grpo_agent":  # GRPO on an environment's episodes: the episode runner's seed counter resumes too
        from stages import rl
        from stages.rl_common import rl_stage_config

        data = materialize(ArithmeticData(generator="arithmetic_calculator", n=20, role="train", ops=["*"],
                                          min_operand=10, max_operand=99), Path("."), home / "data")
        config = rl_stage_config(kind="rl", algorithm="grpo", policy="base", data="train",
                                 rewards=["correct", "environment"], prompts_per_step=2, max_steps=STEPS,
                                 save_steps=SAVE_EVERY, backend="hf", sampling={"attempts": 2, "max_tokens": 6},
                                 environment={"fn": "calculator", "max_turns": 2, "max_episode_tokens": 12})
        rewards = {"correct": RewardSpec(fn="exact_answer"), "environment": RewardSpec(fn="environment", weight=0.5)}
        return rl.run, config, StageInputs(policy=checkpoint, datasets={"data": data}, rewards=rewards)
    if kind == "grpo":
        from stages import rl
        from stages.rl_common import rl_stage_config

        data = materialize(ArithmeticData(generator="arithmetic", n=40, role="train"), Path("."), home / "data")
        config = rl_stage_config(kind="rl", algorithm="grpo", policy="base", data="train", rewards=["short"],
                                 kl_beta=0.05, sampling={"attempts": 4, "max_tokens": 3}, prompts_per_step=2,
                                 max_steps=STEPS, save_steps=SAVE_EVERY, lr=5e-3, sample_every=4)
        rewards = {"short": RewardSpec(fn="length_penalty", kwargs={"target_chars": 0, "per_char": 0.5})}
        return rl.run, config, StageInputs(policy=checkpoint, datasets={"train": data}, rewards=rewards)
    from stages import dpo, kto, reward_model

    data = materialize(ArithmeticPreferenceData(generator="arithmetic_preferences", n=80, seed=0, role="train",
                                                near_miss_rate=0.0, malformed_rate=1.0), Path("."), home / "data")
    inputs = StageInputs(model=checkpoint, datasets={"data": data})
    if kind == "reward_model":
        config = reward_model.RewardModelStageConfig(kind="reward_model", data="prefs", batch_size=8, lr=1e-2,
                                                     eval_every=4, heldout_fraction=0.2, **every)
        return reward_model.run, config, inputs
    module = {"dpo": dpo, "kto": kto}[kind]
    config_class = {"dpo": dpo.DPOStageConfig, "kto": kto.KTOStageConfig}[kind]
    return module.run, config_class(kind=kind, model="base", data="prefs", batch_size=8, lr=3e-3, **every), inputs


def context(home: Path, name: str, resume_dir: Path):
    from flows.recording.home import configure_environment
    from flows.recording.tracking import MlflowStageContext, Tracker

    configure_environment()
    tracker = Tracker(home)
    experiment = tracker.experiment_id("resume-tests", None)
    parent = tracker.start_pipeline_run(experiment, "resume-tests", {})
    run_id = tracker.start_stage_run(experiment, parent, name, {})
    return MlflowStageContext(tracker, run_id, home / "work" / run_id, seed=0, resume_dir=resume_dir)


def run_stage(kind: str, home: Path, checkpoint: Path, name: str, resume_dir: Path) -> tuple[dict, object]:
    run, config, inputs = stage(kind, home, checkpoint)
    ctx = context(home, name, resume_dir)
    with torch_threads(1):
        return run(config, inputs, ctx), ctx


def per_step(ctx) -> dict[str, dict[int, list[float]]]:
    """Every per-step metric of the run: name -> step -> the values logged at that step."""
    names = [n for n in ctx.recorded_run().data.metrics if not any(t in n for t in TIMING)]
    history: dict[str, dict[int, list[float]]] = {}
    for name in names:
        for point in ctx.metric_history(name):
            history.setdefault(name, {}).setdefault(point.step, []).append(point.value)
    return history


def weights(checkpoint: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    (path,) = Path(checkpoint).glob("*.safetensors")
    return load_file(path)


def complete(folder: Path) -> bool:
    """A checkpoint folder that is whole: a trainer writes trainer_state.json last (whole once it parses);
    posttrain's own loop (ppo, online_dpo) renames the folder into place whole, tensors.pt in it."""
    try:
        json.loads((folder / "trainer_state.json").read_text(encoding="utf-8"))
        return True
    except (OSError, ValueError):
        return (folder / "tensors.pt").is_file()


def resumed_step(resume_dir: Path) -> int:
    steps = [int(p.name.split("-")[1]) for p in resume_dir.glob("checkpoint-*") if complete(p)]
    assert steps, f"no complete checkpoint in {resume_dir}"
    return max(steps)


_UNINTERRUPTED: dict[str, tuple[dict, dict]] = {}


def uninterrupted(kind: str, home: Path, checkpoint: Path) -> tuple[dict, dict]:
    """The outputs and per-step metrics of ``kind``'s stage run to the end without a stop: run once (in the
    first test's home) for both tests of the kind, which compare against it."""
    if kind not in _UNINTERRUPTED:
        out, ctx = run_stage(kind, home, checkpoint, "whole", home / "resume-whole")
        _UNINTERRUPTED[kind] = out, per_step(ctx)
    return _UNINTERRUPTED[kind]


def assert_same_stage(whole: tuple[dict, dict], stopped_ctx, resumed: tuple[dict, object], k: int) -> None:
    (whole_out, whole_steps), (resumed_out, resumed_ctx) = whole, resumed
    assert resumed_out["metrics"]["resumed_from_step"] == k
    assert resumed_ctx.recorded_run().data.params["resumed_from"].endswith(f"checkpoint-{k}")
    a, b = weights(whole_out["checkpoint"]), weights(resumed_out["checkpoint"])
    assert a.keys() == b.keys()
    different = [name for name in a if not torch.equal(a[name], b[name])]
    assert not different, f"resumed from step {k}, these tensors differ from the uninterrupted run: {different}"
    for name, value in whole_out["metrics"].items():
        if not any(t in name for t in TIMING):
            assert resumed_out["metrics"][name] == pytest.approx(value, rel=1e-9, abs=1e-12), name

    # the stopped run logged steps 1..k, the resumed one k+1..end: together, the uninterrupted run's steps
    after = per_step(resumed_ctx)
    before = per_step(stopped_ctx) if stopped_ctx is not None else None
    for name, steps in whole_steps.items():
        if len([s for s in steps if s > 0]) < 2:  # a trainer's end-of-training summary (total_flos, ...)
            continue
        by_step = {s: v for s, v in steps.items() if 0 < s <= STEPS}  # end-of-stage summaries: at step 0
        if before is None:
            by_step = {s: v for s, v in by_step.items() if s > k}
        joined = {s: v for s, v in (before or {}).get(name, {}).items() if 0 < s <= k}
        joined |= {s: v for s, v in after.get(name, {}).items() if k < s <= STEPS}
        assert set(by_step) == set(joined), name
        for s in joined:  # the first value at each step (a trainer's end-of-training log repeats `epoch`)
            assert joined[s][0] == pytest.approx(by_step[s][0], rel=1e-6, abs=1e-9), (name, s)
        for s, values in after.get(name, {}).items():
            assert s == 0 or s > k, (name, s)  # the resumed run logs no step the stopped run had logged
            # and what the whole run logged there (a repeated log of one value at one millisecond is one row)
            assert s == 0 or len(set(values)) == len(set(steps.get(s, []))), (name, s)


@contextlib.contextmanager
def interrupt_after(resume_dir: Path, step: int):
    """Within the block, a thread sends this process SIGINT (what Ctrl-C sends) once the checkpoint of ``step`` is
    written, and nothing if it is not written within 300 s or the block ends first (the stage then ran to its end
    or failed, and the test fails on its own: a signal sent later would stop whatever this process runs next).
    The thread ends with the block."""
    done = threading.Event()

    def watch():
        deadline = time.monotonic() + 300
        while not complete(resume_dir / f"checkpoint-{step}"):
            if done.wait(0.002) or time.monotonic() > deadline:
                return
        os.kill(os.getpid(), signal.SIGINT)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=10)
        assert not thread.is_alive(), "the Ctrl-C watcher outlived its block"


@pytest.mark.parametrize("kind", KINDS)
def test_a_stage_stopped_by_ctrl_c_resumes_to_the_uninterrupted_result(kind, tiny_checkpoint, home):
    whole = uninterrupted(kind, home, tiny_checkpoint)

    resume_dir = home / "resume-stopped"
    run, config, inputs = stage(kind, home, tiny_checkpoint)
    stopped_ctx = context(home, "stopped", resume_dir)
    with torch_threads(1), pytest.raises(KeyboardInterrupt), interrupt_after(resume_dir, SAVE_EVERY):
        run(config, inputs, stopped_ctx)
    k = resumed_step(resume_dir)  # the step in progress when Ctrl-C came, after the checkpoint at SAVE_EVERY
    assert SAVE_EVERY < k < STEPS, k

    resumed = run_stage(kind, home, tiny_checkpoint, "resumed", resume_dir)
    assert_same_stage(whole, stopped_ctx, resumed, k)


KILLED = """
import sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from test_resume import run_stage
run_stage({kind!r}, Path({home!r}), Path({checkpoint!r}), "killed", Path({resume_dir!r}))
"""


@pytest.mark.parametrize("kind", KINDS)
def test_a_stage_killed_with_sigkill_resumes_from_its_periodic_checkpoint(kind, tiny_checkpoint, home):
    """kill -9 of the stage's process group: nothing is saved at the kill; the next execution resumes from
    the last periodic checkpoint and still ends with the uninterrupted stage's weights and metrics."""
    resume_dir = home / "resume-killed"
    script = KILLED.format(tests=str(Path(__file__).parent), kind=kind, home=str(home),
                           checkpoint=str(tiny_checkpoint), resume_dir=str(resume_dir))
    process = subprocess.Popen([sys.executable, "-c", script], start_new_session=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 300
        while not complete(resume_dir / f"checkpoint-{SAVE_EVERY}"):
            assert process.poll() is None, process.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "no periodic checkpoint within 300 s"
            time.sleep(0.002)
    finally:  # killed here whether or not the checkpoint came: the stage never outlives the test
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
    assert process.returncode == -signal.SIGKILL

    resumed = run_stage(kind, home, tiny_checkpoint, "resumed", resume_dir)
    # the newest checkpoint written whole (the kill may cut the next one short: it is passed over)
    k = int(resumed[0]["metrics"]["resumed_from_step"])
    assert 0 < k < STEPS and k % SAVE_EVERY == 0, k
    whole = uninterrupted(kind, home, tiny_checkpoint)
    # the killed run's last metrics may have died in its send buffer: only the resumed run's steps are compared
    assert_same_stage(whole, None, resumed, k)


def test_a_checkpoint_cut_short_is_passed_over_for_the_one_before(tmp_path):
    """kill -9 while the trainer writes trainer_state.json (last) leaves it empty or partial: the checkpoint
    before it, which the trainer deletes only after the new one is whole, is the one resumed."""
    from stages.training.resume import last_checkpoint

    for step, state in ((3, '{"global_step": 3}'), (6, '{"global_st'), (9, None)):
        (tmp_path / f"checkpoint-{step}").mkdir()
        if state is not None:
            (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text(state)
    assert last_checkpoint(tmp_path) == str(tmp_path / "checkpoint-3")
    (tmp_path / "checkpoint-3" / "trainer_state.json").write_text("")
    assert last_checkpoint(tmp_path) is None
