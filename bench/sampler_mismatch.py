"""How far the rollout engine's samples are from the trainer's distribution, and what the correction does.

    python bench/sampler_mismatch.py                 # SmolLM2-135M, chain_sum prompts, this CPU
    python bench/sampler_mismatch.py --prompts 64 --attempts 8

The smollm2-reasoning pipeline samples its GRPO rollouts with vLLM in bfloat16 (AMX on this CPU)
and trains in float32. This script samples the pipeline's rollout settings (temperature 1.0, 24
tokens, chain_sum prompts rendered with SmolLM2's chat template) from vLLM in bfloat16 and, as the
control, in float32; scores every sampled token under the float32 trainer (the tempered
distribution the loss differentiates); and prints, per engine, what ``sampler_correction``
(stages/rl_math.py) logs in a training step: mean |logp_trainer - logp_sampler| per token,
KL(sampler || trainer) per token, and for each correction (token_tis and sequence_mask at cap 3,
and none) the mean weight and the fraction truncated or dropped. The ratios bf16 / fp32 compare
the two engines on the same prompts in one process.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import isolated_home, print_summary  # noqa: E402
from bench.backends import smollm2_and_prompts  # noqa: E402


def trainer_logprobs(model, prompt_ids: list[int], sample, temperature: float):
    """The float32 trainer's log-probs of ``sample``'s tokens after ``prompt_ids`` (logits / temperature)."""
    import torch

    ids = torch.tensor([list(prompt_ids) + list(sample.token_ids)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt_ids):, None]).squeeze(-1)


def batch_tensors(pairs):
    """(trainer B x T, sampler B x T, mask B x T) right-padded from (trainer, sample) pairs."""
    import torch

    width = max(len(s.token_ids) for _, s in pairs)
    trainer, sampler, mask = (torch.zeros(len(pairs), width) for _ in range(3))
    for row, (logps, sample) in enumerate(pairs):
        n = len(sample.token_ids)
        trainer[row, :n], sampler[row, :n], mask[row, :n] = logps, torch.tensor(sample.logprobs), 1.0
    return trainer, sampler, mask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--attempts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    home = isolated_home()
    from stages.models.loading import load_model_and_tokenizer
    from stages.rl_math import sampler_correction
    from stages.engines.settings import EngineSettings
    from stages.engines.opening import open_engine
    from stages.engines.interface import prompt_token_ids
    from stages.sampling import SamplingSettings

    checkpoint, prompts = smollm2_and_prompts(home, args.prompts)
    model, tokenizer = load_model_and_tokenizer(checkpoint)
    model.float().eval()
    prompt_ids = prompt_token_ids(tokenizer, prompts)
    settings = SamplingSettings(temperature=args.temperature, max_tokens=args.max_tokens, attempts=args.attempts,
                                seed=1)
    engines = {}
    for dtype in ("bfloat16", "float32"):
        engine = open_engine("vllm", checkpoint, engine=EngineSettings(dtype=dtype))
        groups = engine.generate_ids(prompt_ids, settings)
        engine.close()
        pairs = [(trainer_logprobs(model, ids, sample, args.temperature), sample)
                 for ids, group in zip(prompt_ids, groups) for sample in group if sample.token_ids]
        trainer, sampler, mask = batch_tensors(pairs)
        measured = {"samples": len(pairs), "tokens": int(mask.sum())}
        for kind in ("none", "token_tis", "sequence_mask"):
            _, metrics = sampler_correction(trainer, sampler, mask, kind, 3.0)
            if kind == "none":
                measured.update(logp_diff_abs_mean=metrics["correction/logp_diff_abs_mean"],
                                kl_sampler_trainer=metrics["correction/kl_sampler_trainer"])
            measured[kind] = {"weight_mean": round(metrics["correction/weight_mean"], 5),
                              "clipped_frac": round(metrics["correction/clipped_frac"], 5)}
        engines[dtype] = measured
        print(dtype, json.dumps(measured), flush=True)
    summary = {"model": "SmolLM2-135M-Instruct", "trainer_dtype": "float32", "prompts": len(prompts),
               "attempts": args.attempts, "max_tokens": args.max_tokens, "temperature": args.temperature,
               "engines": engines,
               "bf16_over_fp32": {key: round(engines["bfloat16"][key] / max(abs(engines["float32"][key]), 1e-12), 1)
                                  for key in ("logp_diff_abs_mean", "kl_sampler_trainer")}}
    print_summary(summary, args.out)


if __name__ == "__main__":
    main()
