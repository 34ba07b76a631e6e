"""``placement: {reference: ..., reward_model: ...}``: the frozen reference and the reward models kept on
the CPU, another device, or offloaded (weights in CPU memory, parameters on ``meta`` between forward
passes), with the same results as on the policy's device; devices the machine lacks refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import run_cli, write
from stages.context import StageInputs
from test_reward_model import preference_file

PIPELINE = """\
name: placement
model: {{init: tiny, hidden_size: 32, num_layers: 1, num_heads: 2, intermediate_size: 64}}
data:
  train: {{generator: arithmetic, n: 64, role: train}}
  prefs: {{generator: arithmetic_preferences, n: 64, role: train}}
rewards:
  verifier: {{fn: exact_answer}}
  rm: {{fn: reward_model, stage: rm}}
stages:
  rm: {{kind: reward_model, data: prefs, max_steps: 2, batch_size: 8}}
  dpo: {{kind: dpo, model: base, data: prefs, max_steps: 2, batch_size: 8, placement: {dpo}}}
  ppo: {{kind: rl, algorithm: ppo, policy: base, data: train, rewards: [{rewards}], max_steps: 2, prompts_per_step: 4,
        sampling: {{attempts: 2}}, minibatch_size: 8, placement: {ppo}{lora}}}
"""


def validate(tmp_path, capsys, dpo="{reference: cpu}", ppo="{reference: offload, reward_model: cpu}",
             rewards="verifier, rm", lora=""):
    text = PIPELINE.format(dpo=dpo, ppo=ppo, rewards=rewards, lora=lora)
    code = run_cli("validate", str(write(tmp_path / "placement.yaml", text)))
    return code, capsys.readouterr().err


def test_placements_validate(home, tmp_path, capsys):
    code, err = validate(tmp_path, capsys)
    assert code == 0, err


@pytest.mark.parametrize("fields, message", [
    ({"dpo": "{reference: gpu}"}, "stages.dpo.placement.reference: 'gpu' is no placement: use `policy`"),
    ({"dpo": "{reference: cuda:1}"}, "placement.reference: cuda:1 does not exist on this machine (no GPU)"),
    ({"dpo": "{reward_model: cpu}"}, "stages.dpo.placement.reward_model: unknown key"),
    ({"rewards": "verifier"}, "stage 'ppo' places its reward models, but none of its rewards is `fn: reward_model`"),
    ({"lora": ", lora: {r: 4}"}, "with lora the KL reference is the policy itself with its adapters off"),
])
def test_placements_that_cannot_work_are_refused(home, tmp_path, capsys, fields, message):
    code, err = validate(tmp_path, capsys, **fields)
    assert code == 2 and message in err, err


def test_a_device_the_machine_lacks_is_refused_before_anything_loads(tiny_checkpoint, ctx_factory, home):
    """On a pool worker the validator cannot see the devices: the stage refuses before loading a model."""
    from stages import dpo
    from stages.ppo import PPORun
    from stages.rl_common import rl_stage_config

    config = rl_stage_config(kind="rl", algorithm="ppo", policy="base", data="train", rewards=["r"], prompts_per_step=4,
                           sampling={"attempts": 2}, minibatch_size=8, placement={"reference": "cuda:3"})
    with pytest.raises(ValueError, match=r"placement.reference: cuda:3 does not exist on this machine \(no GPU\)"):
        PPORun.load(config, StageInputs(policy="/nonexistent"), seed=0)  # refused before the path is read
    config = dpo.DPOStageConfig(kind="dpo", model="base", data="prefs", placement={"reference": "cuda:0"})
    with pytest.raises(ValueError, match="placement.reference: cuda:0 does not exist"):
        dpo.run(config, StageInputs(model=tiny_checkpoint, datasets={"prefs": preference_file(home, n=16)}),
                ctx_factory("dpo"))


def test_a_placed_reference_and_reward_model_compute_what_they_compute_on_the_policy_device(tiny_checkpoint):
    from stages.models.placement import place, resident_devices
    from stages.models.loading import load_frozen_reference
    from stages.rewards.reward_model import RewardModelScorer

    device = torch.device("cpu")  # the policy's device on this machine
    ids = torch.tensor([[5, 9, 11, 3, 7, 2], [4, 4, 8, 1, 0, 0]])
    inputs = {"input_ids": ids, "attention_mask": (ids != 0).long()}
    with torch.no_grad():
        expected = load_frozen_reference(tiny_checkpoint)(**inputs).logits
    prompts = [[{"role": "user", "content": f"What is {a}+1?"}] for a in range(4)]
    replies = [str(a + 1) for a in range(4)]
    torch.manual_seed(0)  # the score head on a causal-LM checkpoint is new: the same seed, the same head
    expected_scores = RewardModelScorer(Path(tiny_checkpoint)).raw_scores(prompts, replies)
    for where, resident in (("cpu", {"cpu"}), ("offload", {"meta"})):
        reference = place(load_frozen_reference(tiny_checkpoint), where, device)
        assert resident_devices(reference) == resident  # offload: no weights held between passes
        with torch.no_grad():
            logits = reference(**inputs).logits
        assert resident_devices(reference) == resident  # ... and none left behind by one
        assert logits.device == device and torch.equal(logits, expected), where
        torch.manual_seed(0)
        scorer = RewardModelScorer(Path(tiny_checkpoint), where=where)
        assert resident_devices(scorer.model) == resident
        assert scorer.raw_scores(prompts, replies) == expected_scores, where


def test_dpo_with_its_reference_offloaded_trains_as_without(tiny_checkpoint, ctx_factory, home):
    """TRL's DPO trainer scores the reference through its fused LM head, which reads the head's weight
    without calling it: offloaded, the whole reference is fetched for each pass. Same losses, and the
    run's params say where the reference lived."""
    from mlflow.tracking import MlflowClient

    from stages import dpo

    data = preference_file(home, n=40)
    results, params = {}, {}
    for where in ("policy", "offload"):
        config = dpo.DPOStageConfig(kind="dpo", model="base", data="prefs", max_steps=2, batch_size=8,
                                    logging_steps=1, placement={"reference": where})
        ctx = ctx_factory(f"dpo-{where}")
        results[where] = dpo.run(config, StageInputs(model=tiny_checkpoint, datasets={"prefs": data}), ctx)["metrics"]
        params[where] = MlflowClient().get_run(ctx.run_id).data.params["reference_device"]
    assert params == {"policy": "cpu", "offload": "meta"}
    for key in ("first_loss", "train_loss"):
        assert results["offload"][key] == pytest.approx(results["policy"][key], rel=1e-6), key
