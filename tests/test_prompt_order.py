"""posttrain owns the prompt order (stages/data/prompt_order.py): GRPO's generation calls draw the prompts
posttrain decided, in the order TRL's own sampler drew them before, and TRL's trainer hands them over as
posttrain put them in its rows, so drawing ahead knows each call's prompts without asking TRL."""

from __future__ import annotations

import pytest

from stages.data.prompt_order import GenerationPrompts, generation_order


def trl_sampler_calls(n: int, per_call: int, group: int, repeats: int, seed: int, passes: int) -> list[list[int]]:
    """The distinct prompts of each generation call as TRL's ``RepeatSampler`` yields them, pass after pass over
    the data (each pass one iteration of the sampler, as the trainer's dataloader iterates it per epoch)."""
    from trl.trainer.utils import RepeatSampler

    sampler = RepeatSampler(list(range(n)), mini_repeat_count=group, batch_size=per_call, repeat_count=repeats,
                            shuffle=True, seed=seed)
    calls = []
    for _ in range(passes):
        indices = list(iter(sampler))
        size = per_call * group * repeats  # one call's indices: its prompts, each `group` times, `repeats` times
        for start in range(0, len(indices), size):
            calls.append(indices[start:start + per_call * group:group])
    return calls


@pytest.mark.parametrize("n, per_call, group, repeats, seed", [(10, 4, 3, 1, 0), (12, 4, 2, 2, 7), (9, 9, 4, 1, 3)])
def test_grpo_order_is_the_order_trls_own_sampler_drew(n, per_call, group, repeats, seed):
    """Across passes over the data, with an incomplete last call dropped from each pass (10 prompts, 4 a call),
    calls reused for several updates (repeats 2), and one call per pass (9 of 9)."""
    theirs = trl_sampler_calls(n, per_call, group, repeats, seed, passes=4)
    assert len(theirs) >= 4 and len(theirs) == 4 * (n // per_call)  # several passes, each its full calls only
    ours = generation_order(n, per_call, len(theirs), seed)
    assert [ours[c * per_call:(c + 1) * per_call] for c in range(len(theirs))] == theirs
    assert generation_order(n, per_call, len(theirs), seed + 1) != ours  # the seed decides it


def test_a_call_larger_than_the_data_is_refused():
    with pytest.raises(ValueError, match="5 distinct prompts per generation call, but the data holds 4"):
        generation_order(4, 5, 1, 0)


def test_trls_trainer_hands_each_call_the_prompts_posttrain_ordered(tiny_checkpoint, tmp_path):
    """A real GRPOTrainer over ``GenerationPrompts.rows`` with posttrain's settings (shuffle off): the batches
    its dataloader yields are ``of_call(c)`` for every call of the stage, past the end of a pass over the data
    (10 prompts, 4 a call, 7 calls), each call's batch repeated once per update on it."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    prompts = [[{"role": "user", "content": f"{a}+1"}] for a in range(10)]
    per_call, group, updates, steps = 4, 2, 2, 14
    ordered = GenerationPrompts(Dataset.from_list([{"prompt": p} for p in prompts]), per_call, group, steps, updates,
                                seed=5)
    args = GRPOConfig(output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=per_call * group,
                      num_generations=group, num_iterations=updates, steps_per_generation=1, shuffle_dataset=False,
                      report_to="none", use_cpu=True, seed=5)
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(tiny_checkpoint),
                          reward_funcs=[lambda completions, **_: [0.0] * len(completions)], args=args,
                          train_dataset=ordered.rows, processing_class=tokenizer)
    batches = [[row["prompt"] for row in batch] for batch, _ in zip(trainer.get_train_dataloader(), range(steps))]
    calls = steps // updates
    assert calls * per_call > len(prompts)  # the stage draws past one pass over the data
    assert batches == [ordered.of_call(call) for call in range(calls) for _ in range(updates)]
    assert sorted(map(str, ordered.of_call(0) + ordered.of_call(1))) != sorted(map(str, ordered.of_call(2)
                                                                                    + ordered.of_call(3)))
