"""LLM-as-judge (``fn: judge``) and the audit of a judge against a verifier or a reward model (docs/algorithms.md)."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from stages.context import StageInputs
from stages.rewards.registry import import_dotted
from stages.rewards.scoring import ComponentScores, ScoredBatch
from stages.rewards.spec import JUDGE_FN, JUDGE_SCALE, REWARD_MODEL_FN, RewardOutput, RewardSpec

JUDGE_PASS = 0.5  # a judge's (scaled) score at or above this is a pass
VERIFIER_FNS = {"exact_answer": 0.5, "math_answer": 0.5, "code_tests": 0.5, "reasoning_gym": 0.5,
                REWARD_MODEL_FN: 0.0}  # the scorers a judge is audited against, and where each passes
AUDIT_ROWS = 200  # disagreeing examples kept per (judge, verifier) table

_YES_NO = re.compile(r"\W*(yes|no)\b", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def read_judgement(reply: str, scale: str) -> float | None:
    """The reply's score in [0, 1] on ``scale``, or None when the reply does not give one."""
    if scale == "yes_no":
        match = _YES_NO.match(reply)
        return None if match is None else float(match[1].lower() == "yes")
    low, high = (int(x) for x in JUDGE_SCALE.fullmatch(scale).groups())
    match = _NUMBER.search(reply)
    if match is None or not low <= float(match[0]) <= high:
        return None
    return (float(match[0]) - low) / (high - low)


def render_rubric(rubric: str, prompt: list[dict] | None, completion: str, answer: str | None) -> str:
    """The judge's message: the rubric with its placeholders filled (other braces are left alone)."""
    user_turns = "\n".join(t["content"] for t in (prompt or []) if t.get("role") == "user")
    return (rubric.replace("{prompt}", user_turns).replace("{answer}", "" if answer is None else str(answer))
            .replace("{completion}", completion))


@dataclass
class Verdict:
    reply: str
    score: float | None  # None: the reply could not be read


class ReplyCache:
    """Judge replies on disk by the rendered message, one JSONL file per judge key (appended to)."""

    def __init__(self, directory: Path | None, key: str):
        self.path = directory / f"{key}.jsonl" if directory is not None else None
        self.replies: dict[str, str] = {}
        if self.path is not None and self.path.exists():
            for line in self.path.read_text(encoding="utf-8").splitlines():
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:  # a line cut short by a killed writer: asked again
                    continue
                self.replies[entry["message"]] = entry["reply"]

    def add(self, replies: dict[str, str]) -> None:
        self.replies.update(replies)
        if self.path is not None and replies:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as handle:
                handle.write("".join(json.dumps({"message": m, "reply": r}) + "\n" for m, r in replies.items()))


class JudgeReward:
    """A ``fn: judge`` reward: ``(completions, prompts, answer) -> RewardOutput``; ``last``: its last verdicts."""

    def __init__(self, spec: RewardSpec, ask: Callable[[list[list[dict]]], list[str]], cache: ReplyCache):
        self.spec, self.ask, self.cache = spec, ask, cache
        self.last: list[Verdict] = []
        self.asked = 0  # judge messages sent (not answered from the cache)

    def __call__(self, completions: list[str], prompts: list[list[dict]] | None = None,
                 answer: list[str | None] | None = None, **_) -> RewardOutput:
        n = len(completions)
        messages = [render_rubric(self.spec.rubric, (prompts or [None] * n)[i], completions[i],
                                  (answer or [None] * n)[i]) for i in range(n)]
        missing = list(dict.fromkeys(m for m in messages if m not in self.cache.replies))
        if missing:
            replies = self.ask([[{"role": "user", "content": m}] for m in missing])
            if len(replies) != len(missing):
                raise RuntimeError(f"judge answered {len(replies)} of {len(missing)} messages")
            self.asked += len(missing)
            self.cache.add(dict(zip(missing, (str(r) for r in replies))))
        self.last = [Verdict(self.cache.replies[m], read_judgement(self.cache.replies[m], self.spec.scale))
                     for m in messages]
        errors = [(i, f"judge reply {v.reply[:200]!r} is not on scale {self.spec.scale}")
                  for i, v in enumerate(self.last) if v.score is None]
        return RewardOutput([v.score if v.score is not None else 0.0 for v in self.last], [True] * n, errors)


def model_identity(checkpoint: Path) -> str:
    """A checkpoint's path and its files' sizes and modification times: new weights, a new identity."""
    files = sorted(p for p in Path(checkpoint).iterdir() if p.is_file())
    return json.dumps([str(Path(checkpoint).resolve()), [(p.name, p.stat().st_size, p.stat().st_mtime_ns)
                                                          for p in files]])


def bind_judges(rewards: dict[str, RewardSpec], inputs: StageInputs,
                open_model_judge: Callable | None = None) -> dict[str, JudgeReward]:
    """Every ``fn: judge`` reward bound; ``open_model_judge(spec, checkpoint, trust_remote_code) -> (ask, backend)``."""
    cache_dir = inputs.judge_cache
    bound = {}
    for name, spec in rewards.items():
        if spec.fn != JUDGE_FN:
            continue
        if spec.judge_fn is not None:
            ask, identity = import_dotted(spec.judge_fn, "judge_fn"), f"fn:{spec.judge_fn}"
        else:
            checkpoint = inputs.scorer_checkpoint(name, f"is judged by {spec.stage or 'its model'!r}")
            trusted = getattr(spec.model, "trust_remote_code", False) if spec.model else inputs.trust_remote_code
            if open_model_judge is None:
                raise ValueError(f"reward {name!r} is judged by a model, and nothing was given to open one: bind "
                                 "judges with stages/scorers.py bind_scorers")
            ask, backend = open_model_judge(spec, checkpoint, bool(trusted))
            identity = f"{model_identity(checkpoint)} backend {backend}"
        key = hashlib.sha256(json.dumps([identity, spec.sampling.model_dump(mode="json")]).encode()).hexdigest()[:20]
        bound[name] = JudgeReward(spec, ask, ReplyCache(cache_dir, key))
    return bound



@dataclass
class Audit:
    judge: str
    verifier: str
    counts: dict[str, int]  # both_pass, judge_only, verifier_only, both_fail, judge_errors
    disagreements: list[dict]  # prompt, completion, judge_reply, judge_score, verifier_score

    @property
    def agreement(self) -> float | None:
        audited = sum(v for k, v in self.counts.items() if k != "judge_errors")
        return (self.counts["both_pass"] + self.counts["both_fail"]) / audited if audited else None

    def metrics(self) -> dict[str, float]:
        prefix = f"audit/{self.judge}/{self.verifier}"
        metrics = {f"{prefix}/{key}": float(value) for key, value in self.counts.items()}
        if self.agreement is not None:
            metrics[f"{prefix}/agreement"] = self.agreement
        return metrics


def audit_judges(rewards: dict[str, RewardSpec], scored: ScoredBatch, judges: dict[str, JudgeReward],
                 prompts: list[list[dict]], completions: list[str]) -> list[Audit]:
    """Each judge against each verifier and reward model that scored the same completions."""
    by_name = {c.name: c for c in scored.components}
    audits = []
    for judge_name, judge in judges.items():
        if judge_name not in by_name or len(judge.last) != len(completions):
            continue  # not scored here, or scored one by one after an exception (its verdicts are partial)
        for name, component in by_name.items():
            threshold = VERIFIER_FNS.get(rewards[name].fn)
            if name == judge_name or threshold is None:
                continue
            errored = {i for i, _ in component.errors}
            audits.append(_audit_pair(judge_name, name, judge.last, component.scores, threshold, errored,
                                      prompts, completions))
    return audits


def _audit_pair(judge_name: str, name: str, verdicts: list[Verdict], verifier_scores: list[float], threshold: float,
                errored: set[int], prompts: list[list[dict]], completions: list[str]) -> Audit:
    counts = {"both_pass": 0, "judge_only": 0, "verifier_only": 0, "both_fail": 0, "judge_errors": 0}
    rows = []
    for i, (verdict, score) in enumerate(zip(verdicts, verifier_scores)):
        if verdict.score is None:
            counts["judge_errors"] += 1
            continue
        if i in errored:  # the verifier raised on it: nothing to compare with
            continue
        judge_pass = verdict.score >= JUDGE_PASS
        verifier_pass = score >= threshold if threshold > 0 else score > threshold
        key = {(True, True): "both_pass", (True, False): "judge_only", (False, True): "verifier_only",
               (False, False): "both_fail"}[(judge_pass, verifier_pass)]
        counts[key] += 1
        if judge_pass != verifier_pass and len(rows) < AUDIT_ROWS:
            prompt = prompts[i][-1]["content"] if prompts[i] else ""
            rows.append({"prompt": prompt, "completion": completions[i], "judge_reply": verdict.reply,
                         "judge_score": verdict.score, "verifier_score": score})
    return Audit(judge_name, name, counts, rows)


def log_audits(ctx, audits: list[Audit], suffix: str = "") -> dict[str, float]:
    """Each audit's disagreements as a table artifact (``audit/<judge>_vs_<verifier><suffix>.json``); its metrics."""
    metrics = {}
    for audit in audits:
        metrics.update(audit.metrics())
        if audit.disagreements:
            ctx.log_table(audit.disagreements, f"audit/{audit.judge}_vs_{audit.verifier}{suffix}.json")
    return metrics


class BatchAuditor:
    """Audits every ``audit_every``-th reward batch of an rl stage (``record``: GRPO's; ``record_batch``: PPO's)."""

    def __init__(self, rewards: dict[str, RewardSpec], judges: dict[str, JudgeReward], ctx):
        self.rewards, self.judges, self.ctx = rewards, judges, ctx
        self.every = min(rewards[name].audit_every for name in judges)
        self.batches, self.pending = 0, {}

    def record(self, component: ComponentScores, prompts: list[list[dict]], texts: list[str]) -> None:
        self.pending[component.name] = component
        if len(self.pending) < len(self.rewards):
            return
        scored, self.pending = ScoredBatch([self.pending[name] for name in self.rewards], []), {}
        self.record_batch(scored, prompts, texts)

    def record_batch(self, scored: ScoredBatch, prompts: list[list[dict]], texts: list[str]) -> None:
        self.batches += 1
        if self.batches % self.every == 0:
            audits = audit_judges(self.rewards, scored, self.judges, prompts, texts)
            self.ctx.log_metrics(log_audits(self.ctx, audits, f"_batch_{self.batches:05d}"), step=self.batches)


def batch_auditor(rewards: dict[str, RewardSpec], bound: dict, ctx) -> BatchAuditor | None:
    """An auditor when the stage scores with a judge and something to audit it against, else None."""
    judges = {name: fn for name, fn in bound.items() if isinstance(fn, JudgeReward)}
    verifiers = [name for name, spec in rewards.items() if spec.fn in VERIFIER_FNS]
    return BatchAuditor(rewards, judges, ctx) if judges and verifiers else None
