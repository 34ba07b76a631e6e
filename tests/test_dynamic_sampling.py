"""GRPO's dynamic sampling (DAPO): zero-variance groups are dropped and replaced by fresh prompts
within a budget of generation rounds; the raw zero-variance fraction is logged beside the kept one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import run_cli, write
from stages.rewards.spec import RewardSpec
from stages.rl_common import rl_stage_config
from stages.context import StageInputs


def by_answer(completions, answer, **_):
    """Every attempt at an `easy-*` prompt is right, none at a `hard-*` one, and every other attempt
    at a `mixed-*` one: only mixed prompts' groups carry signal, whatever the policy writes."""
    return [1.0 if a.startswith("easy") else 0.0 if a.startswith("hard") else float(i % 2 == 0)
            for i, a in enumerate(answer)]


def prompts_file(path: Path, kinds: list[str], n: int = 12) -> Path:
    with open(path, "w", encoding="utf-8") as handle:
        for i in range(n):
            handle.write(json.dumps({"messages": [{"role": "user", "content": f"question {i}"}],
                                     "answer": f"{kinds[i % len(kinds)]}-{i}"}) + "\n")
    return path


def run_grpo(tiny_checkpoint, ctx, data: Path, max_rounds: int):
    from stages import rl

    config = rl_stage_config(kind="rl", algorithm="grpo", policy="base", data="train", rewards=["verdict"],
                           sampling={"attempts": 4, "max_tokens": 3}, prompts_per_step=2, max_steps=3,
                           dynamic_sampling={"max_rounds": max_rounds})
    inputs = StageInputs(policy=tiny_checkpoint, datasets={"train": data},
                         rewards={"verdict": RewardSpec(fn="test_dynamic_sampling:by_answer")})
    rl.run(config, inputs, ctx)
    return {name: [p.value for p in ctx.metric_history(name)]
            for name in ("reward/zero_variance_group_frac", "dynamic/kept_zero_variance_frac", "dynamic/rounds")}


def test_kept_groups_all_carry_signal_and_the_raw_fraction_is_logged(tiny_checkpoint, ctx_factory, tmp_path):
    torch.manual_seed(0)
    history = run_grpo(tiny_checkpoint, ctx_factory("dynamic"), prompts_file(tmp_path / "p.jsonl",
                                                                             ["easy", "hard", "mixed"]), 16)
    assert history["dynamic/kept_zero_variance_frac"] == [0.0, 0.0, 0.0]
    # two thirds of the prompts never vary: the generated groups (all rounds) are mostly without signal
    assert all(frac > 0 for frac in history["reward/zero_variance_group_frac"])
    assert all(rounds >= 1 for rounds in history["dynamic/rounds"]) and max(history["dynamic/rounds"]) > 1


def test_an_exhausted_budget_tops_up_with_zero_variance_groups_and_says_so(tiny_checkpoint, ctx_factory, tmp_path):
    history = run_grpo(tiny_checkpoint, ctx_factory("dynamic-dry"), prompts_file(tmp_path / "p.jsonl",
                                                                                 ["easy", "hard"]), 2)
    assert history["dynamic/rounds"] == [2.0, 2.0, 2.0]  # the whole budget, every step
    assert history["dynamic/kept_zero_variance_frac"] == [1.0, 1.0, 1.0]
    assert history["reward/zero_variance_group_frac"] == [1.0, 1.0, 1.0]


def test_merged_groups_are_repadded_on_their_own_sides():
    from stages.grpo import Group, merge_groups

    short = Group({"prompt_ids": torch.tensor([[7, 8]]), "prompt_mask": torch.tensor([[1, 1]]),
                   "completion_ids": torch.tensor([[5]]), "completion_mask": torch.tensor([[1]]),
                   "advantages": torch.tensor([0.5])}, True)
    long = Group({"prompt_ids": torch.tensor([[1, 2, 3]]), "prompt_mask": torch.tensor([[1, 1, 1]]),
                  "completion_ids": torch.tensor([[4, 4, 4]]), "completion_mask": torch.tensor([[1, 1, 0]]),
                  "advantages": torch.tensor([-0.5])}, True)
    merged = merge_groups([short, long])
    assert merged["prompt_ids"].tolist() == [[0, 7, 8], [1, 2, 3]]  # prompts padded on the left
    assert merged["prompt_mask"].tolist() == [[0, 1, 1], [1, 1, 1]]
    assert merged["completion_ids"].tolist() == [[5, 0, 0], [4, 4, 4]]  # completions on the right
    assert merged["num_items_in_batch"].item() == 3


@pytest.mark.parametrize("block, message", [
    ("{max_rounds: 1}", "max_rounds"),
    ("{max_round: 4}", "max_round"),
])
def test_dynamic_sampling_is_validated(home, tmp_path, capsys, block, message):
    from conftest import QUICKSTART

    text = QUICKSTART.read_text(encoding="utf-8").replace("    advantage: group_centered",
                                                         f"    dynamic_sampling: {block}\n    advantage: group_centered")
    assert "dynamic_sampling" in text
    assert run_cli("validate", str(write(tmp_path / "p.yaml", text))) == 2
    err = capsys.readouterr().err
    assert "stages.grpo.dynamic_sampling" in err and message in err
    assert not (home / "mlflow.db").exists()
