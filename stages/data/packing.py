"""Packed SFT rows that keep documents apart: tokenise, pack best-fit decreasing, collate (docs/algorithms.md)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

IGNORE_INDEX = -100


def training_chat_template(tokenizer, assistant_only_loss: bool) -> str | None:
    """None for the tokenizer's own template, or TRL's variant with `{% generation %}` markers where assistant-only
    loss needs them; warns, as TRL does, when the assistant's end-of-turn token would carry no loss."""
    from trl.chat_template_utils import (
        get_training_chat_template,
        has_generation_markers,
        is_chat_template_stop_token_trained,
    )

    if not assistant_only_loss:
        return None
    template = None if has_generation_markers(tokenizer.chat_template) else get_training_chat_template(tokenizer)
    if not is_chat_template_stop_token_trained(tokenizer, chat_template=template):
        warnings.warn(
            "the chat template leaves the assistant's end-of-turn token out of the loss: the model may not "
            "learn to stop; put it inside {% generation %}...{% endgeneration %} or set assistant_only_loss: false",
            stacklevel=2,
        )
    return template


def tokenize_conversations(
    conversations: list[list[dict]], tokenizer, assistant_only_loss: bool
) -> dict[str, list[list[int]]]:
    """`input_ids` and `labels` (-100 where no loss) of each conversation, unpacked and untruncated."""
    encoded = tokenizer.apply_chat_template(
        conversations, chat_template=training_chat_template(tokenizer, assistant_only_loss),
        tokenize=True, return_dict=True, return_assistant_tokens_mask=assistant_only_loss,
    )
    input_ids = [list(ids) for ids in encoded["input_ids"]]
    if not assistant_only_loss:
        return {"input_ids": input_ids, "labels": [list(ids) for ids in input_ids]}
    labels = []
    for index, (ids, mask) in enumerate(zip(input_ids, encoded["assistant_masks"])):
        if 1 not in mask:
            raise ValueError(
                f"conversation {index} has no assistant tokens to train on: its chat template marks none "
                "(no assistant turn, or no {% generation %} span); fix the data or set assistant_only_loss: false"
            )
        labels.append([t if m else IGNORE_INDEX for t, m in zip(ids, mask)])
    return {"input_ids": input_ids, "labels": labels}


def pack_documents(documents: dict[str, list[list[int]]], max_length: int):
    """Packed rows: `input_ids`, `labels` (documents, at most `max_length` tokens), `seq_lengths` (in order)."""
    from datasets import Dataset
    from trl import pack_dataset

    kept = {"input_ids": [], "labels": []}
    for ids, labels in zip(documents["input_ids"], documents["labels"]):
        labels = labels[:max_length]
        if any(label != IGNORE_INDEX for label in labels[1:]):  # the first token is never predicted
            kept["input_ids"].append(ids[:max_length])
            kept["labels"].append(labels)
    if not kept["input_ids"]:
        raise ValueError(f"no conversation has a trained token within max_length ({max_length}) tokens")
    # One map batch over everything, so best-fit sees all documents (TRL's default is 1000 at a time).
    map_kwargs = {"batch_size": len(kept["input_ids"]), "desc": f"Packing into rows of {max_length} tokens"}
    return pack_dataset(Dataset.from_dict(kept), max_length, "bfd", map_kwargs)


def block_causal_mask(segment_ids_B_T):
    """`[B, 1, T, T]` booleans: query t may attend key s iff s <= t and both are in one segment."""
    import torch

    T = segment_ids_B_T.shape[1]
    same_segment = segment_ids_B_T[:, None, :, None] == segment_ids_B_T[:, None, None, :]
    return same_segment & torch.ones(T, T, dtype=torch.bool, device=segment_ids_B_T.device).tril()


@dataclass
class PackedRowCollator:
    """Packed rows -> fixed `B x max_length` batches with per-document positions and masks."""

    pad_token_id: int
    max_length: int
    block_mask: bool = True  # build the 4D mask here (SDPA); else transformers derives it from position_ids
    count_tokens: bool = False  # add `num_real_tokens` (documents' tokens, not padding) for the trainer to pop

    def __call__(self, rows: list[dict]) -> dict:
        import torch

        B, T = len(rows), self.max_length
        input_ids_B_T = np.full((B, T), self.pad_token_id, dtype=np.int64)
        labels_B_T = np.full((B, T), IGNORE_INDEX, dtype=np.int64)
        segment_lengths = []
        for b, row in enumerate(rows):
            n = len(row["input_ids"])
            input_ids_B_T[b, :n] = row["input_ids"]
            labels_B_T[b, :n] = row["labels"]
            segment_lengths.extend(row["seq_lengths"])
            if n < T:
                segment_lengths.append(T - n)  # the padding: a segment of its own
        lengths = np.asarray(segment_lengths)
        starts = np.cumsum(lengths) - lengths
        position_ids_B_T = (np.arange(B * T) - np.repeat(starts, lengths)).reshape(B, T)
        segment_ids_B_T = np.repeat(np.arange(len(lengths)), lengths).reshape(B, T)
        labels_B_T[position_ids_B_T == 0] = IGNORE_INDEX  # never predict a document from the one before
        batch = {
            "input_ids": torch.from_numpy(input_ids_B_T),
            "labels": torch.from_numpy(labels_B_T),
            "position_ids": torch.from_numpy(position_ids_B_T),
        }
        if self.block_mask:
            batch["attention_mask"] = block_causal_mask(torch.from_numpy(segment_ids_B_T))
        if self.count_tokens:
            batch["num_real_tokens"] = torch.tensor(sum(len(row["input_ids"]) for row in rows))
        return batch

