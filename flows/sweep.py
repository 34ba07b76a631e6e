"""``posttrain sweep``: a pipeline over seeds and a grid of overrides, run as one Prefect flow.

The variants are every grid point times every seed (the ``sweep:`` block, or ``--seeds`` and
``--grid PATH=V1,V2``); each is the pipeline loaded with ``--set`` overrides. All are validated
before anything starts: one bad variant refuses the sweep (exit 2, naming it). They then run
in one flow (``flows/execution/deployment.py``, ``sweep_flow``), one after another, or side by
side where stages run on work pools, each planned just before it starts: a stage whose
fingerprint another variant already ran (the SFT of one seed under several GRPO settings) is
a cache hit, and one it is running is waited for, so the union of the variants' stage graphs
keyed by fingerprint runs each stage once. The per-fingerprint stage lock
(``flows/recording/locks.py``) keeps two sweeps in one home from training the same fingerprint
at once. Rerunning an interrupted sweep resumes it: finished stages are cache hits, and a
stage killed midway resumes from its trainer checkpoints as ``posttrain run`` does.

Every stage run a variant starts is tagged ``posttrain.variant`` (the grid overrides that reach
the stage: paths under ``stages.<it or an ancestor>``, and any path outside ``stages``) and
``posttrain.seed``; every pipeline run ``posttrain.sweep`` and is nested under the sweep's parent
run, which holds the summary table and chart. The summary is ``posttrain compare``'s over the
sweep's evaluations: mean ± SE over seeds per eval stage and variant, and the paired gain of
each eval stage over the nearest evaluated stage upstream of it, with 95% intervals
(``stages/intervals.py``).
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from flows.recording.tags import TAG_PIPELINE, TAG_ROLE, TAG_SWEEP, TAG_VARIANT
from stages.intervals import Estimate, seed_estimate

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130
NO_VARIANT = "-"


class SweepError(Exception):
    """The sweep cannot start (exit status 2); nothing ran."""


@dataclass(frozen=True)
class SweepVariant:
    seed: int
    grid: tuple[str, ...]  # "PATH=VALUE" overrides of this grid point
    overrides: tuple[str, ...]  # the command line's --set, then the grid point, then the seed

    @property
    def name(self) -> str:
        return " ".join((f"seed={self.seed}", *self.grid))

    def label_for(self, spec, stage: str) -> str:
        """The grid overrides that reach ``stage`` (its own and its ancestors' fields, and any path outside
        ``stages``): a stage shared by several grid points has one label, "-"."""
        from flows.planning.graph import ancestors

        reach = {stage} | ancestors(spec, stage)
        parts = [o for o in self.grid if not o.startswith("stages.") or o.split(".")[1] in reach]
        return " ".join(parts) or NO_VARIANT


def parse_grid(items: list[str]) -> dict[str, list[str]]:
    """``--grid PATH=V1,V2`` (repeatable) -> {PATH: [V1, V2]}."""
    grid = {}
    for item in items:
        path, sep, values = item.partition("=")
        if not sep or not path.strip() or not values.strip():
            raise SweepError(f"--grid {item!r}: expected PATH=V1,V2 (e.g. --grid stages.grpo.kl_beta=0.05,0.1)")
        grid[path.strip()] = [v.strip() for v in values.split(",")]
    return grid


def _value_text(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def expand(loaded, seeds: list[int] | None, cli_grid: dict[str, list[str]]) -> list[SweepVariant]:
    """Every grid point times every seed: the command line's over the file's ``sweep:`` block."""
    block = loaded.spec.sweep
    seeds = list(seeds or (block.seeds if block and block.seeds else [loaded.spec.seed]))
    grid = {path: [_value_text(v) for v in values] for path, values in (block.grid if block else {}).items()}
    grid.update(cli_grid)
    for path in grid:
        if path == "seed" or path.startswith("sweep"):
            raise SweepError(f"--grid {path}: a seed is swept with --seeds (or sweep.seeds), and the sweep "
                             "block itself cannot be swept")
    if len(set(seeds)) != len(seeds):
        raise SweepError(f"--seeds {' '.join(map(str, seeds))}: a seed is listed twice")
    points = [tuple(f"{path}={value}" for path, value in zip(grid, combo))
              for combo in itertools.product(*grid.values())] if grid else [()]
    return [SweepVariant(seed, point, (*loaded.overrides, *point, f"seed={seed}"))
            for point in points for seed in seeds]


def load_variants(file: str, variants: list[SweepVariant]) -> list:
    """Each variant's validated pipeline; SweepError naming every variant that does not validate."""
    from flows.spec.loading import SpecError, load_pipeline

    loaded, problems = [], []
    for variant in variants:
        try:
            loaded.append(load_pipeline(file, list(variant.overrides)))
        except SpecError as error:
            problems.append(f"variant {variant.name}: " + "; ".join(issue.render(error.source)
                                                                    for issue in error.issues))
    if problems:
        raise SweepError(f"{len(problems)} of {len(variants)} variants do not validate:\n  " + "\n  ".join(problems))
    return loaded


def flow_variants(variants: list[SweepVariant], loaded: list, sweep_run_id: str) -> list[dict]:
    """What the sweep flow receives per variant: its overrides and the tags of its runs."""
    return [{"name": v.name, "overrides": list(v.overrides),
             "run_tags": {TAG_SWEEP: sweep_run_id, "mlflow.parentRunId": sweep_run_id,
                          TAG_VARIANT: " ".join(v.grid) or NO_VARIANT},
             "stage_tags": {stage: {TAG_SWEEP: sweep_run_id, TAG_VARIANT: v.label_for(spec.spec, stage)}
                            for stage in spec.spec.stages}}
            for v, spec in zip(variants, loaded)]


# ------------------------------------------------------------------ the summary


def nearest_evaluated_upstream(spec, groups, metric: str) -> dict[str, str]:
    """eval stage -> the eval stage (same settings) of the nearest stage upstream of the one it evaluates."""
    from flows.planning.graph import ancestors, topological_order

    order = {stage: i for i, stage in enumerate(topological_order(spec))}
    partners = {}
    for group in groups:
        evaluated = {r.eval_stage: r.stage for r in group.rows if metric in r.metrics}
        for eval_stage, model in evaluated.items():
            upstream = (ancestors(spec, model) if model in spec.stages else set()) | {"base"}
            below = [(order.get(m, -1), e) for e, m in evaluated.items() if m in upstream and m != model]
            if below:
                partners[eval_stage] = max(below)[1]
    return partners


def paired_gains(client, groups, partners: dict[str, str], metric: str) -> list[tuple[str, Estimate, list]]:
    """(what, gain over seeds, [(seed, paired prompt interval)]) for each eval stage and variant over its partner."""
    from flows.compare import difference

    gains = []
    for group in groups:
        by_stage_seed = {(r.eval_stage, r.seed): r for r in group.rows}
        for variant in group.variants:
            partner = partners.get(variant.eval_stage)
            pairs = [(by_stage_seed[(partner, r.seed)], r) for r in variant.rows if (partner, r.seed) in by_stage_seed]
            if not pairs:
                continue
            per_seed = [(b.seed, difference(client, a, b, metric)) for a, b in pairs]
            overall = seed_estimate([b.value(metric) - a.value(metric) for a, b in pairs])
            gains.append((f"{variant.label} - {partner}", overall, per_seed))
    return gains


def summarise(client, experiment_id: str, spec, eval_run_ids: set[str], metric: str, console, chart: Path):
    """Print the sweep's table of eval stages by variant over seeds and its paired gains; (lines, groups)."""
    from flows.compare import add_intervals, evaluated_checkpoints, group_by_settings, print_group, save_chart

    rows = [r for r in evaluated_checkpoints(client, experiment_id, register_missing=False)
            if r.eval_run_id in eval_run_ids]
    if not rows:
        return [f"no evaluation reported {metric}"], []
    groups = [g for g in group_by_settings(rows, metric) if any(metric in r.metrics for r in g.rows)]
    lines = []
    for group in groups:
        add_intervals(client, group, metric)
        print_group(group, metric, console, None)
    for group in groups:
        for v in group.variants:
            per_seed = ", ".join(f"seed {r.seed}: {r.value(metric):.3f}" for r in v.rows)
            if v.estimate.n > 1:
                spread = f"{v.estimate.mean:.3f} ± {v.estimate.se:.3f} (SE over {v.estimate.n} seeds; {per_seed})"
            else:  # one seed: the SE over prompts is all this sweep measured
                only = v.rows[0]
                se = only.se(metric)
                spread = (f"{v.estimate.mean:.3f} ± {'?' if se is None else f'{se:.3f}'} (SE over prompts; 1 seed, "
                          f"{only.seed}: the spread over seeds is not measured)")
            lines.append(f"{v.label}: {metric} {spread}")
    for what, overall, per_seed in paired_gains(client, groups, nearest_evaluated_upstream(spec, groups, metric),
                                                metric):
        def shown(e):
            return "-" if e is None else f"{e.text()} ({e.method}){' within noise' if e.within_noise else ''}"

        if overall.n > 1:
            seeds = "; ".join(f"seed {seed}: {shown(e)}" for seed, e in per_seed)
            lines.append(f"gain {what}: {overall.text()} (95%, {overall.method})"
                         f"{' within noise' if overall.within_noise else ''}; per seed: {seeds}")
        else:
            seed, e = per_seed[0]
            lines.append(f"gain {what}: {shown(e)} (95%; 1 seed, {seed}: the spread over seeds is not measured)")
    save_chart(groups, metric, chart, f"sweep of {spec.name}: {metric}")
    return lines, groups


# ------------------------------------------------------------------ the command


def sweep_command(args, console) -> int:
    """Validate every variant, run them as one flow, summarise; the exit status."""
    from flows.spec.loading import SpecError, load_pipeline

    try:
        base = load_pipeline(args.file, args.overrides)
        variants = expand(base, args.seeds, parse_grid(args.grid))
        loaded = load_variants(args.file, variants)
        pools = sorted({spec.spec.resources_for(stage).pool for spec in loaded for stage in spec.spec.stages} - {None})
        parallel = side_by_side(base, variants, pools, args.parallel)
    except SpecError as error:
        print(f"{args.file}: {len(error.issues)} error(s); nothing was run", file=sys.stderr)
        for issue in error.issues:
            print("  " + issue.render(error.source), file=sys.stderr)
        return EXIT_BAD_INPUT
    except SweepError as error:
        print(f"posttrain sweep: {error}\nnothing was run", file=sys.stderr)
        return EXIT_BAD_INPUT
    order = (f"side by side, at most {parallel} at once (work pool(s) {', '.join(pools)})" if parallel > 1
             else "one after another")
    console.print(f"sweep of {base.spec.name}: {len(variants)} variant(s), validated, run {order}: "
                  + ", ".join(v.name for v in variants))
    from flows.terminal import Terminal, activated, run_log

    terminal = Terminal()  # as `posttrain run`: posttrain's lines on the terminal, other output to the logs
    try:
        with run_log(base.spec.name) as log:
            with activated(terminal), terminal.capture(log.path):
                code = _run(args, terminal.console, base, variants, loaded, pools, parallel)
            terminal.console.print(f"log: {log.keep()}")
        return code
    except KeyboardInterrupt:
        print("posttrain sweep: interrupted; run the same command again to resume (finished stages are cached, "
              "a killed stage resumes from its checkpoints)", file=sys.stderr)
        return EXIT_INTERRUPTED


def side_by_side(base, variants: list[SweepVariant], pools: list[str], cli_parallel: int | None) -> int:
    """How many variants run at once: one when every stage runs in this process (its stages could only take
    turns), else ``--parallel``, the file's ``sweep.parallel`` or every variant."""
    block = base.spec.sweep
    asked, where = (cli_parallel, f"--parallel {cli_parallel}") if cli_parallel is not None else (
        block.parallel if block else None, f"sweep.parallel: {block.parallel if block else None}")
    if asked is not None and asked < 1:
        raise SweepError(f"{where}: the number of variants run at once is at least 1")
    if not pools:
        if asked is not None and asked > 1:
            raise SweepError(f"{where}: variants run side by side only where stages run on work pools; every stage "
                             f"of {base.spec.name} runs in this process, where stages run one at a time (set "
                             "`resources: {pool: ...}`, docs/scaling-out.md)")
        return 1
    return min(asked or len(variants), len(variants))


def _run(args, console, base, variants, loaded, pools, parallel) -> int:
    from flows.execution.pipeline import prepare_store
    from flows.planning.lineage import PlanError
    from flows.recording.home import artifact_root, configure_environment, create_home_dir, posttrain_home
    from flows.servers.prefect_server import prefect_api

    import os

    if pools and not os.environ.get("PREFECT_API_URL"):
        print(f"posttrain sweep: stages run on work pool(s) {', '.join(pools)}, which needs a Prefect server with "
              "workers: set PREFECT_API_URL (docs/scaling-out.md); nothing was run", file=sys.stderr)
        return EXIT_BAD_INPUT
    home = posttrain_home()
    create_home_dir(home)
    home = configure_environment()
    try:
        tracker = prepare_store(home, console)
    except PlanError as error:
        print(f"posttrain sweep: {error}; nothing was run", file=sys.stderr)
        return EXIT_BAD_INPUT
    experiment_id = tracker.experiment_id(base.spec.name, artifact_root(home))
    tracker.reap_dead_runs(experiment_id)
    client = tracker.client
    sweep_run = client.create_run(experiment_id, run_name=f"sweep {time.strftime('%Y-%m-%d %H:%M:%S')}",
                                  tags={TAG_ROLE: "sweep", TAG_PIPELINE: base.spec.name})
    run_id = sweep_run.info.run_id
    client.log_param(run_id, "variants", json.dumps([v.name for v in variants])[:6000])
    client.log_param(run_id, "pipeline_file", str(base.path))
    started = time.perf_counter()
    status = "FAILED"
    try:
        with prefect_api(home):
            from flows.execution.deployment import run_sweep_flow

            reports = run_sweep_flow(str(base.path), flow_variants(variants, loaded, run_id), parallel)
        status = "FINISHED" if len(reports) == len(variants) and not any(r.failed for r in reports) else "FAILED"
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        if status != "FINISHED":
            client.set_terminated(run_id, status)
    try:
        return _report(args, console, client, experiment_id, base, variants, reports, run_id, started, home)
    except BaseException:  # the summary broke: the sweep's run says so instead of staying RUNNING
        client.set_terminated(run_id, "FAILED")
        raise


def _report(args, console, client, experiment_id, base, variants, reports, run_id, started, home) -> int:
    from flows.execution.pipeline import print_failure

    ran = sum(row.status == "ran" for r in reports for row in r.rows)
    cached = sum(row.status == "cached" for r in reports for row in r.rows)
    eval_runs = {row.run_id for r in reports for row in r.rows if row.run_id and row.kind in ("eval", "benchmark")}
    minutes = (time.perf_counter() - started) / 60
    header = (f"sweep of {base.spec.name}: {len(reports)} of {len(variants)} variant(s) in {minutes:.1f} min; "
              f"stage executions: {ran} ran, {cached} cached")
    console.print(header)
    failed = next((r for r in reports if r.failed), None)
    if failed is not None:
        print_failure(failed, console, show_traceback=False)
        return EXIT_FAILED
    chart = home / "sweeps" / base.spec.name / f"sweep-{run_id[:8]}-{args.metric}.png"
    lines, groups = summarise(client, experiment_id, base.spec, eval_runs, args.metric, console, chart)
    for line in lines:
        console.print(line, highlight=False, markup=False)
    console.print(f"chart: {chart}")
    text = "\n".join([header, *lines])
    client.log_text(run_id, text, "sweep.txt")
    from flows.compare import variant_rows

    table = [{"settings": g.settings, **row} for g in groups for row in variant_rows(g, args.metric)]
    if table:
        client.log_table(run_id, data={c: [row.get(c) for row in table] for c in table[0]}, artifact_file="sweep.json")
    if chart.exists():
        client.log_artifact(run_id, str(chart))
    client.set_terminated(run_id, "FINISHED")
    console.print(f"logged to MLflow run {run_id} (experiment {experiment_id}); `posttrain compare "
                  f"{args.file}` ranks the checkpoints")
    return EXIT_OK
