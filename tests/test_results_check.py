"""`bench/results.py --check`: the README's claims (a gain's sign and interval, a figure in its band) checked on
recorded sweep results, through the real command; and the shipped claims file quotes the README word for word."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CLAIMS = """
studies:
  toy: {sweep: [pipelines/quickstart.yaml, --seeds, 0, 1, 2]}
claims:
  - id: rl-beats-sft
    study: toy
    says: RL beats SFT on every seed.
    gain: {of: eval_rl, over: eval_sft}
    per_seed: above_zero
    over_seeds: above_zero
  - id: rl-figure
    study: toy
    says: RL reaches about 0.7.
    figure: {stage: eval_rl}
    band: [0.60, 0.85]
"""

PAGE = "# toy\n\nOn the toy pipeline **RL beats SFT** on every\nseed. RL reaches about 0.7.\n"


def results(rl: dict[str, float], gains: dict[str, tuple[float, float, float]]) -> dict:
    return {"machine": "a test CPU", "studies": {"toy": {
        "figures": {"eval_rl": {"pass_at_1": rl}, "eval_sft": {"pass_at_1": {"0": 0.37, "1": 0.36, "2": 0.36}}},
        "gains": {"eval_rl - eval_sft": {"pass_at_1": {
            seed: {"mean": mean, "low": low, "high": high, "method": "paired z"}
            for seed, (mean, low, high) in gains.items()}}}}}}


def check(tmp_path: Path, recorded: dict, page: str = PAGE, claims: str = CLAIMS) -> subprocess.CompletedProcess:
    (tmp_path / "claims.yaml").write_text(claims)
    (tmp_path / "results.json").write_text(json.dumps(recorded))
    (tmp_path / "README.md").write_text(page)
    return subprocess.run([sys.executable, str(ROOT / "bench" / "results.py"), "--check", "--claims",
                           str(tmp_path / "claims.yaml"), "--results", str(tmp_path / "results.json"),
                           "--readme", str(tmp_path / "README.md")], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)


HOLDING_GAINS = {"0": (0.33, 0.28, 0.38), "1": (0.39, 0.33, 0.45), "2": (0.30, 0.24, 0.35)}


def test_claims_that_hold_pass_whatever_the_digits(tmp_path):
    # two machines' digits, both within the claims: the check passes on each
    for rl in ({"0": 0.702, "1": 0.752, "2": 0.652}, {"0": 0.784, "1": 0.681, "2": 0.732}):
        done = check(tmp_path, results(rl, HOLDING_GAINS))
        assert done.returncode == 0, done.stdout + done.stderr
        assert "2 of 2 claims checked on a test CPU: 2 hold, 0 fail" in done.stdout


def test_a_gain_whose_interval_holds_zero_fails_and_says_which_seed(tmp_path):
    done = check(tmp_path, results({"0": 0.70, "1": 0.75, "2": 0.65}, {**HOLDING_GAINS, "2": (0.03, -0.01, 0.08)}))
    assert done.returncode == 1
    assert "FAILS  rl-beats-sft (toy)" in done.stdout
    assert "seed 2's paired interval [-0.010, +0.080] does not lie above 0" in done.stdout
    assert "1 hold, 1 fail" in done.stdout


def test_a_gain_whose_sign_differs_across_seeds_fails_over_seeds(tmp_path):
    done = check(tmp_path, results({"0": 0.70, "1": 0.75, "2": 0.65},
                                    {"0": (0.30, 0.25, 0.35), "1": (-0.05, -0.10, 0.00), "2": (0.30, 0.25, 0.35)}))
    assert done.returncode == 1
    assert "seed 1's paired interval [-0.100, +0.000] does not lie above 0" in done.stdout
    assert "the interval over seeds" in done.stdout and "does not lie above 0" in done.stdout


def test_a_figure_out_of_its_band_fails_and_says_so(tmp_path):
    done = check(tmp_path, results({"0": 0.70, "1": 0.90, "2": 0.65}, HOLDING_GAINS))
    assert done.returncode == 1
    assert "FAILS  rl-figure (toy)" in done.stdout
    assert "seed 1's 0.900 lies outside the band [0.6, 0.85]" in done.stdout


def test_a_claim_the_page_no_longer_makes_fails(tmp_path):
    done = check(tmp_path, results({"0": 0.70, "1": 0.75, "2": 0.65}, HOLDING_GAINS),
                 page=PAGE.replace("RL reaches about 0.7.", "RL reaches 0.9."))
    assert done.returncode == 1
    assert 'README.md does not say "RL reaches about 0.7."' in done.stdout


def test_a_study_without_results_is_not_checked_and_nothing_checked_is_not_a_pass(tmp_path):
    done = check(tmp_path, {"machine": "a test CPU", "studies": {}})
    assert done.returncode == 2
    assert "not checked (no results for their study): rl-beats-sft, rl-figure" in done.stdout


def test_the_shipped_claims_quote_the_readme():
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "results.py"), "--check", "--results", "/dev/stdin"],
                          input=json.dumps({"machine": "-", "studies": {}}), capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    assert "does not say" not in done.stdout, done.stdout
    assert done.returncode == 2, done.stdout + done.stderr


@pytest.mark.parametrize("bad", ["band: [0.6]", "per_seed: above"])
def test_a_malformed_claim_is_refused_by_name(tmp_path, bad):
    claims = CLAIMS.replace("band: [0.60, 0.85]", bad) if "band" in bad else CLAIMS.replace("per_seed: above_zero", bad)
    done = check(tmp_path, results({"0": 0.70, "1": 0.75, "2": 0.65}, HOLDING_GAINS), claims=claims)
    assert done.returncode == 2
    assert ("rl-figure" if "band" in bad else "rl-beats-sft") in done.stderr


def test_the_landing_page_and_the_benchmarks_stay_readable():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 250, "README.md is a landing page: at most 250 lines (histories go to docs/)"
    for image in ("docs/img/quickstart-learning.png", "docs/img/quickstart-compare.png"):
        assert image in readme and (ROOT / image).stat().st_size < 150_000, image
    cells = [(number, cell.strip()) for number, line in
             enumerate((ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8").splitlines(), 1)
             if line.startswith("|") for cell in line.strip().strip("|").split(" | ")]
    long = [f"docs/benchmarks.md:{number}: a cell of {len(cell)} characters"
            for number, cell in cells if len(cell) > 1000]
    assert not long, "\n".join(long)
