"""Security, proven: what a pipeline file, a checkpoint or model-written code can and cannot make run.

Each refusal is shown beside its control: the same payload *does* act when the guard is
off (the unsafe YAML loader, the trusted checkpoint, the opt-out sandbox), so every test
can fail. Containment of the bubblewrap sandbox itself (secrets, network, writes, time,
memory, processes) is proven in tests/test_sandbox.py and not repeated here.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from conftest import run_cli
from test_bad_input import GRPO, TINY_MODEL, VALID, assert_nothing_left, make_checkpoint
from test_sandbox import processes_with_marker
from stages.context import StageInputs

# ---------------------------------------------------------------- YAML is loaded safely


def test_python_yaml_tags_are_refused_and_nothing_executes(tmp_path, home, capsys):
    marker, control = tmp_path / "yaml-payload-ran", tmp_path / "control-payload-ran"
    payload = f'!!python/object/apply:os.system ["touch {marker}"]'
    # The payload is real: an unsafe loader does run it.
    yaml.unsafe_load(payload.replace(str(marker), str(control)))
    assert control.exists()

    pipeline = tmp_path / "p.yaml"
    pipeline.write_text(VALID.replace("seed: 3", f"seed: {payload}"))
    assert run_cli("run", str(pipeline)) == 2
    err = capsys.readouterr().err
    assert "p.yaml:2: YAML tag refused (pipelines are read with the safe loader" in err
    assert "python/object/apply:os.system" in err and "nothing was run" in err
    assert not marker.exists()

    # the same payload through --set is refused too
    pipeline.write_text(VALID)
    assert run_cli("run", str(pipeline), "--set", f"seed={payload}") == 2
    assert "--set seed: value" in capsys.readouterr().err
    assert not marker.exists()
    assert_nothing_left(home)


# ---------------------------------------------------------------- user code only from named dotted paths

SIDE_EFFECT = """\
from pathlib import Path
Path({marker!r}).open("a").write("imported\\n")

def score(completions, **columns):
    return [1.0] * len(completions)
"""


@pytest.mark.parametrize("fn", ["{dir}/evil_reward.py", "evil_reward.py", "./evil_reward.py",
                                "__import__('evil_reward')", "evil_reward; import os", ".evil_reward:score"])
def test_reward_code_is_never_imported_from_a_file_path_or_odd_syntax(fn, tmp_path, home, capsys, monkeypatch):
    marker = tmp_path / "evil-imported"
    (tmp_path / "evil_reward.py").write_text(SIDE_EFFECT.format(marker=str(marker)))
    monkeypatch.syspath_prepend(str(tmp_path))  # even importable as a module, a file path is refused
    pipeline = tmp_path / "p.yaml"
    pipeline.write_text(VALID.replace("fn: exact_answer", f"fn: {json.dumps(fn.format(dir=tmp_path))}"))
    assert run_cli("run", str(pipeline)) == 2
    err = capsys.readouterr().err
    assert "p.yaml:8: rewards.correct.fn:" in err and "is not a dotted path" in err
    assert not marker.exists() and "evil_reward" not in sys.modules
    assert_nothing_left(home)


def test_a_module_is_imported_only_when_the_pipeline_names_it(tmp_path, home, capsys, monkeypatch):
    marker = tmp_path / "side-effect-ran"
    (tmp_path / "sidefx_rewards.py").write_text(SIDE_EFFECT.format(marker=str(marker)))
    monkeypatch.syspath_prepend(str(tmp_path))  # importable, and beside the pipeline file
    monkeypatch.delitem(sys.modules, "sidefx_rewards", raising=False)
    from stages.rewards.registry import load_reward_fn

    load_reward_fn.cache_clear()  # so "imported" below means imported by this validation

    unnamed = tmp_path / "unnamed.yaml"
    unnamed.write_text(VALID)
    assert run_cli("validate", str(unnamed)) == 0
    assert not marker.exists() and "sidefx_rewards" not in sys.modules

    named = tmp_path / "named.yaml"
    named.write_text(VALID.replace("fn: exact_answer", "fn: sidefx_rewards:score"))
    assert run_cli("validate", str(named)) == 0, capsys.readouterr().err
    assert marker.read_text() == "imported\n"
    monkeypatch.delitem(sys.modules, "sidefx_rewards")


# ---------------------------------------------------------------- trust_remote_code is off by default


@pytest.fixture()
def custom_checkpoint(tiny_checkpoint, tmp_path) -> Path:
    """A checkpoint whose config.json auto_map points at its own module, which leaves a marker when run."""
    return make_checkpoint("custom_code", tiny_checkpoint, tmp_path / "m")


def test_checkpoint_code_is_refused_without_trust_remote_code(custom_checkpoint, tmp_path, home, capsys):
    ran = tmp_path / "CUSTOM_CODE_RAN"  # where custom_llama.py writes when imported
    pipeline = tmp_path / "p.yaml"
    pipeline.write_text(VALID.replace(TINY_MODEL, "{path: m}"))
    assert run_cli("run", str(pipeline)) == 2
    err = capsys.readouterr().err
    assert "p.yaml:3: model.path:" in err and "ships its own Python code" in err
    assert "set `trust_remote_code: true` under `model:`" in err
    assert_nothing_left(home)

    # The stages' load path refuses too, should a checkpoint change after validation.
    from stages.models.loading import load_model_and_tokenizer

    with pytest.raises(ValueError, match="trust_remote_code=True"):
        load_model_and_tokenizer(custom_checkpoint)
    assert not ran.exists()

    # Opting in passes validation, which still imports nothing of the checkpoint...
    pipeline.write_text(VALID.replace(TINY_MODEL, "{path: m, trust_remote_code: true}"))
    assert run_cli("validate", str(pipeline)) == 0, capsys.readouterr().err
    assert not ran.exists()
    # ...and the flag reaches every stage's inputs.
    from flows.execution.execute import resolve_inputs
    from flows.spec.loading import load_pipeline

    loaded = load_pipeline(pipeline)
    assert resolve_inputs(loaded, "sft", {}, home).trust_remote_code is True


def test_trusted_checkpoint_code_does_run_offline(custom_checkpoint, tmp_path):
    """The control: with trust_remote_code the same load path runs the checkpoint's module."""
    ran = tmp_path / "CUSTOM_CODE_RAN"
    code = textwrap.dedent(f"""
        from pathlib import Path
        from stages.models.loading import load_model_and_tokenizer
        model, tokenizer = load_model_and_tokenizer(Path({str(custom_checkpoint)!r}), trust_remote_code=True)
        print(type(model).__name__)
    """)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "hf-modules")}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("CustomModel")
    assert ran.exists()


# ---------------------------------------------------------------- checkpoints we write are safetensors

PICKLE_SUFFIXES = {".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt"}


def test_published_checkpoints_are_safetensors_never_pickles(tiny_checkpoint, ctx_factory, home):
    from stages import sft
    from stages.data.sources import ArithmeticData, materialize
    from stages.sft import SFTStageConfig

    data = materialize(ArithmeticData(generator="arithmetic", n=40, role="train"), Path("."), home / "data")
    ctx = ctx_factory("sft")
    config = SFTStageConfig(kind="sft", data="train", max_steps=2, batch_size=8, logging_steps=1)
    outputs = sft.run(config, StageInputs(model=tiny_checkpoint, datasets={"data": data}), ctx)
    published = ctx.tracker.publish_outputs(ctx.recorder, "stage-tests", "sft", ctx.staged)
    checkpoint = Path(published["checkpoint"])
    assert checkpoint != Path(outputs["checkpoint"]) and checkpoint.is_dir()

    # What is published and logged to MLflow. (The work dir may hold TRL's resume state, torch
    # pickles that transformers reads back with weights_only=True; it is never published.)
    from mlflow.artifacts import download_artifacts

    logged = Path(download_artifacts(run_id=ctx.run_id, artifact_path="outputs", dst_path=str(home / "logged"),
                                     tracking_uri=os.environ["MLFLOW_TRACKING_URI"]))
    files = [p for root in (checkpoint, logged) for p in root.rglob("*") if p.is_file()]
    assert any(p.is_relative_to(logged) and p.suffix == ".safetensors" for p in files), "checkpoint not logged"
    weights = [p for p in files if p.suffix == ".safetensors"]
    assert any(p.parent == checkpoint for p in weights), sorted(p.name for p in checkpoint.iterdir())
    assert [p for p in files if p.suffix in PICKLE_SUFFIXES] == []
    for path in files:  # by content too: no pickle stream, no torch.save zip under another name
        head = path.read_bytes()[:4]
        assert not head.startswith(b"\x80") and head != b"PK\x03\x04", f"{path} looks like a pickle"
    for path in weights:  # a safetensors file: 8-byte header length, then a JSON header
        raw = path.read_bytes()
        header = json.loads(raw[8: 8 + int.from_bytes(raw[:8], "little")])
        assert any(isinstance(v, dict) and "dtype" in v for v in header.values())


# ---------------------------------------------------------------- code rewards need bubblewrap unless opted out

ADD_TESTS = "assert add(2, 3) == 5 and add(-1, 1) == 0"
RIGHT, WRONG = "```python\ndef add(a, b):\n    return a + b\n```", "```python\ndef add(a, b):\n    return a - b\n```"


@pytest.fixture()
def no_bwrap(tmp_path, monkeypatch):
    """A PATH with prlimit and setpriv (util-linux) but no bubblewrap."""
    from stages.rewards import sandbox
    bin_dir = tmp_path / "bin-without-bwrap"
    bin_dir.mkdir()
    for tool in ("prlimit", "setpriv"):
        found = shutil.which(tool)
        assert found, f"{tool} is needed (util-linux)"
        (bin_dir / tool).symlink_to(found)
    monkeypatch.setenv("PATH", str(bin_dir))
    sandbox.check_sandbox.cache_clear()
    assert shutil.which("bwrap") is None
    yield
    sandbox.check_sandbox.cache_clear()


def marker_code(marker: Path) -> str:
    return f"```python\nopen({str(marker)!r}, 'w').write('ran')\ndef add(a, b):\n    return a + b\n```"


def test_code_reward_refuses_without_bubblewrap(no_bwrap, tmp_path):
    from stages.rewards.scoring import score_completions
    from stages.rewards.spec import RewardError, RewardSpec

    marker = tmp_path / "model-code-ran"
    with pytest.raises(RewardError) as caught:
        score_completions({"tests": RewardSpec(fn="code_tests")}, [marker_code(marker), RIGHT],
                          {"answer": [ADD_TESTS, ADD_TESTS]})
    message = str(caught.value)
    assert "code_tests refuses to run model-written code" in message
    assert "apt-get install bubblewrap" in message and "`kwargs: {sandbox: rlimits-only}`" in message
    assert not marker.exists()


def test_eval_stage_fails_rather_than_scoring_zero_without_bubblewrap(no_bwrap, tiny_checkpoint, ctx_factory, home):
    """Before the guard, the sandbox error was caught per sample and the eval reported pass@k = 0."""
    from stages import eval as eval_stage
    from stages.data.sources import FileData, materialize
    from stages.eval import EvalConfig
    from stages.rewards.spec import RewardError, RewardSpec

    (home / "code.jsonl").parent.mkdir(parents=True, exist_ok=True)
    (home / "code.jsonl").write_text(json.dumps({"prompt": "Write add(a, b).", "answer": ADD_TESTS}) + "\n")
    data = materialize(FileData(path="code.jsonl", role="heldout"), home, home / "data")
    config = EvalConfig(kind="eval", model="base", data="heldout", rewards=["tests"],
                        sampling={"attempts": 2, "max_tokens": 4})
    inputs = StageInputs(model=tiny_checkpoint, datasets={"heldout": data},
                         rewards={"tests": RewardSpec(fn="code_tests")})
    with pytest.raises(RewardError, match="refuses to run model-written code"):
        eval_stage.run(config, inputs, ctx_factory("eval"))


def test_explicit_opt_out_runs_with_limits_a_throwaway_dir_and_a_scrubbed_environment(no_bwrap, tmp_path, monkeypatch):
    from stages.rewards.scoring import score_completions
    from stages.rewards.spec import RewardSpec
    from stages.rewards.sandbox import run_sandboxed

    spec = RewardSpec(fn="code_tests", kwargs={"sandbox": "rlimits-only"})
    scored = score_completions({"tests": spec}, [RIGHT, WRONG, "no code here"], {"answer": [ADD_TESTS] * 3})
    assert scored.total == [1.0, 0.0, 0.0] and scored.components[0].parsed == [True, True, False]
    assert scored.error_count == 0

    monkeypatch.setenv("POSTTRAIN_TEST_SECRET", "s3cret-value")
    result = run_sandboxed(textwrap.dedent("""
        import os
        print(sorted(os.environ.items()))
        print("cwd", os.getcwd(), "uid", os.getuid())
    """), isolation="rlimits-only", timeout_s=60.0)  # not about time: start-up under load must not time out
    assert result.returncode == 0, result.stderr
    assert "s3cret-value" not in result.stdout and "POSTTRAIN_TEST_SECRET" not in result.stdout
    cwd = Path(result.stdout.split("cwd ")[1].split()[0])
    assert cwd.name == "work" and not cwd.exists()  # a fresh dir, deleted afterwards
    if os.geteuid() == 0:  # as root it runs as an unprivileged uid
        assert int(result.stdout.split("uid ")[1]) != 0

    bomb = run_sandboxed("blob = bytearray(4 * 2**30)\nprint('allocated')", memory_mb=256, isolation="rlimits-only",
                         timeout_s=60.0)
    assert "allocated" not in bomb.stdout and bomb.killed_reason == "memory limit (MemoryError)"
    loop = run_sandboxed("while True:\n    pass", timeout_s=1.0, isolation="rlimits-only")
    assert loop.timed_out and loop.killed_reason == "wall-clock timeout (1s)"
    if os.geteuid() == 0:  # its fresh uid's processes die with it, even one that left the session
        marker = str(1_000_000 + secrets.randbelow(1_000_000))
        daemon = run_sandboxed(f"import subprocess\nsubprocess.Popen(['sleep', '{marker}'], start_new_session=True)",
                               isolation="rlimits-only", timeout_s=60.0)
        assert daemon.returncode == 0, daemon.stderr
        assert processes_with_marker(f"sleep\0{marker}") == []


def test_the_opt_out_is_spelled_out_in_the_pipeline(tmp_path, home, capsys):
    pipeline = tmp_path / "p.yaml"
    pipeline.write_text(VALID.replace("fn: exact_answer", "fn: code_tests, kwargs: {sandbox: rlimits-only}") + GRPO)
    assert run_cli("validate", str(pipeline)) == 0, capsys.readouterr().err
    pipeline.write_text(VALID.replace("fn: exact_answer", "fn: code_tests, kwargs: {sandbox: off}"))
    assert run_cli("validate", str(pipeline)) == 2
    assert "rewards.correct.kwargs.sandbox: must be one of bubblewrap, rlimits-only" in capsys.readouterr().err
