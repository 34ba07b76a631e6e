"""The ``posttrain`` command line.

Exit status: 0 success, 1 a stage failed at run time, 2 bad input (nothing started).
"""

from __future__ import annotations

import argparse
import sys

EXIT_OK, EXIT_STAGE_FAILED, EXIT_BAD_INPUT = 0, 1, 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="posttrain",
        description="Declarative post-training pipelines (SFT, RL, evaluation) run as Prefect flows, "
        "versioned in MLflow.",
    )
    from flows import __version__

    parser.add_argument("--version", action="version", version=f"posttrain {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def with_overrides(sub):
        sub.add_argument("file", help="pipeline YAML file")
        sub.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                         help="override a field, e.g. --set stages.sft.max_steps=50 (repeatable)")

    validate = commands.add_parser("validate", help="check a pipeline and print its stage graph; runs nothing")
    with_overrides(validate)

    check = commands.add_parser("check-reward", help="score the pipeline's known reward cases; exit 1 on a violation")
    with_overrides(check)
    check.add_argument("--reward", metavar="NAME", action="append", default=[],
                       help="check only this reward (repeatable); default every reward with cases")

    run = commands.add_parser("run", help="run a pipeline (cached stages are reused)")
    with_overrides(run)
    picks = run.add_mutually_exclusive_group()
    picks.add_argument("--only", metavar="STAGE", help="run only STAGE, against cached upstream outputs")
    picks.add_argument("--from", dest="from_stage", metavar="STAGE", help="rerun STAGE and everything downstream")
    run.add_argument("--force", metavar="STAGE", action="append", default=[],
                     help="ignore STAGE's cache (downstream becomes stale); repeatable")
    run.add_argument("--no-cache", action="store_true", help="ignore every cache entry")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from rich.console import Console

    from flows.home import configure_environment

    configure_environment()  # before Prefect or MLflow are imported
    console = Console() if sys.stdout.isatty() else Console(width=160)  # logs and CI get full rows

    from flows.spec import SpecError, load_pipeline

    try:
        loaded = load_pipeline(args.file, args.overrides)
    except SpecError as error:
        count = len(error.issues)
        print(f"{args.file}: {count} error{'s' if count != 1 else ''}; nothing was run", file=sys.stderr)
        for issue in error.issues:
            print("  " + issue.render(error.source), file=sys.stderr)
        return EXIT_BAD_INPUT

    if args.command == "validate":
        from flows.graph import render_graph

        console.print(f"{args.file}: valid pipeline {loaded.spec.name!r} with {len(loaded.spec.stages)} stages")
        console.print("stage graph (run order):")
        console.print(render_graph(loaded.spec), highlight=False, markup=False)
        return EXIT_OK

    if args.command == "check-reward":
        from flows.checks import check_rewards_command

        return check_rewards_command(loaded, args.reward, console)

    from flows.lineage import PlanError, RunOptions
    from flows.pipeline import print_summary, run_from_cli

    options = RunOptions(only=args.only, from_stage=args.from_stage, force=args.force, no_cache=args.no_cache)
    try:
        report = run_from_cli(loaded, options, console)
    except PlanError as error:
        print(f"posttrain run: {error}; nothing was run", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception as error:  # orchestration itself broke (a server unreachable, ...)
        print(f"posttrain run: the run could not complete: {type(error).__name__}: {error}", file=sys.stderr)
        return EXIT_STAGE_FAILED
    print_summary(report, console)
    return EXIT_STAGE_FAILED if report.failed else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
