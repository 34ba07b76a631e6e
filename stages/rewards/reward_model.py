"""Scoring completions with a trained reward model (the ``reward_model`` reward): everything that
scores with one imports it from here, so no stage kind imports stages/reward_model.py."""

from __future__ import annotations

from pathlib import Path

from stages.context import StageInputs
from stages.models.loading import load_sequence_scorer
from stages.rewards.scoring import ScoredBatch
from stages.rewards.spec import REWARD_MODEL_FN, RewardSpec


def right_padded(sequences: list[list[int]], pad_id: int):
    """(input ids, attention mask) of token sequences padded on the right, as reward models are trained."""
    import torch

    width = max(len(ids) for ids in sequences)
    input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, ids in enumerate(sequences):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention[row, : len(ids)] = 1
    return input_ids, attention


class RewardModelScorer:
    """Batched scores of (prompt, completion) pairs by a trained reward model."""

    def __init__(self, path: Path, batch_size: int = 64, trust_remote_code: bool = False, where: str = "policy"):
        """``where``: its placement; the scores come back on the CPU wherever it runs."""
        import torch

        from stages.models.placement import place

        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # where its inputs are made
        self.model, self.tokenizer = load_sequence_scorer(path, trust_remote_code)
        self.model = place(self.model.eval().requires_grad_(False), where, self.device)
        self.batch_size = batch_size

    def raw_scores(self, prompts: list[list[dict]], completions: list[str]) -> list[float]:
        """One score per completion: the model's output at the last token of prompt + reply."""
        import torch

        tok = self.tokenizer
        sequences = [
            tok.apply_chat_template(list(prompt) + [{"role": "assistant", "content": text}], tokenize=True,
                                    return_dict=True)["input_ids"]
            for prompt, text in zip(prompts, completions)
        ]
        scores: list[float] = []
        for start in range(0, len(sequences), self.batch_size):
            input_ids, attention = right_padded(sequences[start : start + self.batch_size], tok.pad_token_id)
            with torch.no_grad():
                logits = self.model(input_ids=input_ids.to(self.device),
                                    attention_mask=attention.to(self.device)).logits
            scores.extend(logits[:, 0].float().cpu().tolist())
        return scores


class RewardModelReward:
    """A reward function around a scorer, with the spec's offset or running normalisation (stage-long state)."""

    def __init__(self, scorer: RewardModelScorer, spec: RewardSpec):
        from stages.preference_math import RunningMeanStd

        self.scorer, self.spec = scorer, spec
        self.running = RunningMeanStd() if spec.normalize == "running" else None

    def __call__(self, completions: list[str], prompts: list[list[dict]] | None = None, **_) -> list[float]:
        if prompts is None:
            raise ValueError("the reward_model reward needs the prompts column to score completions")
        scores = [s - self.spec.offset for s in self.scorer.raw_scores(prompts, completions)]
        if self.spec.normalize == "group":
            return centre_per_prompt(scores, prompts)
        return self.running.normalise(scores) if self.running is not None else scores


def centre_per_prompt(scores: list[float], prompts: list[list[dict]]) -> list[float]:
    """Each score minus the mean score of the completions that answer the same prompt."""
    import json

    keys = [json.dumps(p, sort_keys=True) for p in prompts]
    totals: dict[str, list[float]] = {}
    for key, score in zip(keys, scores):
        totals.setdefault(key, []).append(score)
    means = {key: sum(values) / len(values) for key, values in totals.items()}
    return [score - means[key] for key, score in zip(keys, scores)]


def is_step_scorer(path: Path) -> bool:
    """Whether a reward_model stage's checkpoint scores steps (``level: step``)."""
    import json

    from stages.rewards.step_surprise import has_surprise_head

    if has_surprise_head(path):
        return True
    config = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    return any(name.endswith("ForTokenClassification") for name in config.get("architectures") or [])


def step_model_inputs(tokenizer, prompt: list[dict], completion: str) -> tuple[list[int], list[int]]:
    """(prompt ids through the chat template, the completion's own ids): a step reward model's input, always."""
    prompt_ids = tokenizer.apply_chat_template(list(prompt), tokenize=True, add_generation_prompt=True,
                                               return_dict=True)["input_ids"]
    return list(prompt_ids), tokenizer(completion, add_special_tokens=False)["input_ids"]


class StepRewardModel:
    """A process reward from a ``level: step`` reward_model stage: each step (split by ``kwargs``) scored with
    P(right); the completion's score is the mean over its steps (0 with none, and unparsed)."""

    def __init__(self, path: Path, spec: RewardSpec, trust_remote_code: bool = False, where: str = "policy"):
        import torch
        from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

        from stages.models.placement import place
        from stages.rewards.step_surprise import has_surprise_head, load_head

        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        self.head = load_head(path).to(self.device) if has_surprise_head(path) else None
        loader = AutoModelForCausalLM if self.head is not None else AutoModelForTokenClassification
        model = loader.from_pretrained(path, trust_remote_code=trust_remote_code)
        self.model = place(model.eval().requires_grad_(False), where, self.device)
        self.split = {key: spec.kwargs[key] for key in ("split", "delimiter") if key in spec.kwargs}
        self.batch_size = spec.batch_size

    def step_probabilities(self, prompts: list[list[dict]], completions: list[str], ends: list[list[int]]):
        """For each completion, P(right) of each step ending at the given characters."""
        import torch

        from stages.rewards.steps import step_token_indices

        rows = []
        for prompt, text, step_ends in zip(prompts, completions, ends):
            prompt_ids, completion_ids = step_model_inputs(self.tokenizer, prompt, text)
            tokens = step_token_indices(self.tokenizer, completion_ids, step_ends) if completion_ids else []
            rows.append((prompt_ids + completion_ids, [len(prompt_ids) + t for t in tokens], len(prompt_ids)))
        found = []
        for start in range(0, len(rows), self.batch_size):
            batch = rows[start:start + self.batch_size]
            input_ids, attention = right_padded([ids for ids, _, _ in batch], self.tokenizer.pad_token_id or 0)
            input_ids, attention = input_ids.to(self.device), attention.to(self.device)
            if self.head is not None:
                found += self._surprise_probabilities(input_ids, attention, batch)
                continue
            with torch.no_grad():
                logits = self.model(input_ids=input_ids, attention_mask=attention).logits
            right = logits.float().softmax(-1)[..., 1].cpu()
            found += [[float(right[row, t]) for t in positions] for row, (_, positions, _) in enumerate(batch)]
        return found

    def _surprise_probabilities(self, input_ids, attention, batch) -> list[list[float]]:
        """P(right) of each step from the surprise head (a step: from after the previous step's last token)."""
        import torch

        from stages.rewards.step_surprise import step_features

        steps = []
        for _, positions, first in batch:
            spans = []
            for last in positions:
                spans.append((min(first, last), last))
                first = last + 1
            steps.append(spans)
        with torch.no_grad():
            right = self.head(step_features(self.model, input_ids, attention, steps)).softmax(-1)[:, 1].cpu().tolist()
        grouped, at = [], 0
        for spans in steps:
            grouped.append(right[at:at + len(spans)])
            at += len(spans)
        return grouped

    def __call__(self, completions: list[str], prompts: list[list[dict]] | None = None, **_):
        from stages.rewards.spec import RewardOutput
        from stages.rewards.steps import StepScore, split_steps

        if prompts is None:
            raise ValueError("a step reward model needs the prompts column to score completions")
        spans = [split_steps(text, **self.split) for text in completions]
        probabilities = self.step_probabilities(prompts, completions, [[end for _, end in s] for s in spans])
        steps = [[StepScore(a, b, p) for (a, b), p in zip(s, ps)] for s, ps in zip(spans, probabilities)]
        return RewardOutput([sum(ps) / len(ps) if ps else 0.0 for ps in probabilities], [bool(s) for s in spans],
                            steps=steps)


def bind_reward_models(rewards: dict[str, RewardSpec], inputs: StageInputs, where: str = "policy",
                       open_model_judge=None) -> dict:
    """Every ``fn: reward_model`` reward (each model loaded once, placed per ``where``) and ``fn: judge`` bound."""
    from stages.rewards.judge import bind_judges

    loaded: dict[str, RewardModelScorer] = {}
    bound = {}
    for name, spec in rewards.items():
        if spec.fn != REWARD_MODEL_FN:
            continue
        path = inputs.scorer_checkpoint(name, f"scores with stage {spec.stage!r}")
        if is_step_scorer(path):
            bound[name] = StepRewardModel(path, spec, inputs.trust_remote_code, where)
            continue
        if path not in loaded:
            loaded[path] = RewardModelScorer(path, spec.batch_size, inputs.trust_remote_code, where)
        bound[name] = RewardModelReward(loaded[path], spec)
    return {**bound, **bind_judges(rewards, inputs, open_model_judge)}


def reward_model_correlations(scored: ScoredBatch, rewards: dict[str, RewardSpec]) -> dict[str, float]:
    """``reward/<rm>/corr/<other>``: each reward model's Pearson correlation with each other reward (if both vary)."""
    from stages.preference_math import pearson

    learned = [c for c in scored.components if rewards[c.name].fn == REWARD_MODEL_FN]
    others = [c for c in scored.components if rewards[c.name].fn != REWARD_MODEL_FN]
    metrics = {}
    for rm in learned:
        for other in others:
            value = pearson(rm.scores, other.scores)
            if value is not None:
                metrics[f"reward/{rm.name}/corr/{other.name}"] = value
    return metrics
