"""``posttrain compare``: rank evaluated checkpoints, chart them, and promote the best.

Rows come from the FINISHED eval stage runs of one experiment (one pipeline): each row is
the checkpoint an eval run scored (its upstream stage run), the latest score per checkpoint
and settings. Scores are ranked only within one eval settings hash (``posttrain.eval_settings``:
sampling, data, rewards, verifier): a pass@1 at temperature 1.0 and 8 tokens says nothing
about one at temperature 0.2 and 32 tokens. With several groups every group is shown and
ranked on its own, the output says why, and ``--promote`` refuses until ``--settings``
picks one.

The table is printed and, with a bar chart (PNG), logged to an MLflow run tagged
``posttrain.role=compare`` in the experiment. ``--promote`` points the registered model
alias ``champion`` (``flows/recording/model_registry.py``) at the best registered checkpoint of the group.
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
    TAG_COMPARE_METRIC,
    TAG_COMPARE_PROMOTED,
    TAG_COMPARE_SETTINGS,
    TAG_EVAL_SETTINGS,
    TAG_LINKED_MODEL_ID,
    TAG_MODEL_VERSION,
    TAG_ROLE,
    TAG_ROUND,
    TAG_STAGE,
    TAG_UPSTREAM,
)
from stages.registry import STAGE_KINDS

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2
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

    def value(self, metric: str) -> float:
        return self.metrics.get(metric, float("-inf"))


@dataclass
class Group:
    settings: str
    settings_text: str
    rows: list[Row] = field(default_factory=list)

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
        checkpoint_run_id = json.loads(tags.get(TAG_UPSTREAM, "{}")).get(stage)
        key = (checkpoint_run_id or f"base:{run.data.tags.get('posttrain.stage')}", settings)
        if key in seen:  # an older evaluation of the same checkpoint under the same settings
            continue
        seen.add(key)
        row = Row(stage, tags.get(TAG_STAGE, "?"), run.info.run_id, checkpoint_run_id, settings,
                  _settings_text(params), tags.get(TAG_ROUND, "-"), dict(run.data.metrics), run.info.start_time)
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


# ------------------------------------------------------------------ output


def _fmt(value) -> str:
    return "-" if value is None or value == float("-inf") else f"{value:.3f}"


def table_rows(group: Group, metric: str) -> list[dict]:
    k = group.widest_k()
    columns = ["pass_at_1"] + ([k] if k else []) + list(SHOWN_METRICS)
    if metric not in columns:
        columns.insert(0, metric)
    return [{"rank": row.rank, "stage": row.stage, "round": row.round,
             **{c: row.metrics.get(c) for c in columns},
             "settings": row.settings, "version": row.version or "-", "eval run": row.eval_run_id}
            for row in group.rows]


def print_group(group: Group, metric: str, console, champion: str | None) -> list[dict]:
    from rich.table import Table

    rows = table_rows(group, metric)
    table = Table(title=f"settings {group.settings}: {group.settings_text} · ranked by {metric}")
    for column in rows[0]:
        table.add_column(column, justify="right" if column not in ("stage", "settings", "version", "eval run")
                         else "left")
    for row in rows:
        cells = [_fmt(v) if isinstance(v, float) or v is None else str(v) for v in row.values()]
        is_champion = champion is not None and row["version"] == champion
        if is_champion:
            cells[list(row).index("version")] += f" @{CHAMPION}"
        table.add_row(*cells, style="bold green" if row["rank"] == 1 else None)
    console.print(table)
    return rows


def save_chart(groups: list[Group], metric: str, path: Path, title: str) -> Path:
    """One bar chart per settings group: the ranked checkpoints' ``metric``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(groups), 1, figsize=(8, 2.6 + 0.45 * max(len(g.rows) for g in groups)
                                                            * len(groups)), squeeze=False)
    for ax, group in zip(axes[:, 0], groups):
        labels = [f"#{r.rank} {r.stage}" + (f" r{r.round}" if r.round != "-" else "") for r in group.rows][::-1]
        values = [max(r.value(metric), 0.0) for r in group.rows][::-1]
        bars = ax.barh(labels, values, color=["#2b8a3e" if r.rank == 1 else "#7a8ca3" for r in group.rows][::-1])
        ax.bar_label(bars, fmt="%.3f", padding=3)
        ax.set_xlim(0, max(1.0, max(values, default=0) * 1.15))
        ax.set_xlabel(metric)
        ax.set_title(f"settings {group.settings}: {group.settings_text}", fontsize=9)
    figure.suptitle(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def log_comparison(client, experiment_id: str, metric: str, groups: list[Group], chart: Path,
                   text: str, chosen: str | None) -> str:
    """A run tagged ``posttrain.role=compare`` holding the table, the chart and the text output."""
    run = client.create_run(experiment_id, run_name=f"compare {time.strftime('%Y-%m-%d %H:%M:%S')}",
                            tags={TAG_ROLE: "compare", TAG_COMPARE_METRIC: metric,
                                  TAG_COMPARE_SETTINGS: ",".join(g.settings for g in groups)})
    run_id = run.info.run_id
    try:
        rows = [row for group in groups for row in table_rows(group, metric)]
        columns = sorted({k for row in rows for k in row}, key=lambda k: list(rows[0]).index(k)
                         if k in rows[0] else 99)
        client.log_table(run_id, data={c: [row.get(c) for row in rows] for c in columns}, artifact_file="compare.json")
        client.log_artifact(run_id, str(chart))
        client.log_text(run_id, text, "compare.txt")
        if chosen:
            client.set_tag(run_id, TAG_COMPARE_PROMOTED, chosen)
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
        console.print(f"[{style}]{message}[/{style}]" if style else message, highlight=False)

    shown_rows = sum(len(g.rows) for g in groups)
    say(f"experiment {experiment_name}: {shown_rows} evaluated checkpoint(s) in {len(groups)} settings group(s)"
        + (f" (--settings {args.settings}; {len(rows) - shown_rows} more under other settings)"
           if args.settings else ""))
    if len(groups) > 1:
        say(f"not ranked together: {WHY_NOT_RANKED_TOGETHER}.", "bold yellow")
    champions = _champions(client, groups)
    for group in groups:
        shown = print_group(group, args.metric, console, _champion_of(group, champions))
        lines.extend(json.dumps(row) for row in shown)
    default_chart = posttrain_home() / "compare" / experiment_name / f"compare-{args.metric}.png"
    chart = Path(args.output) if args.output else default_chart
    save_chart(groups, args.metric, chart, f"{experiment_name}: {args.metric} by eval settings")
    say(f"chart: {chart}")
    code, promoted = _promote(args, client, groups, say)
    run_id = log_comparison(client, experiment.experiment_id, args.metric, groups, chart, "\n".join(lines), promoted)
    console.print(f"logged to MLflow run {run_id} (experiment {experiment.experiment_id})")
    return code


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


def _promote(args, client, groups: list[Group], say) -> tuple[int, str | None]:
    if not args.promote:
        return EXIT_OK, None
    if len(groups) > 1:
        hashes = ", ".join(f"{g.settings} ({g.settings_text})" for g in groups)
        print(f"posttrain compare: --promote refused: the evaluated checkpoints fall in {len(groups)} settings "
              f"groups ({hashes}), and scores from different settings are not comparable. Pick the group "
              f"to promote from with --settings HASH (e.g. --settings {groups[0].settings}).", file=sys.stderr)
        return EXIT_BAD_INPUT, None
    return _promote_best(client, groups[0], args.metric, say)


def _champion_of(group: Group, champions: dict) -> str | None:
    names = {r.version.split("/")[0] for r in group.rows if r.version}
    return next((champions[n] for n in names if champions.get(n)), None)


def _promote_best(client, group: Group, metric: str, say) -> tuple[int, str | None]:
    registered = [r for r in group.rows if r.version and metric in r.metrics]
    if not registered:
        print("posttrain compare: --promote: no checkpoint in this group is a registered model version "
              "(only the base model was evaluated?)", file=sys.stderr)
        return EXIT_FAILED, None
    best = registered[0]
    if best is not group.rows[0]:
        say(f"note: {group.rows[0].stage} ranks first but is not a registered checkpoint; promoting the best "
            "registered one")
    name, version = best.version.split("/")
    previous = promote(client, name, version)
    what = f"{CHAMPION} -> {name} version {version} (stage {best.stage}, {metric}={best.value(metric):.3f})"
    if previous is None:
        say(f"promoted: {what}; there was no {CHAMPION} before", "bold green")
    elif str(previous.version) == version:
        say(f"{CHAMPION} unchanged: {name} version {version} already was the best", "bold green")
    else:
        old_stage = previous.tags.get(TAG_STAGE, "?")
        say(f"promoted: {what}; replaced version {previous.version} (stage {old_stage})", "bold green")
    return EXIT_OK, best.version


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
