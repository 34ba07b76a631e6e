"""The README's learning results, regenerated from fresh runs, and checked against the README.

    python bench/results.py [--pipelines quickstart ppo rlhf dpo dpo-ipo process smollm2-reasoning] [--seeds 0 1 2]
                            [--check README.md] [--tolerance 0.02]

Each (pipeline, seed) runs through the real CLI in its own fresh POSTTRAIN_HOME, nothing cached
between them, and its figures are read back from that home's MLflow store. The tables are printed
in the README's format, headed by the commit and the date, so they can be pasted in as they are.

``--check README.md`` compares every figure of the README's two results tables that this run regenerated
with the fresh one and lists each that differs by more than ``--tolerance`` (absolute, pass@1 and
accuracy points), then exits 1 if any did. A whole pipeline is deterministic on one install and machine:
there every figure is equal. Another install or machine changes a float somewhere and RL follows another
trajectory (35 of 69 figures moved by more than 0.02 between two installs, one by 0.86), so the README's
tables are drawn on the install constraints/cpu.txt pins and a contradiction there is a change to look
for. Figures of pipelines not run are reported as not checked. The last line says how many figures were
checked and how many differ.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Row:
    """One row of a README results table: its label cells and how to read a seed's figure."""

    label: tuple[str, ...]  # the row's first cells, as the README writes them
    figures: tuple[tuple[str, str], ...]  # (stage, metric) per figure; several are shown "a / b"
    bold: bool = False


@dataclass(frozen=True)
class Study:
    """A pipeline (with overrides) run on every seed, and the rows it fills."""

    name: str
    pipeline: str
    rows: tuple[Row, ...]
    overrides: tuple[str, ...] = ()
    table: str = "main"  # "main" (pipeline | stage | seeds) or "smollm2" (stage | seeds | mean)
    wall: dict[int, float] = field(default_factory=dict, compare=False)


STUDIES = [
    Study("quickstart", "quickstart.yaml", (
        Row(("quickstart", "`eval_base` (untrained)"), (("eval_base", "pass_at_1"),)),
        Row(("quickstart", "`eval_sft` (35%-wrong demonstrator)"), (("eval_sft", "pass_at_1"),)),
        Row(("quickstart", "`eval_grpo`"), (("eval_grpo", "pass_at_1"),), bold=True))),
    Study("ppo", "ppo.yaml", (
        Row(("ppo.yaml", "`eval_sft`"), (("eval_sft", "pass_at_1"),)),
        Row(("ppo.yaml", "`eval_ppo`"), (("eval_ppo", "pass_at_1"),), bold=True))),
    Study("rlhf", "rlhf.yaml", (
        Row(("rlhf.yaml", "`rm` held-out pairwise accuracy"), (("rm", "heldout_pairwise_accuracy"),)),
        Row(("rlhf.yaml", "`eval_sft`"), (("eval_sft", "pass_at_1"),)),
        Row(("rlhf.yaml", "`eval_ppo` (PPO against the reward model)"), (("eval_ppo", "pass_at_1"),), bold=True),
        Row(("rlhf.yaml", "`eval_sft` / `eval_ppo` best-of-8 by the RM (`best_of_n_accuracy`)"),
            (("eval_sft", "best_of_n_accuracy"), ("eval_ppo", "best_of_n_accuracy"))))),
    Study("dpo", "dpo.yaml", (
        Row(("dpo.yaml", "`eval_sft`"), (("eval_sft", "pass_at_1"),)),
        Row(("dpo.yaml", "`eval_dpo` (DPO, β 0.5)"), (("eval_dpo", "pass_at_1"),), bold=True))),
    Study("dpo-ipo", "dpo.yaml", (
        Row(("dpo.yaml", "`eval_dpo` with `--set stages.dpo.loss=ipo`"), (("eval_dpo", "pass_at_1"),)),),
        overrides=("stages.dpo.loss=ipo",)),
    Study("process", "process.yaml", (
        Row(("process.yaml", "`prm` held-out step accuracy / majority baseline / wrong steps' recall / precision"),
            (("prm", "heldout_step_accuracy"), ("prm", "heldout_majority_accuracy"), ("prm", "heldout_wrong_step_recall"),
             ("prm", "heldout_wrong_step_precision"))),
        Row(("process.yaml", "`eval_sft` pass@1 / right answers through a wrong step"),
            (("eval_sft", "pass_at_1"), ("eval_sft", "steps/steps/correct_with_wrong_step_frac"))),
        Row(("process.yaml", "`eval_ppo_outcome` (final answer only)"),
            (("eval_ppo_outcome", "pass_at_1"), ("eval_ppo_outcome", "steps/steps/correct_with_wrong_step_frac"))),
        Row(("process.yaml", "`eval_ppo_process` (+ verifier's step scores)"),
            (("eval_ppo_process", "pass_at_1"), ("eval_ppo_process", "steps/steps/correct_with_wrong_step_frac")),
            bold=True),
        Row(("process.yaml", "`eval_ppo_prm` (+ PRM's step scores)"),
            (("eval_ppo_prm", "pass_at_1"), ("eval_ppo_prm", "steps/steps/correct_with_wrong_step_frac")),
            bold=True))),
    Study("smollm2-reasoning", "smollm2-reasoning.yaml", (
        Row(("`eval_base` (the GGUF model as shipped)",), (("eval_base", "pass_at_1"),)),
        Row(("`eval_sft` (40 LoRA steps on a demonstrator that slips 40% of the time)",), (("eval_sft", "pass_at_1"),)),
        Row(("`eval_grpo` (50 LoRA GRPO steps, dynamic sampling)",), (("eval_grpo", "pass_at_1"),), bold=True)),
        table="smollm2"),
]


def run_pipeline(pipeline: str, overrides: list[str], home: str, options: tuple[str, ...] = ()) -> float:
    """Wall seconds of one ``posttrain run`` of ``pipelines/<pipeline>`` in ``home`` (its own servers, stopped after),
    with ``options`` (``--only STAGE``, ``--force STAGE``) after the overrides."""
    env = {key: value for key, value in os.environ.items()
           if key not in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL", "PREFECT_HOME")}
    env["POSTTRAIN_HOME"] = home
    command = [sys.executable, "-m", "flows.cli", "run", str(ROOT / "pipelines" / pipeline)]
    for item in overrides:
        command += ["--set", item]
    command += list(options)
    started = time.perf_counter()
    done = subprocess.run(command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seconds = time.perf_counter() - started
    subprocess.run([sys.executable, "-m", "flows.cli", "server", "stop"], env=env, cwd=ROOT,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if done.returncode != 0:
        raise SystemExit(f"{pipeline} {' '.join(overrides)} failed (exit {done.returncode}):\n{done.stdout[-3000:]}")
    return seconds


def stage_runs(home: str) -> list:
    """The finished stage runs of ``home``'s MLflow store, oldest first."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{home}/mlflow.db")
    experiments = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(experiments, "tags.`posttrain.role` = 'stage' and attributes.status = 'FINISHED'")
    return sorted(runs, key=lambda run: run.info.start_time)


def run_seed(study: Study, seed: int) -> tuple[dict[tuple[str, str], float], float]:
    """(figure -> value, wall seconds) of one fresh run of the study's pipeline under ``seed``."""
    with tempfile.TemporaryDirectory(prefix="posttrain-results-") as home:
        seconds = run_pipeline(study.pipeline, [f"seed={seed}", *study.overrides], home)
        values = {}
        for run in stage_runs(home):
            stage = run.data.tags["posttrain.stage"]
            values.update({(stage, metric): value for metric, value in run.data.metrics.items()})
        return values, seconds


def cell(row: Row, values: dict[tuple[str, str], float]) -> str:
    text = " / ".join(f"{values[figure]:.3f}" for figure in row.figures)
    return f"**{text}**" if row.bold else text


def main_table(studies: list[Study], results: dict[str, dict[int, dict]], seeds: list[int]) -> list[str]:
    lines = ["| pipeline | stage | " + " | ".join(f"seed {s}" for s in seeds) + " |",
             "|---|---|" + "---|" * len(seeds)]
    for study in studies:
        for row in study.rows:
            lines.append("| " + " | ".join(row.label) + " | "
                         + " | ".join(cell(row, results[study.name][s]) for s in seeds) + " |")
    return lines


def smollm2_table(study: Study, results: dict[int, dict], seeds: list[int]) -> list[str]:
    lines = ["| stage | " + " | ".join(f"seed {s}" for s in seeds) + " | mean |", "|---|" + "---|" * (len(seeds) + 1)]
    for row in study.rows:
        (figure,) = row.figures
        mean = sum(results[s][figure] for s in seeds) / len(seeds)
        mean_text = f"**{mean:.3f}**" if row.bold else f"{mean:.3f}"
        lines.append("| " + row.label[0] + " | " + " | ".join(cell(row, results[s]) for s in seeds)
                     + f" | {mean_text} |")
    gains = [results[s][("eval_grpo", "pass_at_1")] - results[s][("eval_sft", "pass_at_1")] for s in seeds]
    lines.append("| GRPO − SFT | " + " | ".join(f"{g:+.3f}" for g in gains) + f" | **{sum(gains) / len(gains):+.3f}** |")
    lines.append("| wall time, whole pipeline | " + " | ".join(f"{study.wall[s]:.0f} s" for s in seeds) + " | |")
    return lines


NUMBER = re.compile(r"-?\d+\.\d+")


def readme_figures(readme: str, study: Study, row: Row, seeds: list[int]) -> dict[int, list[float]] | None:
    """The README's figures of ``row`` per seed column (None when the README has no such row)."""
    prefix = "| " + " | ".join(row.label) + " |"
    line = next((line for line in readme.splitlines() if line.startswith(prefix)), None)
    if line is None:
        return None
    cells = [c.strip() for c in line[len(prefix):].strip().strip("|").split("|")]
    header = seeds_header(readme, line)
    return {seed: [float(x) for x in NUMBER.findall(cells[header.index(seed)])] for seed in seeds if seed in header}


def seeds_header(readme: str, line: str) -> list[int]:
    """The seed of each figure column of the table ``line`` belongs to (its header row)."""
    lines = readme.splitlines()
    index = lines.index(line)
    while index > 0 and not lines[index - 1].startswith("|---"):
        index -= 1
    header = lines[index - 2]
    return [int(m) for m in re.findall(r"seed (\d+)", header)]


def check(readme_path: Path, studies: list[Study], results: dict[str, dict[int, dict]], seeds: list[int],
          tolerance: float) -> int:
    readme = readme_path.read_text(encoding="utf-8")
    checked, differ = 0, []
    for study in studies:
        for row in study.rows:
            printed = readme_figures(readme, study, row, seeds)
            if printed is None:
                differ.append(f"{' / '.join(row.label)}: not in {readme_path.name}")
                continue
            for seed, figures in printed.items():
                fresh = [results[study.name][seed][figure] for figure in row.figures]
                for was, now in zip(figures, fresh):
                    checked += 1
                    if abs(was - now) > tolerance:
                        differ.append(f"{' | '.join(row.label)}, seed {seed}: README {was:.3f}, fresh {now:.3f} "
                                      f"({now - was:+.3f})")
    for line in differ:
        print(f"CONTRADICTED {line}")
    skipped = [s.name for s in STUDIES if s not in studies]
    if skipped:
        print(f"not checked (not run): {', '.join(skipped)}")
    print(f"checked {checked} figures against {readme_path.name} at tolerance {tolerance}: {len(differ)} differ")
    return 1 if differ else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pipelines", nargs="+", default=[s.name for s in STUDIES],
                        choices=[s.name for s in STUDIES], help="which studies to run (default: all)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--check", type=Path, help="the README whose figures the fresh runs must reproduce")
    parser.add_argument("--tolerance", type=float, default=0.02, help="absolute difference allowed per figure")
    args = parser.parse_args()

    studies = [s for s in STUDIES if s.name in args.pipelines]
    results: dict[str, dict[int, dict]] = {}
    started = time.perf_counter()
    for study in studies:
        results[study.name] = {}
        for seed in args.seeds:
            results[study.name][seed], study.wall[seed] = run_seed(study, seed)
            print(f"{study.name} seed {seed}: {study.wall[seed]:.0f} s", flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    print(f"\nFresh runs on commit {commit}{' (with uncommitted changes)' if dirty else ''}, "
          f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {time.perf_counter() - started:.0f} s in all:\n")
    main_studies = [s for s in studies if s.table == "main"]
    if main_studies:
        print("\n".join(main_table(main_studies, results, args.seeds)) + "\n")
    for study in studies:
        if study.table == "smollm2":
            print("\n".join(smollm2_table(study, results[study.name], args.seeds)) + "\n")
    if args.check:
        raise SystemExit(check(args.check, studies, results, args.seeds, args.tolerance))


if __name__ == "__main__":
    main()
