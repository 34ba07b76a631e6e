"""The stage kinds posttrain knows: kind name -> (config model, module with ``run``)."""

from __future__ import annotations

import importlib
import os

from stages.dpo import DPOStageConfig
from stages.eval import EvalConfig
from stages.kto import KTOStageConfig
from stages.online_dpo import OnlineDPOStageConfig
from stages.reward_model import RewardModelStageConfig
from stages.rl_common import RLStageConfig
from stages.sft import SFTStageConfig

STAGE_KINDS = {
    "sft": SFTStageConfig,
    "reward_model": RewardModelStageConfig,
    "rl": RLStageConfig,
    "dpo": DPOStageConfig,
    "kto": KTOStageConfig,
    "online_dpo": OnlineDPOStageConfig,
    "eval": EvalConfig,
}

# Metrics shown in the run summary, per kind (first ones matter most).
HEADLINE_METRICS = {
    "sft": ["first_loss", "final_loss", "steps"],
    "rl": ["reward/mean", "kl", "steps"],
    "reward_model": ["heldout_pairwise_accuracy", "heldout_reward_margin", "steps"],
    "dpo": ["heldout_pairwise_accuracy", "rewards/margin", "steps"],
    "kto": ["heldout_reward_margin", "rewards/margin", "kl", "steps"],
    "online_dpo": ["reward/mean", "rewards/margin", "tie_frac", "steps"],
    "eval": ["pass_at_1", "pass_at_*", "best_of_n_accuracy", "reward_mean", "format_error_rate", "truncated_rate"],
}


def stage_runner(kind: str):
    """The ``run(config, inputs, ctx)`` function of a stage kind (imported lazily: torch is slow).

    ``POSTTRAIN_TORCH_THREADS`` caps torch's CPU threads for the stage: when several torch
    processes share a small machine, spinning intra-op threads were seen to make a step
    ~25x slower than with one thread each.
    """
    run = importlib.import_module(f"stages.{kind}").run
    threads = os.environ.get("POSTTRAIN_TORCH_THREADS")
    if not threads:
        return run

    def run_with_threads(config, inputs, ctx):
        import torch

        torch.set_num_threads(int(threads))
        return run(config, inputs, ctx)

    return run_with_threads
