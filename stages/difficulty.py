"""An ``rl`` stage's difficulty filter: train on prompts the starting policy sometimes solves (docs/algorithms.md)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import ClassVar

from pydantic import ConfigDict, Field, model_validator

from stages.context import StageInputs
from stages.data.sources import prompt_messages, read_materialized
from stages.rollout.episodes import complete
from stages.engines.opening import open_engine
from stages.engines.settings import BackendName
from stages.sampling import SamplingSettings, sampling_with
from stages.spec_model import SpecModel

KEPT_FILE = "difficulty_kept.jsonl"
TABLE_FILE = "difficulty.json"


class DifficultyFilterEmpty(RuntimeError):
    """The filter left too few prompts to train on."""


def _filter_rules(sampling: SamplingSettings) -> SamplingSettings:
    if "temperature" in sampling.model_fields_set and sampling.temperature == 0:
        raise ValueError("temperature must be above 0 for a difficulty filter: greedy attempts of a prompt are all "
                         "alike, so every pass rate would be 0 or 1")
    if sampling.attempts < 2:
        raise ValueError(f"attempts must be at least 2 to measure a pass rate between 0 and 1 (got {sampling.attempts})")
    return sampling


FILTER_DEFAULTS = {"attempts": 8}
FILTER_SAMPLING = sampling_with(FILTER_DEFAULTS, _filter_rules)


class DifficultyFilter(SpecModel):
    """Before training, keep only the prompts the starting policy solves sometimes but not always."""

    model_config = ConfigDict(extra="forbid")
    renamed: ClassVar[dict[str, str]] = {"attempts": "sampling.attempts"}

    sampling: FILTER_SAMPLING = Field(
        default_factory=lambda: SamplingSettings(**FILTER_DEFAULTS), description="The sampling schema: attempts "
        "(k, default 8), temperature, top_p, max_tokens, seed, stop; every field but attempts left out is the "
        "stage's rollout setting (its `sampling:` and seed).")
    min_pass: float = Field(0.0, ge=0.0, le=1.0, description="Keep a prompt only if its pass rate is above this "
                            "(exclusive; 0 drops prompts never solved).")
    max_pass: float = Field(1.0, ge=0.0, le=1.0, description="Keep a prompt only if its pass rate is below this "
                            "(exclusive; 1 drops prompts always solved).")
    max_prompts: int | None = Field(
        None, ge=1, description="Score only the first N prompts of the dataset (for cost); the rest are neither "
        "scored nor trained on.")
    verifier: str | None = Field(None, description="The reward that decides an attempt is correct; one of the "
                                 "stage's `rewards`, default the first.")
    success_threshold: float = Field(1.0, description="An attempt is correct when the verifier scores at least this.")
    backend: BackendName | None = Field(
        None, description="Generation backend: `hf`, `vllm`, or `auto` (vLLM wherever it can serve the model, else "
        "hf); default the stage's rollout `backend` (and its `engine` settings), or `auto`.")
    prompt_batch_size: int = Field(64, ge=1, description="Prompts per generate call (each with all its attempts).")

    @model_validator(mode="after")
    def _bounds_ordered(self):
        if self.min_pass >= self.max_pass:
            raise ValueError(f"min_pass ({self.min_pass}) must be below max_pass ({self.max_pass}): a prompt is kept "
                             "when min_pass < pass rate < max_pass, so these bounds keep nothing")
        return self

    def settings(self, stage, seed: int) -> SamplingSettings:
        """The attempts' sampling settings, unset fields taken from the rl stage ``stage``."""
        own = self.sampling
        return stage.sampling.seeded(seed, **{name: getattr(own, name) for name in own.model_fields_set})


def pass_rates(correct: list[bool], k: int) -> list[float]:
    """Per prompt, the share of its k consecutive attempts that are correct."""
    return [sum(correct[i : i + k]) / k for i in range(0, len(correct), k)]


def verdict(rate: float, min_pass: float, max_pass: float) -> str:
    """``kept`` when min_pass < rate < max_pass, else ``too_easy`` or ``too_hard``."""
    if rate >= max_pass:
        return "too_easy"
    if rate <= min_pass:
        return "too_hard"
    return "kept"


def filter_prompts(config, inputs: StageInputs, ctx) -> Path:
    """The file of ``inputs.data``'s records kept under ``inputs.policy``; ``config``: the rl stage's."""
    spec: DifficultyFilter = config.difficulty_filter
    records = read_materialized(inputs.data)
    if spec.max_prompts:
        records = records[: spec.max_prompts]
    prompts = [prompt_messages(r) for r in records]
    sampling = spec.settings(config, ctx.seed)
    verifier = spec.verifier or config.rewards[0]
    k = sampling.attempts

    started = time.perf_counter()
    samples = _sample(config, inputs, ctx, prompts, sampling, verifier)

    correct, errors = score_attempts(config, inputs, records, prompts, samples, verifier, spec.success_threshold)
    rates = pass_rates(correct, k)
    verdicts = [verdict(rate, spec.min_pass, spec.max_pass) for rate in rates]
    seconds = time.perf_counter() - started
    kept = [record for record, v in zip(records, verdicts) if v == "kept"]
    metrics = {
        "difficulty/prompts_scored": float(len(records)),
        "difficulty/kept": float(len(kept)),
        "difficulty/kept_frac": len(kept) / len(records) if records else 0.0,
        "difficulty/too_easy": float(verdicts.count("too_easy")),
        "difficulty/too_hard": float(verdicts.count("too_hard")),
        "difficulty/pass_mean": sum(rates) / len(rates) if rates else 0.0,
        "difficulty/seconds": seconds,
        "difficulty/generated_tokens": float(sum(len(s.token_ids) for group in samples for s in group)),
        "difficulty/reward_errors": float(len(errors)),
    }
    ctx.log_metrics(metrics)
    ctx.log_table([{"prompt": p[-1]["content"], "answer": r.get("answer"), "pass_rate": rate,
                    "correct": round(rate * k), "verdict": v}
                   for p, r, rate, v in zip(prompts, records, rates, verdicts)], TABLE_FILE)

    _require_enough(config, kept, records, verdicts, k, verifier)
    path = ctx.output_file(KEPT_FILE)
    with open(path, "w", encoding="utf-8") as handle:
        for record in kept:
            handle.write(json.dumps(record) + "\n")
    return path


def _sample(config, inputs: StageInputs, ctx, prompts: list, sampling, verifier: str):
    """``attempts`` samples of every prompt under the starting policy."""
    spec: DifficultyFilter = config.difficulty_filter
    k = sampling.attempts
    with ctx.progress(f"difficulty filter: {k} attempts x {len(prompts)} prompts", len(prompts)) as bar:
        engine = open_engine(spec.backend or config.backend, inputs.policy,
                             progress=bar, keep_logprobs=False, engine=config.engine,
                             trust_remote_code=inputs.trust_remote_code,
                             prompt_batch_size=spec.prompt_batch_size)
        try:
            samples = complete(engine, prompts, sampling)
        finally:
            engine.close()
    ctx.log_params({"difficulty/resolved_backend": engine.name, "difficulty/backend_reason": engine.why,
                    "difficulty/dtype_reason": engine.dtype_why,
                    "difficulty/resolved_verifier": verifier,
                    **{f"difficulty/sampling/{key}": value for key, value in sampling.identity().items()}})
    return samples


def _require_enough(config, kept: list[dict], records: list[dict], verdicts: list[str], k: int, verifier: str) -> None:
    """Refuse to train on fewer prompts than one step needs, saying why they were dropped."""
    spec: DifficultyFilter = config.difficulty_filter
    needed = config.prompts_per_step if config.algorithm == "grpo" else 1
    if len(kept) < needed:
        raise DifficultyFilterEmpty(
            f"difficulty_filter kept {len(kept)} of {len(records)} prompts scored ({verdicts.count('too_easy')} too "
            f"easy: pass rate >= max_pass {spec.max_pass}; {verdicts.count('too_hard')} too hard: pass rate <= "
            f"min_pass {spec.min_pass}; {k} attempts each, verifier {verifier!r})"
            + (f", and {config.algorithm} needs at least prompts_per_step ({needed}) distinct prompts per step"
               if needed > 1 else "")
            + ": widen min_pass/max_pass, raise attempts or max_prompts, or start from another policy")


def score_attempts(config, inputs: StageInputs, records: list[dict], prompts: list, samples, verifier: str,
                   threshold: float) -> tuple[list[bool], list[tuple[int, str]]]:
    """(whether the verifier calls each attempt correct, prompt-major; its exceptions), scored as every stage
    scores: an attempt whose reward raised is not correct; ``reward_errors`` decides if the stage goes on."""
    from stages.scorers import bind_scorers
    from stages.rewards.scoring import reward_columns
    from stages.rewards.scoring import RewardErrorPolicy, Scorer

    k = len(samples[0]) if samples else 0
    texts = [s.text for group in samples for s in group]
    specs = {verifier: inputs.rewards[verifier]}
    scorer = Scorer(specs, RewardErrorPolicy.of(config), bind_scorers(specs, inputs))
    component = scorer.score(texts, reward_columns(records, prompts, k)).components[0]
    failed = {index for index, _ in component.errors}
    return [score >= threshold and i not in failed for i, score in enumerate(component.scores)], component.errors
