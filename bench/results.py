"""The README's learning claims, checked on sweep results: signs, intervals and bands, not digits.

    python bench/results.py --check --home quickstart=/tmp/res-quickstart --home ppo=/tmp/res-ppo ...
    python bench/results.py --check --run [--studies quickstart ppo]      # runs the sweeps itself
    python bench/results.py --table --home quickstart=/tmp/res-quickstart  # the README's table of a study

The claims live in ``bench/claims.yaml`` (``--claims``): each study is a ``posttrain sweep`` of a
shipped pipeline over seeds (and a grid), and each claim says something the README says about it
(``says``, which must appear in the README word for word, whitespace and ``**`` aside):

- a gain of one eval stage over another (``gain: {of, over, metric}``) that is positive on every
  seed (``per_seed: positive``), whose paired 95% interval over the prompts lies above 0 on every
  seed (``per_seed: above_zero``), whose 95% t interval over the seeds lies above 0
  (``over_seeds: above_zero``), or whose mean over seeds lies in ``mean_in: [low, high]``;
- a figure (``figure: {stage, metric}``) whose every seed lies in ``band: [low, high]``, the spread
  measured across seeds and CPU kinds (``measured`` says where from), or whose mean lies in ``mean_in``.

RL turns a float's difference between CPU kinds into another trajectory (the quickstart's seed 0
moves by about 0.1 between an AMX, an AVX-512 and an AVX2 machine: README), so one seed's digits
hold on one machine only; the claims are what must hold on every machine. ``--results FILE`` reads
results saved by ``--save FILE`` instead of homes. The last line says how many claims hold; the
exit status is 1 when one fails, 2 when none could be checked.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from flows.recording.tags import TAG_ROLE, TAG_SEED, TAG_STAGE, TAG_VARIANT  # noqa: E402

CLAIMS = ROOT / "bench" / "claims.yaml"
NO_VARIANT = "-"  # = flows.compare.NO_VARIANT


# ------------------------------------------------------------------ results from a home


def stage_label(stage: str, variant: str) -> str:
    """How claims name a stage of a sweep variant: ``eval_dpo`` or ``eval_dpo [stages.dpo.loss=ipo]``."""
    return stage if variant == NO_VARIANT else f"{stage} [{variant}]"


def gains_of(claims: list[dict], study: str) -> set[tuple[str, str, str]]:
    """The (of, over, metric) gains the claims on ``study`` ask about."""
    return {(c["gain"]["of"], c["gain"]["over"], c["gain"].get("metric", "pass_at_1"))
            for c in claims if c["study"] == study and "gain" in c}


def table_gains(study: dict) -> set[tuple[str, str, str]]:
    """The (of, over, metric) gains a study's README table shows, claimed or not."""
    return {(*key.split(" - ", 1), "pass_at_1") for key in study.get("table", {}).get("gains", [])}


def read_home(home: Path, gains: set[tuple[str, str, str]]) -> dict:
    """A home's figures (label -> metric -> seed -> value, the newest finished stage run of each) and the
    asked-for gains (label -> metric -> seed -> paired difference over prompts, with its 95% interval)."""
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{home}/mlflow.db"
    os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = "false"
    from mlflow.tracking import MlflowClient

    from flows.compare import difference, evaluated_checkpoints

    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    figures: dict[str, dict[str, dict[str, float]]] = {}
    eval_rows = {}
    for experiment in client.search_experiments():
        runs = client.search_runs([experiment.experiment_id], f"tags.`{TAG_ROLE}` = 'stage' and "
                                  "attributes.status = 'FINISHED'", order_by=["attributes.start_time ASC"],
                                  max_results=5000)
        for run in runs:  # oldest first: a stage run again overwrites
            tags = run.data.tags
            label = stage_label(tags.get(TAG_STAGE, "?"), tags.get(TAG_VARIANT, NO_VARIANT))
            for metric, value in run.data.metrics.items():
                figures.setdefault(label, {}).setdefault(metric, {})[tags.get(TAG_SEED, "-")] = value
        for row in evaluated_checkpoints(client, experiment.experiment_id, register_missing=False)[::-1]:
            eval_rows[(stage_label(row.eval_stage, row.variant), row.seed)] = row
    found = {}
    for of, over, metric in sorted(gains):
        for (label, seed), row in eval_rows.items():
            if label == of and (over, seed) in eval_rows:
                estimate = difference(client, eval_rows[(over, seed)], row, metric)
                if estimate is not None:
                    found.setdefault(f"{of} - {over}", {}).setdefault(metric, {})[seed] = {
                        "mean": estimate.mean, "low": estimate.low, "high": estimate.high, "method": estimate.method}
    return {"home": str(home), "figures": figures, "gains": found}


def run_sweep(study: str, spec: dict, home: Path) -> float:
    """Wall seconds of the study's ``posttrain sweep`` in ``home`` (its Prefect server stopped after)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL", "PREFECT_HOME")}
    env["POSTTRAIN_HOME"] = str(home)
    command = [sys.executable, "-m", "flows.cli", "sweep", *[str(a) for a in spec["sweep"]]]
    print(f"{study}: POSTTRAIN_HOME={home} posttrain sweep {' '.join(command[4:])}", flush=True)
    started = time.perf_counter()
    done = subprocess.run(command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seconds = time.perf_counter() - started
    subprocess.run([sys.executable, "-m", "flows.cli", "server", "stop"], env=env, cwd=ROOT,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if done.returncode != 0:
        raise SystemExit(f"{study}: the sweep failed (exit {done.returncode}):\n{done.stdout[-3000:]}")
    print(f"{study}: {seconds:.0f} s", flush=True)
    return seconds


def machine() -> str:
    """The CPU, as lscpu names it, with the vector extensions that move RL's floats."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = re.search(r"Model name:\s*(.+)", text).group(1).strip()
        flags = set(re.search(r"Flags:\s*(.+)", text).group(1).split())
    except (OSError, AttributeError):
        pass
    kinds = [name for name, flag in (("AMX", "amx_bf16"), ("AVX-512 BF16", "avx512_bf16"), ("AVX-512", "avx512f"),
                                     ("AVX2", "avx2")) if flag in flags]
    return f"{model} ({', '.join(kinds[:1]) or 'no AVX2'}), {os.cpu_count()} cores"


# ------------------------------------------------------------------ the check


CLAIM_TESTS = {"per_seed": ("positive", "above_zero"), "over_seeds": ("above_zero",)}


def claim_errors(spec: dict, path: Path) -> list[str]:
    """Every mistake in a claims file at once, each naming its claim."""
    errors, studies = [], spec.get("studies") or {}
    for i, claim in enumerate(spec.get("claims") or []):
        where = f"{path}: claims[{i}] ({claim.get('id', 'no id')})"
        if claim.get("study") not in studies:
            errors.append(f"{where}: study {claim.get('study')!r} is not one of {', '.join(studies)}")
        if not claim.get("says"):
            errors.append(f"{where}: `says` (the README's words for the claim) is missing")
        if ("gain" in claim) == ("figure" in claim):
            errors.append(f"{where}: a claim is about a `gain` or a `figure`, one of the two")
        for name, allowed in CLAIM_TESTS.items():
            if name in claim and claim[name] not in allowed:
                errors.append(f"{where}: {name}: {claim[name]!r} is not one of {', '.join(allowed)}")
        for name in ("band", "mean_in"):
            value = claim.get(name)
            if value is not None and not (isinstance(value, list) and len(value) == 2
                                          and all(isinstance(v, (int, float)) for v in value) and value[0] <= value[1]):
                errors.append(f"{where}: {name}: {value!r} is not [low, high]")
        tests = [n for n in (*CLAIM_TESTS, "band", "mean_in") if n in claim]
        if not tests:
            errors.append(f"{where}: says nothing to check (per_seed, over_seeds, band or mean_in)")
    return errors


def normalised(text: str) -> str:
    return " ".join(text.replace("**", "").split())


def per_seed(values: dict[str, object]) -> str:
    return ", ".join(f"seed {seed} {shown(value)}" for seed, value in sorted(values.items()))


def shown(value) -> str:
    if isinstance(value, dict):
        return f"{value['mean']:+.3f} [{value['low']:+.3f}, {value['high']:+.3f}]"
    return f"{value:.3f}"


def over_seeds(values: list[float]):
    from stages.intervals import seed_estimate

    return seed_estimate(values)


def check_claim(claim: dict, results: dict) -> tuple[bool, str]:
    """(holds, what was found, led by what contradicts the claim) for one claim on one study's results."""
    checked = check_gain if "gain" in claim else check_figure
    failures, text = checked(claim, results)
    if failures is None:
        return False, text
    return not failures, "; ".join(failures) + (" -- " if failures else "") + text


def check_gain(claim: dict, results: dict) -> tuple[list[str] | None, str]:
    gain = claim["gain"]
    key, metric = f"{gain['of']} - {gain['over']}", gain.get("metric", "pass_at_1")
    found = results["gains"].get(key, {}).get(metric)
    if not found:
        return None, f"no paired gain {key} ({metric}) in the results: is the study's sweep complete?"
    failures = []
    if claim.get("per_seed") == "positive":
        failures += [f"seed {s} gains {v['mean']:+.3f}, not above 0" for s, v in sorted(found.items())
                     if v["mean"] <= 0]
    if claim.get("per_seed") == "above_zero":
        failures += [f"seed {s}'s paired interval [{v['low']:+.3f}, {v['high']:+.3f}] does not lie above 0"
                     for s, v in sorted(found.items()) if v["low"] <= 0]
    estimate = over_seeds([v["mean"] for v in found.values()])
    if claim.get("over_seeds") == "above_zero" and not estimate.low > 0:
        failures.append(f"the interval over seeds [{estimate.low:+.3f}, {estimate.high:+.3f}] does not lie above 0")
    if "mean_in" in claim and not claim["mean_in"][0] <= estimate.mean <= claim["mean_in"][1]:
        failures.append(f"the mean gain {estimate.mean:+.3f} lies outside {claim['mean_in']}")
    return failures, f"{key}, {metric}: {per_seed(found)}; over seeds {estimate.text()} ({estimate.method})"


def check_figure(claim: dict, results: dict) -> tuple[list[str] | None, str]:
    figure = claim["figure"]
    metric = figure.get("metric", "pass_at_1")
    found = results["figures"].get(figure["stage"], {}).get(metric)
    if not found:
        return None, f"no {figure['stage']} {metric} in the results: is the study's sweep complete?"
    failures = []
    if "band" in claim:
        low, high = claim["band"]
        failures += [f"seed {s}'s {v:.3f} lies outside the band [{low}, {high}]"
                     for s, v in sorted(found.items()) if not low <= v <= high]
    estimate = over_seeds(list(found.values()))
    if "mean_in" in claim and not claim["mean_in"][0] <= estimate.mean <= claim["mean_in"][1]:
        failures.append(f"the mean {estimate.mean:.3f} lies outside {claim['mean_in']}")
    return failures, f"{figure['stage']}, {metric}: {per_seed(found)}; mean {estimate.mean:.3f} ± {estimate.se:.3f}"


def check(claims_file: Path, results: dict, readme: Path | None) -> int:
    """Print one line per claim and a last line; the exit status (0 all hold, 1 one fails, 2 none checked)."""
    claims = yaml.safe_load(claims_file.read_text(encoding="utf-8"))["claims"]
    page = normalised(readme.read_text(encoding="utf-8")) if readme else None
    held, failed, unchecked = 0, 0, []
    for claim in claims:
        where = f"{claim['id']} ({claim['study']})"
        if page is not None and normalised(claim["says"]) not in page:
            failed += 1
            print(f"FAILS  {where}: {readme.name} does not say \"{claim['says']}\" (edit the claim with the README)")
            continue
        study = results["studies"].get(claim["study"])
        if study is None:
            unchecked.append(claim["id"])
            continue
        holds, text = check_claim(claim, study)
        held, failed = held + holds, failed + (not holds)
        print(f"{'holds' if holds else 'FAILS'}  {where}: \"{claim['says']}\": {text}")
    if unchecked:
        print(f"not checked (no results for their study): {', '.join(unchecked)}")
    print(f"{held + failed} of {len(claims)} claims checked on {results.get('machine', '?')}: "
          f"{held} hold, {failed} fail")
    return 1 if failed else (2 if not held else 0)


# ------------------------------------------------------------------ the README's tables


def table(study: str, results: dict, stages: list, gains: list[str], metric: str = "pass_at_1") -> list[str]:
    """A markdown table: each stage's figure per seed (± its SE over prompts) and mean ± SE over seeds, then each
    paired gain per seed with its 95% interval over prompts and its mean with a t interval over seeds. A stage
    given as ``{stage: rm, metric: heldout_pairwise_accuracy}`` shows that metric instead of ``metric``."""
    figures, found = results["figures"], results["gains"]
    seeds = sorted({s for label in stages if isinstance(label, str) for s in figures.get(label, {}).get(metric, {})}
                   | {s for key in gains for s in found.get(key, {}).get(metric, {})})
    if not seeds:
        return [f"{study}: no results yet"]
    lines = [f"| {study}, `{metric}` | " + " | ".join(f"seed {s}" for s in seeds) + " | mean ± SE over seeds |",
             "|---|" + "---|" * (len(seeds) + 1)]
    for entry in stages:
        label, shown_metric = (entry, metric) if isinstance(entry, str) else (entry["stage"], entry["metric"])
        values = figures.get(label, {}).get(shown_metric, {})
        ses = figures.get(label, {}).get(f"se/{shown_metric}", {})
        cells = [f"{values[s]:.3f}" + (f" ± {ses[s]:.3f}" if s in ses else "") if s in values else "–" for s in seeds]
        estimate = over_seeds([values[s] for s in seeds if s in values]) if values else None
        name = f"`{label}`" + ("" if shown_metric == metric else f" `{shown_metric}`")
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {spread(estimate)} |")
    for key in gains:
        values = found.get(key, {}).get(metric, {})
        estimate = over_seeds([values[s]["mean"] for s in seeds if s in values]) if values else None
        interval = f"**{estimate.text()}**" if estimate and estimate.n > 1 else "–"
        lines.append(f"| {key.replace(' - ', ' − ')} (95%) | "
                     + " | ".join(shown(values[s]) if s in values else "–" for s in seeds) + f" | {interval} |")
    return lines


def spread(estimate) -> str:
    """mean ± SE over seeds, or what one seed cannot say."""
    if estimate is None:
        return "–"
    return f"{estimate.mean:.3f} ± {estimate.se:.3f}" if estimate.n > 1 else f"{estimate.mean:.3f} (1 seed)"


# ------------------------------------------------------------------ the command


def gather(args, claims: list[dict], studies: dict) -> dict:
    """Results of every asked-for study: read from its ``--home``, or from a sweep ``--run`` in a fresh home."""
    homes = dict(item.split("=", 1) for item in args.home)
    names = args.studies or (list(studies) if args.run else list(homes))
    unknown = sorted((set(homes) | set(names)) - set(studies))
    if unknown:
        raise SystemExit(f"{unknown[0]}: no such study in {args.claims} (it has {', '.join(studies)})")
    missing = [name for name in names if not args.run and name not in homes]
    if missing:
        raise SystemExit(f"{missing[0]}: no results to read; give --home {missing[0]}=DIR, or --run to run its sweep")
    results = {"machine": machine(), "studies": {}}
    for name in names:
        if args.run:
            home = Path(tempfile.mkdtemp(prefix=f"posttrain-claims-{name}-"))
            results.setdefault("seconds", {})[name] = round(run_sweep(name, studies[name], home))
        else:
            home = Path(homes[name])
        results["studies"][name] = read_home(home, gains_of(claims, name) | table_gains(studies[name]))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--claims", type=Path, default=CLAIMS)
    parser.add_argument("--readme", default=str(ROOT / "README.md"),
                        help="the page whose words the claims quote (--readme '' skips that)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--run", action="store_true", help="run each study's sweep in a fresh home first")
    source.add_argument("--results", type=Path, help="results saved by --save, instead of homes")
    parser.add_argument("--home", action="append", default=[], metavar="STUDY=DIR",
                        help="a home holding the study's sweep (repeatable)")
    parser.add_argument("--studies", nargs="+", help="only these studies (default: every one given or claimed)")
    parser.add_argument("--check", action="store_true", help="check the claims")
    parser.add_argument("--table", action="store_true", help="print each study's table for the README")
    parser.add_argument("--save", type=Path, help="write the results read or run as JSON")
    args = parser.parse_args()

    spec = yaml.safe_load(args.claims.read_text(encoding="utf-8"))
    errors = claim_errors(spec, args.claims)
    if errors:
        print("\n".join(errors), file=sys.stderr)
        raise SystemExit(2)
    claims, studies = spec["claims"], spec["studies"]
    started = time.perf_counter()
    results = json.loads(args.results.read_text(encoding="utf-8")) if args.results else gather(args, claims, studies)
    if args.studies:
        results["studies"] = {k: v for k, v in results["studies"].items() if k in args.studies}
    if args.save:
        args.save.write_text(json.dumps(results, indent=1), encoding="utf-8")
    if args.table:
        for name, study in results["studies"].items():
            shown_stages = studies[name].get("table", {})
            print("\n".join(table(name, study, shown_stages.get("stages", []), shown_stages.get("gains", []))) + "\n")
    if args.check:
        code = check(args.claims, results, Path(args.readme) if args.readme else None)
        print(f"({time.perf_counter() - started:.0f} s)")
        raise SystemExit(code)


if __name__ == "__main__":
    main()
