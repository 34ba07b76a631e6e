"""The ``posttrain`` command line.

Exit status: 0 success, 1 a stage failed at run time (or its record could not reach
MLflow), 2 bad input or an unreachable tracking server (nothing started), 130 interrupted.
"""

from __future__ import annotations

import argparse
import sys

EXIT_OK, EXIT_STAGE_FAILED, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="posttrain",
        description="Declarative post-training pipelines (SFT, RL, evaluation) run as Prefect flows, "
        "versioned in MLflow.",
    )
    from flows import __version__

    parser.add_argument("--version", action="version", version=f"posttrain {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    validate = commands.add_parser("validate", help="check a pipeline and print its stage graph; runs nothing")
    _with_overrides(validate)

    check = commands.add_parser("check-reward", help="score the pipeline's known reward cases; exit 1 on a violation")
    _with_overrides(check)
    check.add_argument("--reward", metavar="NAME", action="append", default=[],
                       help="check only this reward (repeatable); default every reward with cases")

    run = commands.add_parser("run", help="run a pipeline (cached stages are reused)")
    _with_overrides(run)
    _run_arguments(run)

    _sweep_parser(commands)

    deploy = commands.add_parser(
        "deploy", help="register the pipeline as a Prefect deployment on a work pool, optionally on a schedule")
    _with_overrides(deploy)
    deploy.add_argument("--cron", metavar="CRON", help='schedule, e.g. "0 3 * * *" (daily at 03:00)')
    deploy.add_argument("--timezone", metavar="TZ", default="UTC", help="the schedule's time zone (default UTC)")
    deploy.add_argument("--pool", metavar="NAME", default="cpu", help="work pool whose workers run it (default cpu)")
    deploy.add_argument("--name", metavar="NAME", help="deployment name (default: the pipeline name)")

    commands.add_parser("sync", help="record in MLflow what a tracking outage left waiting in $POSTTRAIN_HOME/pending")
    _schema_and_ui_parsers(commands)

    server = commands.add_parser("server", help="the Prefect API server and warm process posttrain keeps for this home "
                                 "between runs")
    server.add_argument("action", choices=("status", "stop"), help="status: are they up, where; stop: stop them now")

    _compare_parser(commands)
    return parser


def _with_overrides(sub) -> None:
    sub.add_argument("file", help="pipeline YAML file")
    sub.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                     help="override a field, e.g. --set stages.sft.max_steps=50 (repeatable)")


def _sweep_parser(commands) -> None:
    sweep = commands.add_parser(
        "sweep", help="run the pipeline over seeds and a grid of overrides as one flow (shared stages run once); "
        "print mean ± SE over seeds and the paired gains' 95%% intervals")
    _with_overrides(sweep)
    sweep.add_argument("--seeds", type=int, nargs="+", metavar="SEED",
                       help="the seeds each variant runs with (default: the file's sweep.seeds, else its seed)")
    sweep.add_argument("--grid", action="append", default=[], metavar="PATH=V1,V2",
                       help="an override path and its values, e.g. --grid stages.grpo.kl_beta=0.05,0.1 (repeatable; "
                       "adds to or replaces the file's sweep.grid)")
    sweep.add_argument("--parallel", type=int, metavar="N",
                       help="variants side by side, at most N at once, where stages run on work pools (default: the "
                       "file's sweep.parallel, else all of them; one after another when every stage runs here)")
    sweep.add_argument("--metric", default="pass_at_1", help="eval metric the summary reports (default pass_at_1)")


def _compare_parser(commands) -> None:
    compare = commands.add_parser(
        "compare", help="rank evaluated checkpoints (within one eval settings hash), chart them, promote the best")
    compare.add_argument("file", nargs="?", help="pipeline YAML file (its name is the MLflow experiment)")
    compare.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                         help="override a field of the file (only its name matters here)")
    compare.add_argument("--experiment", metavar="NAME", help="the MLflow experiment (pipeline name) instead of a file")
    compare.add_argument("--metric", default="pass_at_1", help="eval metric to rank by, higher is better "
                         "(default pass_at_1)")
    compare.add_argument("--settings", metavar="HASH", help="rank only the checkpoints evaluated under this "
                         "settings hash (or a prefix of it)")
    compare.add_argument("--promote", action="store_true",
                         help="set the registered model alias `champion` on the best checkpoint, unless its lead "
                         "over the current champion is within noise (its 95%% interval holds 0): then exit 1")
    compare.add_argument("--force", action="store_true",
                         help="with --promote: promote a lead within noise anyway (recorded on the compare run "
                         "and the model version)")
    compare.add_argument("--output", metavar="PNG", help="where to save the chart "
                         "(default $POSTTRAIN_HOME/compare/EXPERIMENT/compare-METRIC.png)")


def _schema_and_ui_parsers(commands) -> None:
    schema = commands.add_parser("schema", help="print the pipeline's JSON Schema (editors), or with --reference "
                                 "the reference page of every stage kind and field")
    schema.add_argument("--reference", action="store_true", help="print the reference page (Markdown) instead")
    ui = commands.add_parser("ui", help="serve MLflow's UI on this home's runs (127.0.0.1) until Ctrl-C")
    ui.add_argument("--port", type=int, metavar="PORT", help="port to listen on (default 5000, else a free one)")


def _run_arguments(run: argparse.ArgumentParser) -> None:
    picks = run.add_mutually_exclusive_group()
    picks.add_argument("--only", metavar="STAGE", help="run only STAGE, against cached upstream outputs")
    picks.add_argument("--from", dest="from_stage", metavar="STAGE", help="rerun STAGE and everything downstream")
    run.add_argument("--force", metavar="STAGE", action="append", default=[],
                     help="ignore STAGE's cache (downstream becomes stale); repeatable")
    run.add_argument("--no-cache", action="store_true", help="ignore every cache entry")
    run.add_argument("-v", "--verbose", action="store_true",
                     help="show other libraries' output (progress bars, warnings, logs) instead of capturing it "
                     "to the stage's log file")
    run.add_argument("--debug", action="store_true", help="-v, Prefect's logs, and a failed stage's traceback")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if argv is None and args.command == "run":  # the program itself (console script, -m), not an in-process caller
        from flows.servers.launch import run_program

        return run_program(sys.argv[1:], lambda: _command(args))  # start-up made fast (flows/servers/launch.py)
    if args.command == "schema":  # reads nothing and writes nothing: no home, no store
        from flows.spec.reference import reference_markdown, schema_text

        sys.stdout.write(reference_markdown() if args.reference else schema_text())
        return EXIT_OK
    return _command(args)


def _command(args) -> int:
    from rich.console import Console

    from flows.recording.home import configure_environment, home_problem

    # Before Prefect or MLflow are imported; the home itself is made only once the whole input
    # (spec, overrides, flags, environment) is accepted: refused input leaves nothing behind.
    home = configure_environment(create=False)
    console = Console() if sys.stdout.isatty() else Console(width=160)  # logs and CI get full rows

    if args.command == "ui":
        return _ui(args, console)
    if args.command == "server":
        return _server(args.action, home, console)

    if args.command in ("sync", "compare", "sweep"):
        return _home_command(args, home, console)

    from flows.spec.loading import SpecError, SpecIssue, load_pipeline

    try:
        loaded = load_pipeline(args.file, args.overrides)
        problems = [SpecIssue("", problem)] if (problem := home_problem(home)) else []
        if args.command == "run":
            problems += run_flag_issues(loaded, args)
        if problems:
            raise SpecError(args.file, problems)
    except SpecError as error:
        count = len(error.issues)
        print(f"{args.file}: {count} error{'s' if count != 1 else ''}; nothing was run", file=sys.stderr)
        for issue in error.issues:
            print("  " + issue.render(error.source), file=sys.stderr)
        return EXIT_BAD_INPUT

    if args.command == "validate":
        return _valid(loaded, args.file, console)

    if args.command == "deploy":
        return _deploy(loaded, args, console)

    if args.command == "check-reward":
        from flows.checks import check_rewards_command

        return check_rewards_command(loaded, args.reward, console)

    return _run(loaded, args)


def _home_command(args, home, console) -> int:
    """sync, compare and sweep: the home checked first; each reads (or loads and validates) what it needs itself."""
    from flows.recording.home import ensure_home, home_problem

    if (problem := home_problem(home)) is not None:
        print(f"posttrain {args.command}: {problem}; nothing was {'run' if args.command == 'sweep' else 'done'}",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.command == "sync":
        return _sync(console)
    if args.command == "sweep":
        from flows.sweep import sweep_command

        return sweep_command(args, console)
    from flows.compare import compare_command

    ensure_home(home)
    return compare_command(args, console)


def _valid(loaded, file: str, console) -> int:
    """``posttrain validate`` on a pipeline that validated: what this machine could not check, and the graph."""
    from flows.planning.graph import render_graph
    from flows.spec.validate import unchecked_notes

    console.print(f"{file}: valid pipeline {loaded.spec.name!r} with {len(loaded.spec.stages)} stages")
    for note in unchecked_notes(loaded.spec):
        console.print(f"  not checked here: {note}", highlight=False, markup=False)
    console.print("stage graph (run order):")
    console.print(render_graph(loaded.spec), highlight=False, markup=False)
    return EXIT_OK


def _run(loaded, args) -> int:
    """``posttrain run`` on a pipeline that validated: the plan, the run, the summary, the exit status.

    Only posttrain's own lines reach the terminal; what else the run writes goes to the stage's
    log file, or else to the run's log (``flows/terminal.py``), unless ``-v`` / ``--debug``."""
    import os
    import traceback

    from flows.recording.home import HomeError
    from flows.planning.lineage import PlanError, RunOptions
    from flows.execution.pipeline import print_failure, print_summary
    from flows.terminal import Terminal, activated, run_log

    if args.debug:
        os.environ["PREFECT_LOGGING_LEVEL"] = "INFO"  # read when Prefect is first imported
    terminal = Terminal(verbose=args.verbose, debug=args.debug)
    options = RunOptions(only=args.only, from_stage=args.from_stage, force=args.force, no_cache=args.no_cache)
    with run_log(loaded.spec.name) as log:
        try:
            with activated(terminal), terminal.capture(log.path):
                report = run_from_cli(loaded, options, terminal.console)
        except (PlanError, HomeError) as error:
            print(f"posttrain run: {error}; nothing was run", file=sys.stderr)
            return EXIT_BAD_INPUT
        except KeyboardInterrupt:
            print("posttrain run: interrupted; the running stage is marked KILLED in MLflow and its trainer "
                  "checkpoints are kept: the next `posttrain run` resumes it", file=sys.stderr)
            return EXIT_INTERRUPTED
        except Exception as error:  # orchestration itself broke (a server lost mid-run, ...)
            if args.debug:
                traceback.print_exc()
            print(f"posttrain run: the run could not complete: {type(error).__name__}: {error}", file=sys.stderr)
            print(f"  log: {log.keep()}", file=sys.stderr)
            return EXIT_STAGE_FAILED
        log.keep()
    if report.failed:
        print_failure(report, terminal.console, show_traceback=args.debug)
    else:
        print_summary(report, terminal.console)
    return EXIT_STAGE_FAILED if report.failed or report.unrecorded else EXIT_OK


def run_flag_issues(loaded, args) -> list:
    """``--only``, ``--from`` and ``--force`` name stages of this pipeline."""
    from flows.planning.lineage import PlanError, RunOptions
    from flows.spec.loading import SpecIssue

    options = RunOptions(only=args.only, from_stage=args.from_stage, force=args.force, no_cache=args.no_cache)
    try:
        options.check(loaded)
    except PlanError as error:
        return [SpecIssue("", str(error))]
    return []


def _deploy(loaded, args, console) -> int:
    import os

    if not os.environ.get("PREFECT_API_URL"):
        print("posttrain deploy: a deployment lives on a Prefect server; set PREFECT_API_URL "
              "(e.g. http://127.0.0.1:4200/api after `prefect server start`); nothing was deployed", file=sys.stderr)
        return EXIT_BAD_INPUT
    from flows.execution.deployment import DeployError, deploy_pipeline, require_pool  # Prefect reads the URL on import

    try:
        for stage in loaded.spec.stages:  # the pools its stages name must exist too (Kubernetes for several nodes)
            resources = loaded.spec.resources_for(stage)
            if resources.pool:
                require_pool(resources.pool, resources.nodes)
        name = deploy_pipeline(loaded.path, loaded.overrides, args.name or loaded.spec.name, args.cron, args.pool,
                               args.timezone)
    except DeployError as error:
        print(f"posttrain deploy: {error}; nothing was deployed", file=sys.stderr)
        return EXIT_BAD_INPUT
    when = f"on schedule {args.cron!r} ({args.timezone})" if args.cron else "when triggered"
    console.print(f"deployment {name} on work pool {args.pool!r} runs {loaded.path.name} {when}")
    console.print(f"run it now: prefect deployment run '{name}'; workers: prefect worker start --pool {args.pool}")
    return EXIT_OK


def _server(action: str, home, console) -> int:
    """``posttrain server status|stop``: posttrain's Prefect API server for this home (flows/servers/prefect_server.py)."""
    from flows.servers import warm
    from flows.servers.prefect_server import describe, stop_server

    if action == "status":
        console.print(describe(home), highlight=False, markup=False)
        console.print(warm.describe(home), highlight=False, markup=False)
        return EXIT_OK
    stopped = stop_server(home)
    console.print(f"stopped the Prefect API server (pid {stopped.pid})" if stopped
                  else f"no Prefect API server runs for {home}", highlight=False)
    pid = warm.stop(home)
    console.print(f"stopped the warm process (pid {pid})" if pid else f"no warm process runs for {home}",
                  highlight=False)
    return EXIT_OK


def _sync(console) -> int:
    """Send the journals of runs an outage left unrecorded; 1 while some still wait."""
    from flows.recording.home import posttrain_home
    from flows.recording.journal import broken_journals, pending_runs, replay_pending
    from flows.recording.store import TrackingUnavailable, check_reachable
    from flows.recording.tracking import Tracker

    home = posttrain_home()
    waiting = pending_runs(home)
    if not waiting:
        console.print("nothing waits to be recorded")
        return EXIT_OK
    try:
        check_reachable()
    except TrackingUnavailable as error:
        print(f"posttrain sync: {error}; {len(waiting)} run(s) still wait", file=sys.stderr)
        return EXIT_STAGE_FAILED
    done, left = replay_pending(Tracker(home).client, home)
    for run_id in done:
        console.print(f"recorded run {run_id}")
    if left:
        print(f"posttrain sync: {len(left)} run(s) still wait: {', '.join(left)}", file=sys.stderr)
    broken = broken_journals(home)
    for problem in broken:
        print(f"posttrain sync: {problem}", file=sys.stderr)
    return EXIT_BAD_INPUT if broken else EXIT_STAGE_FAILED if left else EXIT_OK


def _ui(args, console) -> int:
    """``posttrain ui``: MLflow's UI on the home's store until Ctrl-C (flows/servers/ui.py)."""
    from flows.servers.ui import UiError, ui_command

    try:
        return ui_command(args.port, console)
    except UiError as error:
        print(f"posttrain ui: {error}; nothing was started", file=sys.stderr)
        return EXIT_BAD_INPUT


# ------------------------------------------------------------------ posttrain run


class _EmptyStore:
    """A tracking store with no runs, for planning before the real one exists."""

    def find_cached(self, experiment_id, stage, fingerprint):
        return None


def run_from_cli(loaded, options, console):
    """What ``posttrain run`` does after validation: plan, then the Prefect flow, or no flow if all cached.

    When every selected stage is a cache hit there is nothing to launch, so no flow is
    started (nor Prefect imported): the pipeline run is still recorded in MLflow and
    summarised, which keeps a fully cached rerun close to the cost of a few MLflow queries
    instead of Prefect's ~10 s server start-up.
    """
    from flows.recording.home import artifact_root, configure_environment, create_home_dir, posttrain_home, uses_local_mlflow
    from flows.planning.lineage import Action, PlanError, plan_run
    from flows.execution.pipeline import prepare_store, print_plan, run_pipeline
    from flows.servers.prefect_server import early_start, prefect_api, stop_server
    from flows.recording.store import TrackingUnavailable, TrackingUnusable, check_tracking_store

    home = posttrain_home()
    if uses_local_mlflow() and not (home / "mlflow.db").exists():
        # Nothing is cached in a store that does not exist yet: a plan that cannot start (--only
        # without upstream outputs) is refused before the home or the store is created.
        plan_run(loaded, options, _EmptyStore(), None)
    else:
        try:
            check_tracking_store()
        except TrackingUnavailable as error:
            raise PlanError(f"{error}; start it, or unset MLFLOW_TRACKING_URI to use the local store") from None
        except TrackingUnusable as error:
            raise PlanError(f"{error}; or unset MLFLOW_TRACKING_URI to use the local store") from None
    fresh_store = uses_local_mlflow() and not (home / "mlflow.db").exists()
    # A new home runs everything, and --only/--from/--force run something unless refused: the
    # Prefect server (if one is needed) starts first, so that its ~3 s start-up overlaps MLflow's
    # import and store, and the planning; it is stopped again if the plan is refused.
    started = None
    if fresh_store or options.only or options.from_stage or options.force or options.no_cache:
        create_home_dir(home)
        started = early_start(home)
    home = configure_environment()
    try:
        tracker = prepare_store(home, console)
        experiment_id = tracker.experiment_id(loaded.spec.name, artifact_root(home))
        for run_id in tracker.reap_dead_runs(experiment_id):
            console.print(f"[yellow]run {run_id} was left RUNNING by a process that died; marked FAILED[/yellow]")
        decisions = plan_run(loaded, options, tracker, experiment_id)
        _check_pools(loaded, decisions)
    except PlanError:
        if started:
            stop_server(home)
        raise
    console.print(f"plan for {loaded.spec.name}:")
    print_plan(decisions, console)
    if not any(d.action is Action.RUN for d in decisions):
        console.print("every selected stage is cached; nothing to launch")
        return run_pipeline(loaded, options, home, decisions=decisions)
    with prefect_api(home):
        from flows.execution.deployment import run_flow  # Prefect reads its API URL when first imported

        first = next(d.stage for d in decisions if d.action is Action.RUN)
        if loaded.spec.resources_for(first).pool:  # it runs elsewhere: start-up ends here (flows/servers/startup.py)
            from flows.servers import startup
            startup.end()
        return run_flow(loaded, options, decisions)


def _check_pools(loaded, decisions) -> None:
    """Stages that will run on a work pool need a real Prefect server and that pool."""
    import os

    from flows.planning.lineage import Action, PlanError

    pooled = {d.stage: loaded.spec.resources_for(d.stage) for d in decisions if d.action is Action.RUN}
    pooled = {stage: resources for stage, resources in pooled.items() if resources.pool}
    if not pooled:
        return
    if not os.environ.get("PREFECT_API_URL"):
        stage, resources = next(iter(pooled.items()))
        raise PlanError(f"stage {stage!r} runs on work pool {resources.pool!r}, which needs a Prefect server with "
                        "workers: set PREFECT_API_URL (see README, Scaling out)")
    from flows.execution.deployment import DeployError, require_pool

    for stage, resources in pooled.items():
        try:
            require_pool(resources.pool, resources.nodes)
        except DeployError as error:
            raise PlanError(f"stage {stage!r}: {error}") from None


if __name__ == "__main__":
    sys.exit(main())
