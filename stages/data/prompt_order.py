"""Which prompts each training step draws, decided by posttrain and never asked of a trainer: PPO's and online
DPO's batches, and GRPO's generation calls, whose rows TRL's trainer is handed already in order."""

from __future__ import annotations

import random


def prompt_batches(records: list[dict], per_step: int, seed: int):
    """PPO's and online DPO's batches of records, endless: a fresh shuffle every pass over the data."""
    rng = random.Random(seed)
    order: list[int] = []
    while True:
        while len(order) < per_step:
            order += rng.sample(range(len(records)), len(records))
        batch, order = order[:per_step], order[per_step:]
        yield [records[i] for i in batch]


def generation_order(n_prompts: int, per_call: int, calls: int, seed: int) -> list[int]:
    """The prompts (indices) of GRPO's generation calls 0 to ``calls - 1``, ``per_call`` each, in order: every
    pass over the data a fresh permutation from one torch generator seeded with ``seed``, a pass's incomplete
    last call dropped. The scheme of TRL's ``RepeatSampler``, by which GRPO drew before posttrain owned the order."""
    import torch

    if per_call > n_prompts:
        raise ValueError(f"{per_call} distinct prompts per generation call, but the data holds {n_prompts}")
    generator = torch.Generator()
    generator.manual_seed(seed)
    order: list[int] = []
    while len(order) < calls * per_call:
        permutation = torch.randperm(n_prompts, generator=generator).tolist()
        order += permutation[: n_prompts // per_call * per_call]
    return order[: calls * per_call]


class GenerationPrompts:
    """GRPO's prompts in posttrain's order: ``rows`` is the training dataset TRL takes as it comes (its
    ``shuffle_dataset`` off), and ``of_call(c)`` the prompts TRL's rollout function gets at generation call ``c``:
    each of the call's ``per_call`` prompts ``group_size`` times in a row."""

    def __init__(self, dataset, per_call: int, group_size: int, max_steps: int, updates_per_call: int, seed: int):
        # one call more than the stage makes: the trainer never starts a second pass, which would restart the rows
        calls = -(-max_steps // updates_per_call) + 1
        self.rows = dataset.select(generation_order(len(dataset), per_call, calls, seed))
        self.per_call, self.group_size = per_call, group_size

    def of_call(self, call: int) -> list:
        prompts = self.rows[call * self.per_call:(call + 1) * self.per_call]["prompt"]
        return [prompt for prompt in prompts for _ in range(self.group_size)]
