"""Packed SFT rows (stages/data/packing.py): the fast path computes the plain path's loss,
documents never see each other, prompts carry no loss, and the sft stage trains with it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stages.data.sources import ArithmeticData, generate_arithmetic, materialize
from stages.data.packing import (
    IGNORE_INDEX,
    PackedRowCollator,
    pack_documents,
    tokenize_conversations,
)
from stages.sft import SFTStageConfig
from stages.context import StageInputs

MAX_LENGTH = 128


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run faster on one thread, and far faster when other jobs share the cores
    (spinning OpenMP threads on a busy 2-core box, as in tests/test_ppo.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """Two layers, so a leak across documents would compound through the residual stream."""
    from stages.models.loading import TinyModelSpec, resolve_base_checkpoint

    cache = tmp_path_factory.mktemp("packing-models")
    spec = TinyModelSpec(init="tiny", hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)
    return resolve_base_checkpoint(spec, 0, cache, cache)


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint)


def load_model(checkpoint, attn_implementation="sdpa"):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation=attn_implementation)
    return model.eval()


def conversations(n, seed=0):
    """Arithmetic chats of varied lengths (1- to 3-digit operands, three operators)."""
    spec = ArithmeticData(generator="arithmetic", n=n, seed=seed, role="train", max_operand=999, ops=["+", "-", "*"])
    return [record["messages"] for record in generate_arithmetic(spec)]


@pytest.fixture(scope="module")
def packed(tokenizer):
    chats = conversations(60)
    documents = tokenize_conversations(chats, tokenizer, assistant_only_loss=True)
    rows = pack_documents(documents, MAX_LENGTH)
    return chats, documents, rows


def row_documents(row):
    """(start, end) of each document in a packed row."""
    spans, start = [], 0
    for length in row["seq_lengths"]:
        spans.append((start, start + length))
        start += length
    return spans


def unpacked_nll(model, rows):
    """Summed next-token loss and trained-token count of every document run alone (the plain path)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for row in rows:
            for start, end in row_documents(row):
                ids = torch.tensor(row["input_ids"][start:end])[None]
                labels = torch.tensor(row["labels"][start:end])
                logits = model(input_ids=ids).logits[0, :-1]
                targets = labels[1:]
                keep = targets != IGNORE_INDEX
                total += torch.nn.functional.cross_entropy(logits[keep], targets[keep], reduction="sum").item()
                count += int(keep.sum())
    return total, count


def test_best_fit_rows_hold_every_document_once_within_max_length(tokenizer, packed):
    chats, documents, rows = packed
    assert all(len(row["input_ids"]) <= MAX_LENGTH for row in rows)
    assert all(sum(row["seq_lengths"]) == len(row["input_ids"]) == len(row["labels"]) for row in rows)
    unpacked = sorted(tuple(ids) for ids in documents["input_ids"])
    repacked = sorted(tuple(row["input_ids"][a:b]) for row in rows for a, b in row_documents(row))
    assert repacked == unpacked
    fill = sum(len(row["input_ids"]) for row in rows) / (len(rows) * MAX_LENGTH)
    assert len(rows) <= len(chats) / 3 and fill > 0.8  # several documents per row, little padding


@pytest.mark.parametrize("attn_implementation, block_mask", [("sdpa", True), ("sdpa", False), ("eager", False)])
def test_packed_loss_equals_token_weighted_loss_of_documents_alone(checkpoint, tokenizer, packed,
                                                                   attn_implementation, block_mask):
    """block_mask: our 4D mask; without it transformers builds the blocks from position_ids
    (only when no cache is passed: training, use_cache=False)."""
    _, _, rows = packed
    model = load_model(checkpoint, attn_implementation)
    batch_rows = [rows[i] for i in range(6)]
    batch = PackedRowCollator(tokenizer.pad_token_id, MAX_LENGTH, block_mask=block_mask)(batch_rows)
    assert batch["input_ids"].shape == (6, MAX_LENGTH)
    with torch.no_grad():
        packed_loss = model(**batch, use_cache=False).loss.item()  # as trainers call it: no cache
        unmasked_loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss.item()
    total, count = unpacked_nll(model, batch_rows)
    assert count == int((batch["labels"] != IGNORE_INDEX).sum())
    assert packed_loss == pytest.approx(total / count, rel=1e-5, abs=1e-6)
    assert abs(unmasked_loss - total / count) > 1e-3  # plain causal attention over the row is not the same


def test_the_stage_trainer_computes_the_same_loss_and_counts_real_tokens(checkpoint, tokenizer, packed, tmp_path):
    """Through TRL's fused LM head as the sft stage runs it (PackedSFTTrainer.compute_loss)."""
    from trl import SFTConfig

    from stages.sft import packed_sft_trainer_class

    _, _, rows = packed
    model = load_model(checkpoint).train()
    collator = PackedRowCollator(tokenizer.pad_token_id, MAX_LENGTH, count_tokens=True)
    args = SFTConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", max_steps=1,
                     per_device_train_batch_size=6, dataset_kwargs={"skip_prepare_dataset": True})
    trainer = packed_sft_trainer_class()(model=model, args=args, train_dataset=rows, processing_class=tokenizer,
                                         data_collator=collator)
    batch_rows = [rows[i] for i in range(6, 12)]
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, collator(batch_rows)).item()
    total, count = unpacked_nll(load_model(checkpoint), batch_rows)
    assert loss == pytest.approx(total / count, rel=1e-5, abs=1e-6)
    assert trainer._metrics["train"]["num_tokens"] == [sum(len(row["input_ids"]) for row in batch_rows)]


def test_no_document_attends_to_another(checkpoint, tokenizer, packed):
    _, _, rows = packed
    model = load_model(checkpoint)
    row = next(r for r in rows if len(r["seq_lengths"]) >= 3)
    (a_start, a_end), (b_start, b_end) = row_documents(row)[:2]
    collate = PackedRowCollator(tokenizer.pad_token_id, MAX_LENGTH)
    batch = collate([row])
    perturbed = dict(row, input_ids=list(row["input_ids"]))
    perturbed["input_ids"][a_start + 1 : a_end] = [tokenizer.convert_tokens_to_ids("7")] * (a_end - a_start - 1)
    perturbed_batch = collate([perturbed])
    with torch.no_grad():
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits[0]
        perturbed_logits = model(**{k: v for k, v in perturbed_batch.items() if k != "labels"}).logits[0]
        causal = model(input_ids=batch["input_ids"]).logits[0]
        causal_perturbed = model(input_ids=perturbed_batch["input_ids"]).logits[0]
    assert not torch.allclose(logits[a_start:a_end], perturbed_logits[a_start:a_end])  # document A did change
    torch.testing.assert_close(logits[b_start:], perturbed_logits[b_start:], rtol=0, atol=1e-6)  # B and later: not
    assert not torch.allclose(causal[b_start:b_end], causal_perturbed[b_start:b_end])  # unmasked rows would leak


def test_prompt_tokens_and_document_starts_carry_no_loss(tokenizer, packed):
    chats, _, rows = packed
    answers = {}
    for messages in chats:
        prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
        answers.setdefault(prompt, set()).add(messages[-1]["content"] + "<|end|>")
    batch = PackedRowCollator(tokenizer.pad_token_id, MAX_LENGTH)(list(rows)[:8])
    for b, row in enumerate(list(rows)[:8]):
        for start, end in row_documents(row):
            ids, labels = batch["input_ids"][b, start:end].tolist(), batch["labels"][b, start:end].tolist()
            assert labels[0] == IGNORE_INDEX and batch["position_ids"][b, start] == 0
            trained = [t for t, label in zip(ids, labels) if label != IGNORE_INDEX]
            assert trained == [label for label in labels if label != IGNORE_INDEX]  # labels are the tokens
            prompt_len = labels.index(next(label for label in labels if label != IGNORE_INDEX))
            prompt = tokenizer.decode(ids[:prompt_len])
            assert tokenizer.decode(trained) in answers[prompt]  # the whole answer and <|end|>, nothing else
        assert (batch["labels"][b, len(row["input_ids"]) :] == IGNORE_INDEX).all()  # padding


def test_documents_longer_than_a_row_are_truncated_and_untrainable_ones_dropped(tokenizer):
    long_chat = [{"role": "user", "content": "x" * 200}, {"role": "assistant", "content": "1"}]
    short_chat = [{"role": "user", "content": "What is 1+1?"}, {"role": "assistant", "content": "2"}]
    documents = tokenize_conversations([long_chat, short_chat], tokenizer, assistant_only_loss=True)
    rows = pack_documents(documents, MAX_LENGTH)
    assert [list(row["seq_lengths"]) for row in rows] == [[len(documents["input_ids"][1])]]
    with pytest.raises(ValueError, match="no assistant tokens"):
        tokenize_conversations([[{"role": "user", "content": "hi"}]], tokenizer, assistant_only_loss=True)


def test_sft_stage_with_packing_trains_and_logs_real_token_counts(checkpoint, ctx_factory, home):
    from stages import sft

    data = materialize(ArithmeticData(generator="arithmetic", n=300, role="train"), Path("."), home / "data")
    ctx = ctx_factory("sft-packed")
    config = SFTStageConfig(kind="sft", data="train", packing=True, max_steps=60, batch_size=8, max_length=MAX_LENGTH,
                            lr=5e-3, logging_steps=10)
    outputs = sft.run(config, StageInputs(model=checkpoint, datasets={"data": data}), ctx)
    metrics = outputs["metrics"]
    assert metrics["steps"] == 60
    assert metrics["final_loss"] < 0.6 * metrics["first_loss"]
    params = ctx.recorded_run().data.params
    assert int(params["packed_rows"]) < 300 / 2 and params["dropped_examples"] == "0"
    tokens = ctx.metric_history("num_tokens")
    assert len(tokens) == 6 and 0.8 * 60 * 8 * MAX_LENGTH < tokens[-1].value <= 60 * 8 * MAX_LENGTH
    assert ctx.metric_history("mean_token_accuracy")
