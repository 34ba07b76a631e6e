"""The sft and eval stages on a tiny model, with a real MLflow run as their tracking handle."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from stages.data.sources import ArithmeticData, materialize, read_materialized
from stages.eval import EvalConfig
from stages.rewards.spec import RewardSpec
from stages.sft import SFTStageConfig
from stages.context import StageInputs


def arithmetic_file(home, n, seed=0, role="train"):
    return materialize(ArithmeticData(generator="arithmetic", n=n, seed=seed, role=role), Path("."), home / "data")


def test_arithmetic_generator_is_deterministic_and_imperfect_on_request(home):
    spec = ArithmeticData(generator="arithmetic", n=400, seed=5, role="train", demo_error_rate=0.35)
    first, second = materialize(spec, Path("."), home / "a"), materialize(spec, Path("."), home / "b")
    assert first.read_bytes() == second.read_bytes()
    records = read_materialized(first)
    wrong = sum(r["messages"][-1]["content"] != r["answer"] for r in records) / len(records)
    assert 0.25 < wrong < 0.45  # the declared share of wrong demonstrations, references stay right
    assert all(eval(r["messages"][0]["content"][8:-1]) == int(r["answer"]) for r in records)


def test_assistant_only_loss_masks_every_prompt_token(tiny_checkpoint, tmp_path):
    """Labels are -100 on the whole prompt; the answer and its end-of-turn token carry loss."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from stages.models.loading import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(tiny_checkpoint)
    tokenizer.padding_side = "right"
    messages = [{"role": "user", "content": "What is 3+4?"}, {"role": "assistant", "content": "7"}]
    trainer = SFTTrainer(
        model=model, processing_class=tokenizer, train_dataset=Dataset.from_list([{"messages": messages}]),
        args=SFTConfig(output_dir=str(tmp_path), assistant_only_loss=True, report_to="none", use_cpu=True,
                       bf16=False, max_steps=1),
    )
    batch = trainer.data_collator([trainer.train_dataset[0]])
    ids, labels = batch["input_ids"][0].tolist(), batch["labels"][0].tolist()
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    prompt_len = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    assert labels[:prompt_len] == [-100] * prompt_len
    trained = [t for t, label in zip(ids, labels) if label != -100]
    assert tokenizer.decode(trained) == "7<|end|>"
    # and the loss really ignores the prompt: changing prompt logits' targets changes nothing
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], labels=batch["labels"])
        logits = out.logits[0, :-1]
        targets = torch.tensor(labels[1:])
        keep = targets != -100
        manual = torch.nn.functional.cross_entropy(logits[keep], targets[keep])
    assert out.loss.item() == pytest.approx(manual.item(), rel=1e-5)


def test_sft_changes_weights_and_lowers_loss(tiny_checkpoint, ctx_factory, home):
    from stages import sft
    from stages.models.loading import load_model_and_tokenizer

    ctx = ctx_factory("sft")
    config = SFTStageConfig(kind="sft", data="train", max_steps=40, batch_size=16, lr=5e-3, logging_steps=5)
    outputs = sft.run(config, StageInputs(model=tiny_checkpoint, datasets={"data": arithmetic_file(home, 300)}), ctx)
    metrics = outputs["metrics"]
    assert metrics["steps"] == 40
    assert metrics["final_loss"] < 0.6 * metrics["first_loss"]
    before, _ = load_model_and_tokenizer(tiny_checkpoint)
    after, _ = load_model_and_tokenizer(Path(outputs["checkpoint"]))
    changed = [not torch.equal(a, b) for a, b in zip(before.state_dict().values(), after.state_dict().values())]
    assert all(changed)
    history = ctx.metric_history("loss")
    assert len(history) == 8 and history[0].step == 5  # logged per logging step
    assert ctx.metric_history("lr")
    assert Path(outputs["checkpoint"]).parent.name == "staging"  # not published by the stage itself


def test_eval_reports_pass_at_k_failures_and_settings(tiny_checkpoint, ctx_factory, home):
    from stages import eval as eval_stage

    ctx = ctx_factory("eval")
    config = EvalConfig(kind="eval", model="base", data="heldout", rewards=["correct"],
                        sampling={"temperature": 1.0, "max_tokens": 4, "attempts": 4, "seed": 1})
    inputs = StageInputs(model=tiny_checkpoint, datasets={"heldout": arithmetic_file(home, 12, seed=9, role="heldout")},
                         rewards={"correct": RewardSpec(fn="exact_answer")})
    outputs = eval_stage.run(config, inputs, ctx)
    metrics = outputs["metrics"]
    assert set(metrics) >= {"pass_at_1", "pass_at_2", "pass_at_4", "reward_mean", "format_error_rate",
                            "truncated_rate", "completion_tokens_mean"}
    assert metrics["format_error_rate"] > 0.5  # an untrained model rarely even writes a number
    assert metrics["completion_tokens_mean"] <= 4
    failures = [json.loads(line) for line in open(outputs["failures"])]
    assert len(failures) == round(12 * (1 - metrics["pass_at_4"]))
    assert all(len(case["attempts"]) == 4 and case["answer"] for case in failures)
    run = ctx.recorded_run()
    assert len(run.data.tags["posttrain.eval_settings"]) == 16
    # same settings, same samples: the seed fixes the sampler
    again = eval_stage.run(config, inputs, ctx_factory("eval-again"))
    assert again["metrics"] == metrics
