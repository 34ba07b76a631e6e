"""A PRM's surprise head (``step_head: surprise``): a step judged by how much it surprised the frozen LM, beside
its hidden states; the head sits in ``HEAD_FILE`` and ``HEAD_CONFIG`` beside the LM (docs/algorithms.md)."""

from __future__ import annotations

import json
from pathlib import Path

HEAD_FILE = "step_head.safetensors"
HEAD_CONFIG = "step_head.json"
HIDDEN = 64  # the MLP's width
SURPRISE_FEATURES = 3  # sum, min and last of the step's token log-probabilities


def has_surprise_head(path: Path) -> bool:
    """Whether a checkpoint is a causal LM with a surprise head beside it."""
    return (Path(path) / HEAD_CONFIG).exists()


def surprise_head(features: int, seed: int):
    """A new seeded head: standardisation (set from the training steps), Linear, ReLU, Linear to (wrong, right)."""
    import torch

    class SurpriseHead(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("mean", torch.zeros(features))
            self.register_buffer("scale", torch.ones(features))
            self.mlp = torch.nn.Sequential(torch.nn.Linear(features, HIDDEN), torch.nn.ReLU(),
                                           torch.nn.Linear(HIDDEN, 2))

        def forward(self, features_S_F):
            return self.mlp((features_S_F - self.mean) / self.scale)

    torch.manual_seed(seed)
    return SurpriseHead()


def step_features(lm, input_ids_B_T, attention_B_T, steps: list[list[tuple[int, int]]]):
    """Every step's features, by batch row then step (``steps``: each row's (first, last) tokens); no gradients."""
    import torch

    with torch.no_grad():
        out = lm(input_ids=input_ids_B_T, attention_mask=attention_B_T, output_hidden_states=True)
        logprobs_B_T = torch.zeros(input_ids_B_T.shape, dtype=torch.float32, device=input_ids_B_T.device)
        logprobs_B_T[:, 1:] = out.logits[:, :-1].float().log_softmax(-1).gather(
            2, input_ids_B_T[:, 1:, None])[..., 0]  # the log-probability of each token written, given what precedes
        hidden_B_T_H = out.hidden_states[-1].float()
    rows = []
    for row, spans in enumerate(steps):
        for first, last in spans:
            written = logprobs_B_T[row, first:last + 1]
            surprise = torch.stack([written.sum(), written.min(), logprobs_B_T[row, last]])
            rows.append(torch.cat([surprise, hidden_B_T_H[row, last], hidden_B_T_H[row, max(last - 1, 0)]]))
    width = SURPRISE_FEATURES + 2 * hidden_B_T_H.shape[-1]
    return torch.stack(rows) if rows else torch.zeros((0, width), device=input_ids_B_T.device)


def save_head(head, path: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous().cpu() for k, v in head.state_dict().items()}, str(Path(path) / HEAD_FILE))
    (Path(path) / HEAD_CONFIG).write_text(json.dumps({"features": int(head.mean.shape[0]), "hidden": HIDDEN}),
                                          encoding="utf-8")


def load_head(path: Path):
    from safetensors.torch import load_file

    config = json.loads((Path(path) / HEAD_CONFIG).read_text(encoding="utf-8"))
    head = surprise_head(config["features"], seed=0)
    head.load_state_dict(load_file(str(Path(path) / HEAD_FILE)))
    return head.eval()
