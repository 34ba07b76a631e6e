"""``posttrain compare``: rank evaluated checkpoints, chart them, and promote the best.

Rows come from the FINISHED eval stage runs of one experiment (one pipeline): each row is
the checkpoint an eval run scored (its upstream stage run), the latest score per checkpoint
and settings. Scores are ranked only within one eval settings hash (``posttrain.eval_settings``:
sampling, data, rewards, verifier): a pass@1 at temperature 1.0 and 8 tokens says nothing
about one at temperature 0.2 and 32 tokens. With several groups every group is shown and
ranked on its own, the output says why, and ``--promote`` refuses until ``--settings``
picks one.

Every score carries its standard error over prompts (``se/<metric>``, logged by the eval
stage) and every row its difference from the leader with a 95% interval, paired prompt by
prompt where both evaluations logged their per-prompt scores (``stages/intervals.py``);
a difference whose interval holds 0 is marked within noise. Checkpoints of one eval stage
and variant (``posttrain.variant``, set by ``posttrain sweep``) are grouped across seeds:
mean, SE over seeds, n, the per-seed figures, and each variant's difference from the best
(a t interval over the seeds both ran). Each group states the smallest difference its
prompt count detects at 80% power.

The table is printed and, with a bar chart (PNG) with 95% error bars, logged to an MLflow run
tagged ``posttrain.role=compare`` in the experiment. ``--promote`` points the registered model
alias ``champion`` (``flows/recording/model_registry.py``) at the best registered checkpoint of
the group, unless its lead over the current champion is within noise (exit 1; ``--force``
promotes anyway and the compare run and the model version record that it was forced).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from flows.recording.home import posttrain_home
from flows.recording.model_registry import CHAMPION, champion_version, ensure_registered, link_eval, promote
from flows.recording.tags import (
    TAG_COMPARE_FORCED,
    TAG_COMPARE_METRIC,
    TAG_COMPARE_PROMOTED,
    TAG_COMPARE_SETTINGS,
    TAG_EVAL_SETTINGS,
    TAG_LINKED_MODEL_ID,
    TAG_MODEL_VERSION,
    TAG_ROLE,
    TAG_ROUND,
    TAG_SEED,
    TAG_STAGE,
    TAG_UPSTREAM,
    TAG_VARIANT,
)
from stages.intervals import (
    Estimate,
    minimum_detectable_difference,
    paired_difference,
    seed_estimate,
    unpaired_se,
    Z_95,
)
from stages.registry import STAGE_KINDS

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2
PER_PROMPT_TABLE = "per_prompt.json"  # = stages.eval.PER_PROMPT_TABLE
NO_VARIANT = "-"
SHOWN_METRICS = ("reward_mean", "format_error_rate")
WHY_NOT_RANKED_TOGETHER = (
    "checkpoints evaluated under different settings are not ranked against each other: a different "
    "temperature, token budget, attempt count, dataset or reward changes what a score means, so "
    "each settings group below is ranked on its own")


@dataclass
class Row:
    """One evaluated checkpoint under one settings hash."""

    stage: str  # the evaluated stage (``base`` for the pipeline's base model)
    eval_stage: str
    eval_run_id: str
    checkpoint_run_id: str | None
    settings: str
    settings_text: str
    round: str
    metrics: dict[str, float]
    started: int
    version: str | None = None  # "NAME/VERSION" of its registered model version
    rank: int = 0
    seed: str = "-"
    variant: str = NO_VARIANT  # the sweep's overrides that reach this checkpoint, "-" outside a sweep
    vs_leader: Estimate | None = None  # this row minus the group's first (None for the first)
    per_prompt: dict | None = field(default=None, repr=False)  # prompt key -> row of per_prompt.json

    def value(self, metric: str) -> float:
        return self.metrics.get(metric, float("-inf"))

    def se(self, metric: str) -> float | None:
        """The eval stage's SE over prompts, or the harness's own for a benchmark (``<metric>_stderr``)."""
        return self.metrics.get(f"se/{metric}", self.metrics.get(f"{metric}_stderr"))

    @property
    def variant_key(self) -> tuple[str, str]:
        return (self.eval_stage, self.variant)


@dataclass
class Variant:
    """One eval stage of one variant across seeds: the unit ``posttrain compare`` aggregates."""

    eval_stage: str
    variant: str
    rows: list[Row]  # one per seed, by seed
    estimate: Estimate | None = None  # the metric over seeds
    vs_best: Estimate | None = None  # this variant minus the best one (None for the best)

    @property
    def label(self) -> str:
        return self.eval_stage if self.variant == NO_VARIANT else f"{self.eval_stage} [{self.variant}]"


@dataclass
class Group:
    settings: str
    settings_text: str
    rows: list[Row] = field(default_factory=list)
    variants: list[Variant] = field(default_factory=list)
    detectable: tuple[float, str] | None = None  # (difference detectable at 80% power, from what)

    def widest_k(self) -> str | None:
        ks = [int(k.rsplit("_", 1)[1]) for r in self.rows for k in r.metrics
              if k.startswith("pass_at_") and k.rsplit("_", 1)[1].isdigit()]
        return f"pass_at_{max(ks)}" if ks and max(ks) > 1 else None


# ------------------------------------------------------------------ gathering


def _settings_text(params: dict[str, str]) -> str:
    if "harness" in params:  # a benchmark stage (stages/benchmark.py)
        return (f"{params['harness']} tasks={params.get('tasks')} fewshot={params.get('num_fewshot')} "
                f"limit={params.get('limit')} chat_template={params.get('apply_chat_template')} "
                f"backend={params.get('backend')}")
    parts = [f"T={params.get('sampling.temperature', '?')}", f"top_p={params.get('sampling.top_p', '?')}",
             f"tokens={params.get('sampling.max_tokens', '?')}", f"attempts={params.get('sampling.attempts', '?')}",
             f"seed={params.get('sampling.seed', '?')}", f"data={params.get('data', '?')}",
             "rewards=" + "".join(c for c in params.get("rewards", "?") if c not in "[]' ")]
    if params.get("max_prompts") not in (None, "None"):
        parts.append(f"prompts={params['max_prompts']}")
    if params.get("select") not in (None, "None"):
        parts.append(f"select={params['select']}")
    return " ".join(parts)


def evaluated_checkpoints(client, experiment_id: str, register_missing: bool = True) -> list[Row]:
    """One row per (checkpoint, settings): the latest FINISHED eval run of it, newest first."""
    runs = sorted((run for kind in STAGE_KINDS.values() if kind.evaluates for run in client.search_runs(
        [experiment_id],
        filter_string=f"tags.`posttrain.role` = 'stage' and tags.`posttrain.kind` = '{kind.name}' "
                      "and attributes.status = 'FINISHED'",
        order_by=["attributes.start_time DESC"], max_results=5000,
    )), key=lambda run: run.info.start_time, reverse=True)  # eval and benchmark runs, newest first
    rows, seen = [], set()
    for run in runs:
        tags, params = run.data.tags, run.data.params
        settings = tags.get(TAG_EVAL_SETTINGS)
        if not settings:
            continue
        stage = params.get("model", "base")
        upstream = json.loads(tags.get(TAG_UPSTREAM, "{}"))  # the checkpoint's run, and a selector's
        checkpoint_run_id = upstream.get(stage)
        models = tuple(sorted(upstream.items())) or f"base:{run.data.tags.get('posttrain.stage')}:{tags.get(TAG_SEED)}"
        key = (models, settings)
        if key in seen:  # an older evaluation of the same checkpoint(s) under the same settings
            continue
        seen.add(key)
        row = Row(stage, tags.get(TAG_STAGE, "?"), run.info.run_id, checkpoint_run_id, settings,
                  _settings_text(params), tags.get(TAG_ROUND, "-"), dict(run.data.metrics), run.info.start_time,
                  seed=tags.get(TAG_SEED, "-"), variant=tags.get(TAG_VARIANT, NO_VARIANT))
        if checkpoint_run_id:
            row.version, round_tag = _registered_version(client, checkpoint_run_id, run, register_missing)
            if row.round == "-" and round_tag:
                row.round = round_tag
        rows.append(row)
    return rows


def _registered_version(client, checkpoint_run_id: str, eval_run, register_missing: bool):
    """("NAME/VERSION" or None, the checkpoint's round tag); registers and links what is missing."""
    from mlflow.exceptions import MlflowException

    try:
        checkpoint = client.get_run(checkpoint_run_id)
    except MlflowException:
        return None, None
    version = checkpoint.data.tags.get(TAG_MODEL_VERSION)
    if register_missing and (version is None or TAG_LINKED_MODEL_ID not in eval_run.data.tags):
        try:
            model_id = ensure_registered(client, checkpoint_run_id)
            if model_id:
                link_eval(client, client.get_run(eval_run.info.run_id), model_id)
            version = client.get_run(checkpoint_run_id).data.tags.get(TAG_MODEL_VERSION)
        except Exception as error:  # a store without a model registry: compare still ranks
            print(f"posttrain compare: could not register the checkpoint of run {checkpoint_run_id}: "
                  f"{type(error).__name__}: {str(error)[:200]}", file=sys.stderr)
    return version, checkpoint.data.tags.get(TAG_ROUND)


def group_by_settings(rows: list[Row], metric: str) -> list[Group]:
    """Groups (largest first), each ranked by ``metric`` (higher is better, newer wins a tie)."""
    groups: dict[str, Group] = {}
    for row in rows:
        groups.setdefault(row.settings, Group(row.settings, row.settings_text)).rows.append(row)
    for group in groups.values():
        group.rows.sort(key=lambda r: (r.value(metric), r.started), reverse=True)
        for i, row in enumerate(group.rows, 1):
            row.rank = i
    return sorted(groups.values(), key=lambda g: (-len(g.rows), g.settings))


# ------------------------------------------------------------------ intervals


def per_prompt_scores(client, row: Row) -> dict | None:
    """Prompt key -> that prompt's row of the eval's ``per_prompt.json``; None for an eval that logged none."""
    if row.per_prompt is None:
        import tempfile

        try:
            with tempfile.TemporaryDirectory() as folder:
                local = client.download_artifacts(row.eval_run_id, PER_PROMPT_TABLE, folder)
                table = json.loads(Path(local).read_text(encoding="utf-8"))
        except Exception:  # evaluated before eval stages logged it, or a benchmark stage
            row.per_prompt = {}
            return None
        columns = table["columns"]  # keyed by position and question: a dataset may hold a question twice
        row.per_prompt = {(i, r[columns.index("prompt")]): dict(zip(columns, r)) for i, r in enumerate(table["data"])}
    return row.per_prompt or None


def difference(client, a: Row, b: Row, metric: str) -> Estimate | None:
    """b - a: paired over the prompts both scored (same settings hash, so the same prompts), else from the
    two logged SEs as if independent (wider), else None."""
    scores_a, scores_b = per_prompt_scores(client, a), per_prompt_scores(client, b)
    if scores_a and scores_b and set(scores_a) == set(scores_b) and all(
            metric in r for r in (*scores_a.values(), *scores_b.values())):
        keys = sorted(scores_a)
        return paired_difference([scores_a[k][metric] for k in keys], [scores_b[k][metric] for k in keys],
                                 [question for _, question in keys])
    if a.se(metric) is None or b.se(metric) is None:
        return None
    mean, se = b.value(metric) - a.value(metric), unpaired_se(a.se(metric), b.se(metric))
    return Estimate(mean, se, 0, mean - Z_95 * se, mean + Z_95 * se, "unpaired z from the logged SEs")


def variants_of(client, group: Group, metric: str) -> list[Variant]:
    """The group's rows by (eval stage, variant), over seeds, best mean first; each with its difference
    from the best: a t interval over the seeds both ran, or for one shared seed the paired prompt interval."""
    by_key: dict[tuple[str, str], dict[str, Row]] = {}
    for row in sorted(group.rows, key=lambda r: r.started):  # a seed evaluated again (a rerun): the newest
        if metric in row.metrics:
            by_key.setdefault(row.variant_key, {})[row.seed] = row
    variants = []
    for (eval_stage, variant), by_seed in by_key.items():
        rows = sorted(by_seed.values(), key=lambda r: (len(r.seed), r.seed))
        variants.append(Variant(eval_stage, variant, rows, seed_estimate([r.value(metric) for r in rows])))
    variants.sort(key=lambda v: v.estimate.mean, reverse=True)
    best = variants[0] if variants else None
    for other in variants[1:]:
        seeds_best = {r.seed: r for r in best.rows}
        shared = [(seeds_best[r.seed], r) for r in other.rows if r.seed in seeds_best]
        if len(shared) >= 2:
            other.vs_best = seed_estimate([b.value(metric) - a.value(metric) for a, b in shared])
        elif shared:
            other.vs_best = difference(client, *shared[0], metric)
    return variants


def add_intervals(client, group: Group, metric: str) -> None:
    """Each row's difference from the leader, the variants over seeds, and what the prompt count can detect."""
    leader = group.rows[0]
    for row in group.rows[1:]:
        if metric in row.metrics and metric in leader.metrics:
            row.vs_leader = difference(client, leader, row, metric)
    group.variants = variants_of(client, group, metric)
    runner_up = group.rows[1].vs_leader if len(group.rows) > 1 else None
    prompts = len(per_prompt_scores(client, leader) or {}) or None
    where = f" with {prompts} prompts" if prompts else ""
    if runner_up is not None and runner_up.n:
        group.detectable = (minimum_detectable_difference(runner_up.se),
                            f"paired, from #1 against #2{where}")
    elif leader.se(metric) is not None:
        group.detectable = (minimum_detectable_difference(unpaired_se(leader.se(metric), leader.se(metric))),
                            f"unpaired, from #1's SE{where}")


# ------------------------------------------------------------------ output


def _fmt(value) -> str:
    return "-" if value is None or value == float("-inf") else f"{value:.3f}"


def with_se(row: Row, name: str) -> str:
    """``0.702 ± 0.021`` (the SE over prompts); ``± ?`` for an evaluation that logged no SE."""
    if name not in row.metrics:
        return "-"
    se = row.se(name)
    return f"{row.metrics[name]:.3f} ± {'?' if se is None else f'{se:.3f}'}"


def difference_text(estimate: Estimate | None) -> str:
    if estimate is None:
        return "-"
    return estimate.text() + (" within noise" if estimate.within_noise else "")


def table_rows(group: Group, metric: str) -> list[dict]:
    k = group.widest_k()
    columns = ["pass_at_1"] + ([k] if k else []) + list(SHOWN_METRICS)
    if metric not in columns:
        columns.insert(0, metric)
    return [{"rank": row.rank, "stage": row.stage, "seed": row.seed, "variant": row.variant, "round": row.round,
             **{c: with_se(row, c) if c.startswith("pass_at_") or c == metric else row.metrics.get(c)
                for c in columns},
             f"vs #1 (95%)": "-" if row.rank == 1 else difference_text(row.vs_leader),
             "settings": row.settings, "version": row.version or "-", "eval run": row.eval_run_id}
            for row in group.rows]


def variant_rows(group: Group, metric: str) -> list[dict]:
    return [{"eval": v.eval_stage, "variant": v.variant, "n": v.estimate.n,
             f"{metric} mean ± SE over seeds": f"{v.estimate.mean:.3f} ± {v.estimate.se:.3f}" if v.estimate.n > 1
             else f"{v.estimate.mean:.3f} (1 seed)",
             "per seed": " ".join(f"{r.seed}:{r.value(metric):.3f}" for r in v.rows),
             "vs best (95%)": "-" if i == 0 else difference_text(v.vs_best) + (
                 f" ({v.vs_best.method})" if v.vs_best else "")}
            for i, v in enumerate(group.variants)]


def print_group(group: Group, metric: str, console, champion: str | None) -> list[dict]:
    from rich.table import Table

    rows = table_rows(group, metric)
    table = Table(title=f"settings {group.settings}: {group.settings_text} · ranked by {metric} "
                        "(± its SE over prompts)")
    # the settings are the title; a seed, variant or round column only where some row has one
    shown = [c for c in rows[0] if c != "settings" and not (
        c in ("seed", "variant", "round") and all(row[c] in ("-", NO_VARIANT) for row in rows))]
    for column in shown:
        # scores and intervals keep their width; names and ids give way on a narrow terminal
        table.add_column(column, no_wrap=True, justify="right" if column not in (
            "stage", "variant", "version", "eval run") else "left",
            min_width=_min_width(column, rows, metric))
    for row in rows:
        cells = [_fmt(row[c]) if isinstance(row[c], float) or row[c] is None else str(row[c]) for c in shown]
        cells[shown.index("eval run")] = cells[shown.index("eval run")][:12]  # compare.json keeps the whole id
        is_champion = champion is not None and row["version"] == champion
        if is_champion:
            cells[shown.index("version")] += f" @{CHAMPION}"
        table.add_row(*cells, style="bold green" if row["rank"] == 1 else None)
    console.print(table)
    if any(v.estimate.n > 1 for v in group.variants):
        by_variant = Table(title=f"settings {group.settings}: by eval stage and variant, over seeds")
        variants = variant_rows(group, metric)
        for column in variants[0]:
            by_variant.add_column(column, justify="left" if column in ("eval", "variant", "per seed") else "right")
        for row in variants:
            by_variant.add_row(*(str(v) for v in row.values()))
        console.print(by_variant)
    return rows


def save_chart(groups: list[Group], metric: str, path: Path, title: str) -> Path:
    """One bar chart per settings group: the ranked checkpoints' ``metric`` with 95% error bars (1.96 SE over
    prompts); beside it, where a group has several seeds of a variant, the variants' means over seeds with
    their 95% t intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seeded = any(v.estimate.n > 1 for g in groups for v in g.variants)
    figure, axes = plt.subplots(len(groups), 2 if seeded else 1, figsize=(
        14 if seeded else 8, 2.6 + 0.45 * max(len(g.rows) for g in groups) * len(groups)), squeeze=False)
    for row_axes, group in zip(axes, groups):
        ax = row_axes[0]
        labels = [f"#{r.rank} {r.stage}" + (f" s{r.seed}" if r.seed != "-" else "")
                  + (f" [{r.variant}]" if r.variant != NO_VARIANT else "")
                  + (f" r{r.round}" if r.round != "-" else "") for r in group.rows][::-1]
        values = [max(r.value(metric), 0.0) for r in group.rows][::-1]
        errors = [Z_95 * (r.se(metric) or 0.0) for r in group.rows][::-1]
        bars = ax.barh(labels, values, xerr=errors, capsize=3,
                       color=["#2b8a3e" if r.rank == 1 else "#7a8ca3" for r in group.rows][::-1])
        ax.bar_label(bars, fmt="%.3f", padding=3)
        ax.set_xlim(0, max(1.0, max((v + e for v, e in zip(values, errors)), default=0) * 1.15))
        ax.set_xlabel(f"{metric} (95% interval over prompts)")
        ax.set_title(f"settings {group.settings}: {group.settings_text}", fontsize=9)
        if seeded:
            _variant_panel(row_axes[1], group, metric)
    figure.suptitle(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def _min_width(column: str, rows: list[dict], metric: str) -> int | None:
    """What a column keeps on a narrow terminal: scores, intervals, stage and variant in full."""
    if column in ("stage", "variant", "vs #1 (95%)"):
        return min(max(len(str(row[column])) for row in rows), 40)
    return 13 if column.startswith("pass_at_") or column == metric else None


def _variant_panel(ax, group: Group, metric: str) -> None:
    variants = group.variants[::-1]
    means = [v.estimate.mean for v in variants]
    errors = [v.estimate.high - v.estimate.mean if v.estimate.n > 1 else 0.0 for v in variants]
    bars = ax.barh([f"{v.label} (n={v.estimate.n})" for v in variants], means, xerr=errors, capsize=3,
                   color="#5c7cfa")
    ax.bar_label(bars, fmt="%.3f", padding=3)
    ax.set_xlim(0, max(1.0, max((m + e for m, e in zip(means, errors)), default=0) * 1.15))
    ax.set_xlabel(f"{metric}: mean over seeds, 95% t interval")
    ax.set_title("by variant, over seeds", fontsize=9)


def log_comparison(client, experiment_id: str, metric: str, groups: list[Group], chart: Path,
                   text: str, chosen: str | None, forced: str | None = None) -> str:
    """A run tagged ``posttrain.role=compare`` holding the table, the chart and the text output."""
    run = client.create_run(experiment_id, run_name=f"compare {time.strftime('%Y-%m-%d %H:%M:%S')}",
                            tags={TAG_ROLE: "compare", TAG_COMPARE_METRIC: metric,
                                  TAG_COMPARE_SETTINGS: ",".join(g.settings for g in groups)})
    run_id = run.info.run_id
    try:
        rows = [row for group in groups for row in table_rows(group, metric)]
        variants = [{"settings": g.settings, **row} for g in groups for row in variant_rows(g, metric)]
        if variants:
            client.log_table(run_id, data={c: [row.get(c) for row in variants] for c in variants[0]},
                             artifact_file="variants.json")
        columns = sorted({k for row in rows for k in row}, key=lambda k: list(rows[0]).index(k)
                         if k in rows[0] else 99)
        client.log_table(run_id, data={c: [row.get(c) for row in rows] for c in columns}, artifact_file="compare.json")
        client.log_artifact(run_id, str(chart))
        client.log_text(run_id, text, "compare.txt")
        if chosen:
            client.set_tag(run_id, TAG_COMPARE_PROMOTED, chosen)
        if forced:
            client.set_tag(run_id, TAG_COMPARE_FORCED, forced)
        client.set_terminated(run_id, "FINISHED")
    except Exception:
        client.set_terminated(run_id, "FAILED")
        raise
    return run_id


# ------------------------------------------------------------------ the command


class _Refused(Exception):
    """``posttrain compare`` cannot go on (exit status 2); the message says why."""


def compare_command(args, console) -> int:
    experiment_name = args.experiment or _pipeline_name(args.file, args.overrides)
    if experiment_name is None:
        return EXIT_BAD_INPUT
    try:
        client, experiment, rows, groups = _select(args, experiment_name)
    except _Refused as error:
        print(f"posttrain compare: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    lines: list[str] = []

    def say(message: str, style: str | None = None) -> None:
        lines.append(message)
        from rich.markup import escape  # a variant's "[...]" is text, not markup

        console.print(f"[{style}]{escape(message)}[/{style}]" if style else message, highlight=False,
                      markup=bool(style))

    shown_rows = sum(len(g.rows) for g in groups)
    say(f"experiment {experiment_name}: {shown_rows} evaluated checkpoint(s) in {len(groups)} settings group(s)"
        + (f" (--settings {args.settings}; {len(rows) - shown_rows} more under other settings)"
           if args.settings else ""))
    if len(groups) > 1:
        say(f"not ranked together: {WHY_NOT_RANKED_TOGETHER}.", "bold yellow")
    champions = _champions(client, groups)
    for group in groups:
        add_intervals(client, group, args.metric)
        shown = print_group(group, args.metric, console, _champion_of(group, champions))
        lines.extend(json.dumps(row) for row in shown)
        lines.extend(json.dumps(row) for row in variant_rows(group, args.metric) if len(group.variants) > 1)
        if group.detectable:
            detectable, how = group.detectable
            say(f"settings {group.settings}: the smallest difference in {args.metric} this evaluation detects at "
                f"80% power is {detectable:.3f} ({how}); to detect less, evaluate on more prompts")
        noisy = [_who(r) for r in group.rows[1:] if r.vs_leader is not None and r.vs_leader.within_noise]
        if noisy:
            say(f"settings {group.settings}: within noise of #1 {_who(group.rows[0])} (95% interval of the "
                f"difference holds 0): {', '.join(noisy)}", "yellow")
    default_chart = posttrain_home() / "compare" / experiment_name / f"compare-{args.metric}.png"
    chart = Path(args.output) if args.output else default_chart
    save_chart(groups, args.metric, chart, f"{experiment_name}: {args.metric} by eval settings")
    say(f"chart: {chart}")
    code, promoted, forced = _promote(args, client, groups, say)
    run_id = log_comparison(client, experiment.experiment_id, args.metric, groups, chart, "\n".join(lines), promoted,
                            forced)
    console.print(f"logged to MLflow run {run_id} (experiment {experiment.experiment_id})")
    return code


def _who(row: Row) -> str:
    """A row in words: its stage, and its seed and variant where it has them."""
    return row.stage + (f" seed {row.seed}" if row.seed != "-" else "") + (
        f" [{row.variant}]" if row.variant != NO_VARIANT else "")


def _select(args, experiment_name: str):
    """(client, experiment, every evaluated checkpoint, the settings groups to show); _Refused if none."""
    from mlflow.tracking import MlflowClient

    from flows.recording.store import TrackingUnavailable, check_reachable

    try:
        check_reachable()
    except TrackingUnavailable as error:
        raise _Refused(str(error)) from None
    client = MlflowClient()
    experiment = client.get_experiment_by_name(experiment_name)
    if experiment is None:
        raise _Refused(f"no MLflow experiment {experiment_name!r}: run the pipeline first (`posttrain run FILE`)")
    rows = evaluated_checkpoints(client, experiment.experiment_id)
    if not rows:
        raise _Refused(f"experiment {experiment_name!r} has no finished eval stage runs: nothing to compare")
    groups = group_by_settings(rows, args.metric)
    if args.settings:
        groups = [g for g in groups if g.settings.startswith(args.settings)]
        if len(groups) != 1:
            known = ", ".join(g.settings for g in group_by_settings(rows, args.metric))
            raise _Refused(f"--settings {args.settings} matches {len(groups)} settings groups; the groups are: "
                           f"{known}")
    if not any(args.metric in r.metrics for g in groups for r in g.rows):
        names = sorted({k for g in groups for r in g.rows for k in r.metrics})
        raise _Refused(f"no evaluated checkpoint has metric {args.metric!r}; the eval runs log: {', '.join(names)}")
    # a group that never measured the metric (a benchmark's, ranking by pass_at_1) has nothing to rank
    groups = [g for g in groups if any(args.metric in r.metrics for r in g.rows)]
    return client, experiment, rows, groups


def _champions(client, groups: list[Group]) -> dict[str, str | None]:
    """Registered model name -> its current champion version (``NAME/VERSION``), for the models shown."""
    champions = {}
    for group in groups:
        for row in group.rows:
            name = row.version.split("/")[0] if row.version else None
            if name and name not in champions:
                current = champion_version(client, name)
                champions[name] = f"{name}/{current.version}" if current else None
    return champions


def _promote(args, client, groups: list[Group], say) -> tuple[int, str | None, str | None]:
    """(exit status, the version promoted, why it was forced); refused: status 2 for mixed settings, 1 for a
    lead within noise."""
    if not args.promote:
        return EXIT_OK, None, None
    if len(groups) > 1:
        hashes = ", ".join(f"{g.settings} ({g.settings_text})" for g in groups)
        print(f"posttrain compare: --promote refused: the evaluated checkpoints fall in {len(groups)} settings "
              f"groups ({hashes}), and scores from different settings are not comparable. Pick the group "
              f"to promote from with --settings HASH (e.g. --settings {groups[0].settings}).", file=sys.stderr)
        return EXIT_BAD_INPUT, None, None
    return _promote_best(client, groups[0], args.metric, say, getattr(args, "force", False))


def _champion_of(group: Group, champions: dict) -> str | None:
    names = {r.version.split("/")[0] for r in group.rows if r.version}
    return next((champions[n] for n in names if champions.get(n)), None)


def _promote_best(client, group: Group, metric: str, say, force: bool = False):
    registered = [r for r in group.rows if r.version and metric in r.metrics]
    if not registered:
        print("posttrain compare: --promote: no checkpoint in this group is a registered model version "
              "(only the base model was evaluated?)", file=sys.stderr)
        return EXIT_FAILED, None, None
    best = registered[0]
    if best is not group.rows[0]:
        say(f"note: {group.rows[0].stage} ranks first but is not a registered checkpoint; promoting the best "
            "registered one")
    name, version = best.version.split("/")
    current = champion_version(client, name)
    forced = None
    incumbent = next((r for r in group.rows if current and r.version == f"{name}/{current.version}"), None)
    if incumbent is not None and incumbent is not best:
        lead = difference(client, incumbent, best, metric)
        if lead is None or lead.within_noise:
            why = (f"{best.stage} ({best.version}) leads the {CHAMPION} {incumbent.stage} ({incumbent.version}) by "
                   + (f"{lead.text()} in {metric} (95% interval, {lead.method}), an interval that holds 0: within "
                      "noise" if lead else "an amount with no standard error to judge it by"))
            if not force:
                detectable = f" (this evaluation detects {group.detectable[0]:.3f} at 80% power)" \
                    if group.detectable else ""
                print(f"posttrain compare: --promote refused: {why}. Evaluate on more prompts or seeds"
                      f"{detectable}, or pass --force to promote anyway; {CHAMPION} stays {incumbent.version}",
                      file=sys.stderr)
                return EXIT_FAILED, None, None
            forced = why
            say(f"--force: promoting although {why}", "bold yellow")
        else:
            say(f"{best.stage} leads the {CHAMPION} {incumbent.stage} by {lead.text()} in {metric} "
                f"(95% interval, {lead.method}): beyond noise")
    elif current is not None and incumbent is None and str(current.version) != version:
        say(f"note: the {CHAMPION} ({name} version {current.version}) was not evaluated under these settings: its "
            "lead cannot be judged, so it is replaced on rank alone")
    previous = promote(client, name, version)
    if forced:
        client.set_model_version_tag(name, version, TAG_COMPARE_FORCED, forced)
    what = f"{CHAMPION} -> {name} version {version} (stage {best.stage}, {metric}={best.value(metric):.3f})"
    if previous is None:
        say(f"promoted: {what}; there was no {CHAMPION} before", "bold green")
    elif str(previous.version) == version:
        say(f"{CHAMPION} unchanged: {name} version {version} already was the best", "bold green")
    else:
        old_stage = previous.tags.get(TAG_STAGE, "?")
        say(f"promoted: {what}; replaced version {previous.version} (stage {old_stage})", "bold green")
    return EXIT_OK, best.version, forced


def _pipeline_name(file: str | None, overrides: list[str]) -> str | None:
    if not file:
        print("posttrain compare: give a pipeline file or --experiment NAME", file=sys.stderr)
        return None
    from flows.spec.loading import SpecError, load_pipeline

    try:
        return load_pipeline(file, overrides).spec.name
    except SpecError as error:
        print(f"{file}: {len(error.issues)} error(s); nothing was compared", file=sys.stderr)
        for issue in error.issues:
            print("  " + issue.render(error.source), file=sys.stderr)
        return None
