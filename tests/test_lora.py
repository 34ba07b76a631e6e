"""LoRA on every training stage: the published checkpoint is the starting one plus the
adapters' low-rank delta and nothing else, and the adapters are published alone beside it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import torch_threads
from stages.data.sources import ArithmeticData, ArithmeticPreferenceData, materialize
from stages.rewards.spec import RewardSpec
from stages.context import StageInputs

LORA = {"r": 4, "alpha": 8}
SCALE = LORA["alpha"] / LORA["r"]


@pytest.fixture(autouse=True)
def one_thread():
    with torch_threads(1):
        yield


def code_point_sum(completions, **_):
    """A score that differs between almost any two samples (a group's advantages are not all zero)."""
    return [sum(map(ord, text)) / 100 for text in completions]


def prompts_file(home):
    return str(materialize(ArithmeticData(generator="arithmetic", n=16, seed=0, role="train"), Path("."),
                           home / "data"))


def preferences_file(home):
    spec = ArithmeticPreferenceData(generator="arithmetic_preferences", n=16, seed=0, role="train",
                                    near_miss_rate=0.0, malformed_rate=1.0)
    return str(materialize(spec, Path("."), home / "data"))


def load_causal_lm(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path)


def load_reward_model(path):
    from stages.reward_model import load_sequence_scorer

    return load_sequence_scorer(path)[0]


def assert_base_plus_low_rank_delta(start: Path, outputs: dict, load, head: str | None = None) -> None:
    """The merged checkpoint is ``start`` with (alpha / r) B A added to each adapted weight, and
    bitwise ``start`` everywhere else (``head``: a reward model's new score head, saved with the adapters)."""
    from peft import PeftModel

    adapter, checkpoint = Path(outputs["adapter"]), Path(outputs["checkpoint"])
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in adapter.iterdir()}
    assert not (checkpoint / "adapter_config.json").exists()  # an ordinary checkpoint, not an adapter dir
    adapter_config = json.loads((adapter / "adapter_config.json").read_text())
    assert (adapter_config["r"], adapter_config["lora_alpha"]) == (LORA["r"], LORA["alpha"])
    assert Path(adapter_config["base_model_name_or_path"]) == start

    tensors = load_file(adapter / "adapter_model.safetensors")
    lora_B = {name.split("base_model.model.", 1)[1].rsplit(".lora_B", 1)[0]: t
              for name, t in tensors.items() if ".lora_B." in name}
    lora_A = {name.split("base_model.model.", 1)[1].rsplit(".lora_A", 1)[0]: t
              for name, t in tensors.items() if ".lora_A." in name}
    assert lora_B and set(lora_B) == set(lora_A)
    assert all(b.abs().sum() > 0 for b in lora_B.values()), "a B matrix is still zero: nothing trained"

    base = load(start).state_dict()
    published = load(checkpoint).state_dict()
    assert set(published) == set(base)
    for name, weight in published.items():
        module = name.removesuffix(".weight")
        if module in lora_B:
            expected = base[name] + SCALE * lora_B[module] @ lora_A[module]
            torch.testing.assert_close(weight, expected, rtol=1e-5, atol=1e-6, msg=name)
            assert not torch.equal(weight, base[name]), name
        elif head is not None and module == head:
            saved = next(t for n, t in tensors.items() if n.endswith(f"{head}.weight"))
            assert torch.equal(weight, saved) and not torch.equal(weight, base[name])  # trained in full
        else:  # embeddings, norms, LM head: untouched
            assert torch.equal(weight, base[name]), f"{name} changed without an adapter"

    # PEFT itself, loading the published adapter onto the starting checkpoint, gives the same model
    merged_by_peft = PeftModel.from_pretrained(load(start), adapter).merge_and_unload().state_dict()
    for name, weight in published.items():
        torch.testing.assert_close(weight, merged_by_peft[name], rtol=1e-5, atol=1e-6, msg=name)


def test_sft_with_lora_publishes_merged_checkpoint_and_adapter(tiny_checkpoint, ctx_factory, home):
    from stages import sft

    ctx = ctx_factory("sft-lora")
    config = sft.SFTStageConfig(kind="sft", data="train", max_steps=2, batch_size=4, lr=1e-2, save_steps=None,
                                lora=LORA)
    outputs = sft.run(config, StageInputs(model=tiny_checkpoint, datasets={"data": prompts_file(home)}), ctx)
    assert_base_plus_low_rank_delta(tiny_checkpoint, outputs, load_causal_lm)

    # the orchestrator publishes both dirs and logs both as artifacts of the stage's run
    published = ctx.tracker.publish_outputs(ctx.recorder, "stage-tests", "sft-lora", ctx.staged)
    assert set(published) == {"checkpoint", "adapter"}
    logged = {Path(a.path).name for a in ctx.client.list_artifacts(ctx.run_id, "outputs")}
    assert logged == {"checkpoint", "adapter"}
    adapter_files = {Path(a.path).name for a in ctx.client.list_artifacts(ctx.run_id, "outputs/adapter")}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= adapter_files
    assert set(ctx.tracker.outputs_of(ctx.recorded_run())) == {"checkpoint", "adapter"}


def test_reward_model_with_lora_trains_the_score_head_in_full(tiny_checkpoint, ctx_factory, home):
    from stages import reward_model

    config = reward_model.RewardModelStageConfig(kind="reward_model", data="prefs", max_steps=2, batch_size=4,
                                                 lr=1e-2, heldout_fraction=0.0, lora=LORA)
    outputs = reward_model.run(config, StageInputs(model=tiny_checkpoint, datasets={"data": preferences_file(home)}),
                               ctx_factory("rm-lora"))
    assert_base_plus_low_rank_delta(tiny_checkpoint, outputs, load_reward_model, head="score")


@pytest.mark.parametrize("kind", ["dpo", "kto"])
def test_preference_optimisation_with_lora(kind, tiny_checkpoint, ctx_factory, home):
    from stages import dpo, kto

    module, config_class = {"dpo": (dpo, dpo.DPOStageConfig), "kto": (kto, kto.KTOStageConfig)}[kind]
    config = config_class(kind=kind, model="base", data="prefs", max_steps=2, batch_size=4, lr=1e-2,
                          heldout_fraction=0.0, lora=LORA)
    outputs = module.run(config, StageInputs(model=tiny_checkpoint, datasets={"data": preferences_file(home)}),
                         ctx_factory(f"{kind}-lora"))
    assert_base_plus_low_rank_delta(tiny_checkpoint, outputs, load_causal_lm)
    with pytest.raises(ValueError, match="with lora the reference"):
        config_class(kind=kind, model="sft", reference="base", data="prefs", batch_size=4, lora=LORA)


def rl_config(algorithm: str, **overrides):
    from stages.rl_common import rl_stage_config

    fields = dict(kind="rl", algorithm=algorithm, policy="base", data="train", rewards=["score"], kl_beta=0.05,
                  sampling={"attempts": 2, "max_tokens": 4}, prompts_per_step=2, max_steps=1, lr=1e-2, lora=LORA)
    return rl_stage_config(**(fields | overrides))


def rl_inputs(home, checkpoint):
    return StageInputs(policy=checkpoint, datasets={"data": prompts_file(home)},
                       rewards={"score": RewardSpec(fn="test_lora:code_point_sum")})


def test_grpo_with_lora_publishes_merged_checkpoint_and_adapter(tiny_checkpoint, ctx_factory, home):
    from stages import rl

    outputs = rl.run(rl_config("grpo"), rl_inputs(home, tiny_checkpoint), ctx_factory("grpo-lora"))
    assert_base_plus_low_rank_delta(tiny_checkpoint, outputs, load_causal_lm)
    with pytest.raises(ValueError, match="with lora the KL reference"):  # the policy with its adapters off
        rl_config("grpo", reference="other")


def test_ppo_with_lora_trains_adapters_against_the_adapters_off_policy(tiny_checkpoint, ctx_factory, home):
    from stages import rl
    from stages.ppo import AdaptersOff, PPORun

    config = rl_config("ppo", ppo_epochs=1, minibatch_size=4)
    outputs = rl.run(config, rl_inputs(home, tiny_checkpoint), ctx_factory("ppo-lora"))
    assert_base_plus_low_rank_delta(tiny_checkpoint, outputs, load_causal_lm)

    # no second copy: the reference is the policy with its adapters off, i.e. the starting weights
    run = PPORun.load(config, rl_inputs(home, tiny_checkpoint), seed=0)
    assert isinstance(run.reference, AdaptersOff)
    optimised = {id(p) for group in run.optimizers[0].param_groups for p in group["params"]}
    assert optimised == {id(p) for name, p in run.policy.named_parameters() if "lora_" in name}
    with torch.no_grad():
        for name, parameter in run.policy.named_parameters():
            if "lora_B" in name:
                parameter.fill_(0.1)
        ids = torch.tensor([[1, 5, 7, 9]])
        reference_logits = run.reference(input_ids=ids).logits
        assert torch.equal(reference_logits, load_causal_lm(tiny_checkpoint)(input_ids=ids).logits)
        assert not torch.allclose(run.policy(input_ids=ids).logits, reference_logits)
    with pytest.raises(ValueError, match="with lora the KL reference"):
        rl_config("ppo", reference="other")
