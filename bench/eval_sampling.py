"""Evaluation sampling: k attempts per prompt in one batched call vs a per-prompt,
per-attempt loop (aim: at least 5x).

    python bench/eval_sampling.py [--loop-prompts 64] [--repeats 3] [--growth-repeats 5]

Both sample from the quickstart's untrained tiny model (as ``eval_base`` does) at the
quickstart's eval settings: temperature 1.0, top_p 1.0, 8 new tokens at most, 8 attempts,
on held-out arithmetic prompts, one torch thread.

- batched: ``HFEngine(model, tokenizer, 64).generate(prompts, settings)``, what
  the eval stage calls (64 is the stage's default ``prompt_batch_size``): every attempt of
  64 prompts in one ``model.generate`` call with ``num_return_sequences``.
- loop: ``model.generate`` once per prompt per attempt, with the same sampling arguments,
  and the same per-sample work after it (token ids cut at end-of-turn, the tokens'
  log-probabilities under the sampling distribution, decoded text, truncation flag), so
  the two differ only in batching.

The comparison runs on the first ``--loop-prompts`` prompts (the loop is slow), alternating
batched and loop, with the median of the per-round ratios. Then, as growth data, the
batched backend on all 200 prompts at 1, 4, 8 and 16 attempts (alternating too).

Last line: ``eval_batched_vs_loop_speedup`` = loop seconds / batched seconds.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common

SAMPLING = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 8, "attempts": 8, "seed": 1}  # the quickstart's
PROMPT_BATCH = 64  # EvalConfig.prompt_batch_size's default


def loop_generate(model, tokenizer, prompts: list[list[dict]], settings) -> list[list]:
    """One ``generate`` call per prompt per attempt, keeping what the backend keeps per sample."""
    import torch

    from stages.engines.interface import Sample

    torch.manual_seed(settings.seed)
    tokenizer.padding_side = "left"
    eos = tokenizer.eos_token_id
    results = []
    for prompt in prompts:
        text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        encoded = tokenizer(text, return_tensors="pt", add_special_tokens=False).to(model.device)
        group = []
        for _ in range(settings.attempts):
            with torch.no_grad():
                out = model.generate(**encoded, do_sample=True, temperature=settings.temperature,
                                     top_p=settings.top_p, top_k=None, max_new_tokens=settings.max_tokens,
                                     num_return_sequences=1, return_dict_in_generate=True, output_scores=True,
                                     pad_token_id=tokenizer.pad_token_id, eos_token_id=eos)
            ids_T = out.sequences[0, encoded["input_ids"].shape[1]:]
            logprobs_T = torch.log_softmax(torch.stack(out.scores, dim=1)[0].float(), dim=-1)
            logprobs_T = logprobs_T.gather(-1, ids_T.unsqueeze(-1)).squeeze(-1)
            ids = ids_T.tolist()
            end = ids.index(eos) + 1 if eos in ids else len(ids)
            group.append(Sample(text=tokenizer.decode(ids[: end - (eos in ids)], skip_special_tokens=True),
                                token_ids=ids[:end], logprobs=logprobs_T[:end].tolist(), truncated=eos not in ids))
        results.append(group)
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--loop-prompts", type=int, default=64, help="prompts in the batched-vs-loop race")
    parser.add_argument("--repeats", type=int, default=3, help="alternating rounds of batched vs loop")
    parser.add_argument("--growth-repeats", type=int, default=5, help="alternating rounds of the growth data")
    args = parser.parse_args()

    home = _common.isolated_home()
    _common.one_thread()
    from stages.data.sources import prompt_messages, read_materialized
    from stages.engines.hf_generate import HFEngine
    from stages.sampling import SamplingSettings
    from stages.models.loading import load_model_and_tokenizer

    checkpoint = _common.tiny_checkpoint(home)
    heldout = read_materialized(_common.arithmetic_data(home, 200, role="heldout", seed=999))
    prompts = [prompt_messages(r) for r in heldout]
    model, tokenizer = load_model_and_tokenizer(checkpoint, for_generation=True)
    backend = HFEngine(model, tokenizer, PROMPT_BATCH)
    settings = SamplingSettings(**SAMPLING)
    few = prompts[: args.loop_prompts]
    k = settings.attempts

    print(f"tiny quickstart model (untrained), temperature {settings.temperature}, {settings.max_tokens} tokens, "
          f"{k} attempts, 1 thread", flush=True)
    print(f"batched backend vs per-prompt, per-attempt loop on {len(few)} prompts ({len(few) * k} completions):",
          flush=True)
    race = _common.interleaved({"batched": lambda: backend.generate(few, settings) and None,
                                "loop": lambda: loop_generate(model, tokenizer, few, settings) and None},
                               args.repeats)
    tokens = sum(len(s.token_ids) for group in backend.generate(few, settings) for s in group) / (len(few) * k)
    for name in race:
        print(f"  {name:<8} {_common.spread(race[name])}  = "
              f"{len(few) * k / _common.median(race[name]):.0f} completions/s")
    print(f"  mean completion length {tokens:.1f} tokens (an untrained model rarely stops early)")

    print(f"growth: batched backend on all {len(prompts)} prompts, by attempts:", flush=True)
    counts = (1, 4, 8, 16)
    growth = _common.interleaved(
        {f"k={n}": (lambda n=n: backend.generate(prompts, settings.model_copy(update={"attempts": n})) and None)
         for n in counts}, args.growth_repeats)
    base = _common.median(growth["k=1"])
    for n in counts:
        seconds = _common.median(growth[f"k={n}"])
        print(f"  attempts {n:>2}: {_common.spread(growth[f'k={n}'])}  {seconds / base:5.2f}x the k=1 time  "
              f"{1000 * seconds / (len(prompts) * n):.2f} ms per completion")
    print(f"eval_batched_vs_loop_speedup={_common.paired_ratio(race['loop'], race['batched']):.2f}")


if __name__ == "__main__":
    main()
