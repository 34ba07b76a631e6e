"""The ``reward_model`` stage at ``level: step``: a process reward model (PRM); design in docs/algorithms.md."""

from __future__ import annotations

import random
import re
import time
from pathlib import Path

from stages.context import StageInputs
from stages.data.sources import read_materialized


def step_examples(config, inputs: StageInputs, tokenizer, records: list[dict] | None = None) -> list[dict]:
    """One example per demonstration with labelled steps (``records`` replace the stage data's): input ids, labels
    (1 right, 0 wrong at each step's last token, -100 elsewhere), the record, step spans, (first, last) tokens."""
    from stages.rewards.reward_model import step_model_inputs
    from stages.rewards.steps import step_token_indices

    if records is None:
        records = [r for r in read_materialized(inputs.data) if r["messages"][-1]["role"] == "assistant"]
    if not records:
        raise ValueError(f"stage data {inputs.data} holds no conversation that ends in an assistant turn to label")
    prompts = [r["messages"][:-1] for r in records]
    completions = [r["messages"][-1]["content"] for r in records]
    examples = []
    for record, prompt, completion, steps in zip(records, prompts, completions,
                                                 step_labels(config, inputs, records, completions)):
        prompt_ids, completion_ids = step_model_inputs(tokenizer, prompt, completion)
        if not steps or not completion_ids:
            continue
        ids = (prompt_ids + completion_ids)[: config.max_length]
        labels = [-100] * len(ids)
        kept, step_tokens, first = [], [], len(prompt_ids)
        for step, token in zip(steps, step_token_indices(tokenizer, completion_ids, [s.end for s in steps])):
            if len(prompt_ids) + token < len(ids):
                labels[len(prompt_ids) + token] = int(step.score >= 1.0)
                kept.append(int(step.score >= 1.0))
                step_tokens.append((min(first, len(prompt_ids) + token), len(prompt_ids) + token))
                first = len(prompt_ids) + token + 1
        if kept:
            examples.append({"input_ids": ids, "labels": labels, "step_labels": kept, "record": record,
                             "spans": [(step.start, step.end) for step in steps], "step_tokens": step_tokens})
    if not examples:
        raise ValueError(f"no demonstration of stage data {inputs.data} has a step within max_length "
                         f"{config.max_length} tokens")
    return examples


TRAILING_NUMBER = re.compile(r"(-?\d+)$")


def counterfactual_records(examples: list[dict], copies: int, seed: int) -> list[dict]:
    """``copies`` of each example with one step's last number moved by 1, to be relabelled (never assumed wrong)."""
    rng = random.Random(seed)
    made = []
    for example in examples:
        text = example["record"]["messages"][-1]["content"]
        numbered = [(a, b) for a, b in example["spans"] if TRAILING_NUMBER.search(text[a:b])]
        for _ in range(copies if numbered else 0):
            start, end = rng.choice(numbered)
            found = TRAILING_NUMBER.search(text[start:end])
            number = int(found[1])
            moved = number + 1 if number == 0 else number + rng.choice((-1, 1))
            changed = text[:start + found.start(1)] + str(moved) + text[end:]
            messages = [*example["record"]["messages"][:-1], {"role": "assistant", "content": changed}]
            made.append({**example["record"], "messages": messages})
    return made


def step_labels(config, inputs: StageInputs, records: list[dict], completions: list[str]) -> list[list]:
    """Each demonstration's steps (StepScores, 1.0 right), by the ``labels`` reward or the file's ratings (+1 right)."""
    from stages.rewards.scoring import reward_columns, score_component
    from stages.rewards.steps import StepScore, split_steps

    if config.labels is None:
        if any("step_ratings" not in r for r in records):
            raise ValueError(f"stage data {inputs.data} is not step-rated (`records: steps`) and the stage names no "
                             "`labels` reward")
        return [[StepScore(a, b, 1.0 if rating > 0 else 0.0)
                 for (a, b), rating in zip(split_steps(text, "lines"), r["step_ratings"])]
                for text, r in zip(completions, records)]
    spec = inputs.rewards[config.labels]
    prompts = [r["messages"][:-1] for r in records]
    labelled = score_component(config.labels, spec, completions, reward_columns(records, prompts, 1))
    if labelled.steps is None:
        raise ValueError(f"reward {config.labels!r} (fn {spec.fn}) scored no steps: `labels` must name a process "
                         "reward, one that returns step scores (e.g. fn chain_steps)")
    return labelled.steps


def heldout_metrics(model, tokenizer, examples: list[dict]) -> dict[str, float]:
    """A token classifier's ``step_metrics`` on ``examples``: P(right) read at each step's last token."""
    import torch

    model.eval()
    probabilities = []
    for example in examples:
        with torch.no_grad():
            right = model(input_ids=torch.tensor([example["input_ids"]])).logits[0].float().softmax(-1)[:, 1]
        probabilities.append([float(right[last]) for _, last in example["step_tokens"]])
    return step_metrics(probabilities, examples)


def step_metrics(probabilities: list[list[float]], examples: list[dict]) -> dict[str, float]:
    """From each step's P(right): accuracy (right when > 0.5) beside the majority baseline, the share of right
    steps, precision and recall on wrong steps, and the first-wrong-step detection rate."""
    correct = total = right_steps = detected = with_wrong = 0
    flagged = flagged_wrong = 0  # steps predicted wrong, and of those the truly wrong
    for right, example in zip(probabilities, examples):
        predicted = [int(p > 0.5) for p in right]
        truth = example["step_labels"]
        correct += sum(p == t for p, t in zip(predicted, truth))
        total += len(truth)
        right_steps += sum(truth)
        flagged += predicted.count(0)
        flagged_wrong += sum(p == 0 and t == 0 for p, t in zip(predicted, truth))
        if 0 in truth:
            with_wrong += 1
            detected += (0 in predicted and predicted.index(0) == truth.index(0))
    share = right_steps / max(total, 1)
    wrong_steps = total - right_steps
    return {"heldout_step_accuracy": correct / max(total, 1), "heldout_right_step_share": share,
            "heldout_majority_accuracy": max(share, 1 - share) if total else 0.0,
            "heldout_wrong_step_recall": flagged_wrong / wrong_steps if wrong_steps else 0.0,
            "heldout_wrong_step_precision": flagged_wrong / flagged if flagged else 0.0,
            "heldout_first_wrong_step_detection": detected / with_wrong if with_wrong else 0.0,
            "heldout_steps": float(total)}


def class_weights(config, train: list[dict]) -> list[float] | None:
    """(wrong, right) cross-entropy weights, total / (2 x count) each under ``step_class_weights: balanced``."""
    if config.step_class_weights == "none":
        return None
    right = sum(sum(e["step_labels"]) for e in train)
    total = sum(len(e["step_labels"]) for e in train)
    wrong = total - right
    if not right or not wrong:
        raise ValueError(f"step_class_weights balanced needs right and wrong steps among the training "
                         f"demonstrations; they hold {right} right and {wrong} wrong")
    return [total / (2 * wrong), total / (2 * right)]


def weighted_token_loss(weights: list[float]):
    """A Trainer ``compute_loss_func``: class-weighted cross-entropy over the labelled tokens."""
    import torch

    def loss(outputs, labels, num_items_in_batch=None):
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs.logits
        weight = torch.tensor(weights, dtype=logits.dtype, device=logits.device)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                 weight=weight, ignore_index=-100)

    return loss


def _token_classifier(inputs: StageInputs, tokenizer, seed: int):
    """The policy's backbone with a new right/wrong head over every token (initialised from ``seed``)."""
    import torch
    from transformers import AutoModelForTokenClassification

    torch.manual_seed(seed)  # the new head
    model = AutoModelForTokenClassification.from_pretrained(inputs.model, num_labels=2,
                                                            trust_remote_code=inputs.trust_remote_code)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.config.id2label, model.config.label2id = {0: "wrong", 1: "right"}, {"wrong": 0, "right": 1}
    return model


def _training_data_params(train: list[dict], counterfactuals: list[dict], weights) -> dict:
    """What the step scorer trains on: demonstrations, counterfactual copies, the wrong steps' share, the weights."""
    steps = sum(len(e["step_labels"]) for e in train)
    return {"train_demonstrations": len(train), "counterfactual_demonstrations": len(counterfactuals),
            "train_wrong_step_share": 1 - sum(sum(e["step_labels"]) for e in train) / max(steps, 1),
            "class_weights": "none" if weights is None else f"wrong {weights[0]:.3f}, right {weights[1]:.3f}"}


def train_step_scorer(config, inputs: StageInputs, ctx) -> dict:
    from transformers import AutoTokenizer

    from stages.data.preferences import split_heldout

    tokenizer = AutoTokenizer.from_pretrained(inputs.model, trust_remote_code=inputs.trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    examples = step_examples(config, inputs, tokenizer)
    train, heldout = split_heldout(examples, config.heldout_fraction, ctx.seed)
    made = counterfactual_records(train, config.counterfactual_steps, ctx.seed) if config.counterfactual_steps else []
    counterfactuals = step_examples(config, inputs, tokenizer, made) if made else []
    train = train + counterfactuals  # the held-out demonstrations stay as the data has them
    ctx.log_params({"demonstrations": len(examples), "heldout_demonstrations": len(heldout), "resolved_seed": ctx.seed,
                    "step_head": config.step_head, **_training_data_params(train, counterfactuals,
                                                                           class_weights(config, train))})
    if config.step_head == "surprise":
        return train_surprise_head(config, inputs, ctx, tokenizer, train, heldout)
    return train_token_classifier(config, inputs, ctx, tokenizer, train, heldout)


def train_token_classifier(config, inputs: StageInputs, ctx, tokenizer, train: list[dict], heldout: list[dict]) -> dict:
    """``step_head: token``: the whole token classifier trained by TRL's Trainer."""
    from datasets import Dataset
    from transformers import DataCollatorForTokenClassification, Trainer, TrainingArguments

    from stages.models.lora import save_trained
    from stages.training.callbacks import device_arguments, metric_renamer, quiet_trainer, schedule_arguments, \
        tracking_callback
    from stages.training.resume import resumable_arguments, train_measured

    seed = ctx.seed
    model = _token_classifier(inputs, tokenizer, seed)

    schedule = {k: v for k, v in schedule_arguments(config).items() if k != "max_length"}
    args = TrainingArguments(**resumable_arguments(ctx.resume_dir, config.save_steps), **schedule,
                             logging_steps=config.logging_steps, report_to="none", seed=seed, data_seed=seed,
                             dataloader_num_workers=0, remove_unused_columns=False, **device_arguments())
    dataset = Dataset.from_list([{"input_ids": e["input_ids"], "labels": e["labels"]} for e in train])
    weights = class_weights(config, train)
    trainer = Trainer(model=model, args=args, train_dataset=dataset,
                      compute_loss_func=weighted_token_loss(weights) if weights else None,
                      data_collator=DataCollatorForTokenClassification(tokenizer),
                      callbacks=[tracking_callback(ctx, metric_renamer({"loss": "loss", "grad_norm": "grad_norm",
                                                                        "learning_rate": "lr"}),
                                                   f"step reward model: {config.max_steps} steps")])
    quiet_trainer(trainer)

    metrics: dict[str, float] = {}
    if heldout:
        metrics["initial_heldout_step_accuracy"] = heldout_metrics(model, tokenizer, heldout)["heldout_step_accuracy"]
    metrics.update(train_measured(trainer, ctx))
    if heldout:
        metrics.update(heldout_metrics(trainer.model, tokenizer, heldout))
    ctx.log_metrics(metrics)
    outputs = save_trained(trainer.model, tokenizer, ctx, padding_side="right", final_loss=metrics["final_loss"])
    return {**outputs, "metrics": metrics}


def _surprise_features(lm, tokenizer, examples: list[dict], batch_size: int = 32):
    """Every step's surprise features (stages/rewards/step_surprise.py), in order, and its label (1 right)."""
    import torch

    from stages.rewards.reward_model import right_padded
    from stages.rewards.step_surprise import step_features

    device = next(lm.parameters()).device
    features, labels = [], []
    for start in range(0, len(examples), batch_size):
        batch = examples[start:start + batch_size]
        input_ids, attention = right_padded([e["input_ids"] for e in batch], tokenizer.pad_token_id or 0)
        features.append(step_features(lm, input_ids.to(device), attention.to(device),
                                      [e["step_tokens"] for e in batch]).cpu())
        labels += [label for e in batch for label in e["step_labels"]]
    return torch.cat(features), torch.tensor(labels)


def _per_example(probabilities_S: list[float], examples: list[dict]) -> list[list[float]]:
    grouped, at = [], 0
    for example in examples:
        grouped.append(probabilities_S[at:at + len(example["step_tokens"])])
        at += len(example["step_tokens"])
    return grouped


def train_surprise_head(config, inputs: StageInputs, ctx, tokenizer, train: list[dict], heldout: list[dict]) -> dict:
    """``step_head: surprise``: the frozen LM reads each demonstration once, a small head learns P(right) from it."""
    import torch
    from transformers import AutoModelForCausalLM, get_scheduler

    from stages.models.lora import save_trained
    from stages.rewards.step_surprise import save_head, surprise_head

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # for the LM's one read; the head on CPU
    lm = AutoModelForCausalLM.from_pretrained(inputs.model, trust_remote_code=inputs.trust_remote_code).eval()
    started = time.perf_counter()
    features_S_F, labels_S = _surprise_features(lm.to(device), tokenizer, train)
    head = surprise_head(features_S_F.shape[1], ctx.seed)
    head.mean.copy_(features_S_F.mean(0))
    head.scale.copy_(features_S_F.std(0).clamp_min(1e-6))
    weights = class_weights(config, train)
    weight = torch.tensor(weights) if weights else None
    heldout_features = _surprise_features(lm, tokenizer, heldout)[0] if heldout else None

    def heldout_now() -> dict[str, float]:
        with torch.no_grad():
            right = head(heldout_features).softmax(-1)[:, 1].tolist()
        return step_metrics(_per_example(right, heldout), heldout)

    metrics: dict[str, float] = {}
    if heldout:
        metrics["initial_heldout_step_accuracy"] = heldout_now()["heldout_step_accuracy"]
    optimizer = torch.optim.AdamW(head.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    scheduler = get_scheduler(config.lr_schedule, optimizer, round(config.warmup_ratio * config.max_steps),
                              config.max_steps)
    generator = torch.Generator().manual_seed(ctx.seed)
    order, at, losses = torch.randperm(len(labels_S), generator=generator), 0, []
    with ctx.progress(f"step reward model (surprise head): {config.max_steps} steps", config.max_steps) as bar:
        for step in range(1, config.max_steps + 1):
            if at + config.batch_size > len(order):
                order, at = torch.randperm(len(labels_S), generator=generator), 0
            batch = order[at:at + config.batch_size]
            at += config.batch_size
            loss = torch.nn.functional.cross_entropy(head(features_S_F[batch]), labels_S[batch], weight=weight)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            losses.append(loss.item())
            if step % config.logging_steps == 0:
                ctx.log_metrics({"loss": sum(losses[-config.logging_steps:]) / config.logging_steps,
                                 "lr": scheduler.get_last_lr()[0]}, step=step)
            bar.advance()
    metrics.update({"train_seconds": time.perf_counter() - started, "train_loss": sum(losses) / len(losses),
                    "first_loss": losses[0], "final_loss": losses[-1], "steps": float(config.max_steps),
                    "resumed_from_step": 0.0})
    if heldout:
        metrics.update(heldout_now())
    ctx.log_metrics(metrics)
    outputs = save_trained(lm.cpu(), tokenizer, ctx, padding_side="right", final_loss=metrics["final_loss"])
    save_head(head, Path(outputs["checkpoint"]))
    return {**outputs, "metrics": metrics}
