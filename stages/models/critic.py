"""The PPO critic: a backbone and a scalar value head, from the policy's checkpoint or a reward model's."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn


class ValueModel(nn.Module):
    """The critic: a transformer backbone and a scalar head, one value per position."""

    def __init__(self, backbone: nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.head.weight)  # start at V = 0: early advantages are rewards-to-go
        nn.init.zeros_(self.head.bias)

    @classmethod
    def from_policy_checkpoint(cls, path: Path, trust_remote_code: bool = False) -> "ValueModel":
        """The policy's backbone (``model.model`` of a causal LM), without its LM head."""
        from transformers import AutoModelForCausalLM

        causal_lm = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=trust_remote_code)
        return cls(causal_lm.base_model, causal_lm.config.hidden_size)

    @classmethod
    def from_reward_model(cls, path: Path, trust_remote_code: bool = False) -> "ValueModel":
        """A reward model's backbone and score head: V starts as its score of the prefix (at the end: the reward)."""
        from stages.models.loading import load_sequence_scorer

        scorer, _ = load_sequence_scorer(path, trust_remote_code=trust_remote_code)
        critic = cls(scorer.base_model, scorer.config.hidden_size)
        with torch.no_grad():
            critic.head.weight.copy_(scorer.score.weight)
            if getattr(scorer.score, "bias", None) is not None:
                critic.head.bias.copy_(scorer.score.bias)
        return critic

    def forward(self, input_ids, attention_mask, position_ids) -> torch.Tensor:
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                               position_ids=position_ids).last_hidden_state
        return self.head(hidden).squeeze(-1)
