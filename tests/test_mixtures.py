"""Data mixtures: realised per-source counts against the declared weights, the same records on a
rerun with the same seed, the recipe and counts in the stage's MLflow run, and the leakage guard
that keeps heldout data out of a training mixture."""

from __future__ import annotations

import json
import math

import pytest

from conftest import run_cli, write
from stages.data.sources import ArithmeticData, MixtureData, materialize, mix_datasets, read_materialized

PIPELINE = """\
name: mixtures
model: {init: tiny, hidden_size: 32, num_layers: 1, num_heads: 2, intermediate_size: 64}
data:
  small:   {generator: arithmetic, n: 50, seed: 1, max_operand: 4, role: train}
  large:   {generator: arithmetic, n: 300, seed: 2, min_operand: 5, max_operand: 9, role: train}
  mixed:   {mixture: {small: 0.7, large: 0.3}, n: 400, seed: 3, role: train}
  heldout: {generator: arithmetic, n: 20, seed: 999, role: heldout}
stages:
  sft: {kind: sft, model: base, data: mixed, max_steps: 1, batch_size: 4}
"""


def test_realised_counts_are_within_two_standard_deviations_and_reruns_draw_the_same(tmp_path):
    sources = {"small": [{"id": f"s{i}"} for i in range(50)], "large": [{"id": f"l{i}"} for i in range(300)]}
    spec = MixtureData(mixture={"small": 7, "large": 3}, n=2000, seed=3, role="train")  # weights are normalised
    records, counts = mix_datasets(spec, sources)
    assert sum(counts.values()) == len(records) == 2000
    for name, p in spec.probabilities().items():
        sd = math.sqrt(spec.n * p * (1 - p))  # binomial count of one source
        assert abs(counts[name] - spec.n * p) <= 2 * sd, (name, counts[name], spec.n * p, sd)
    assert sum(r["id"].startswith("s") for r in records) == counts["small"]
    # 1400 draws from 50 records: each record is drawn once per reshuffled pass, none favoured
    small_ids = [r["id"] for r in records if r["id"].startswith("s")]
    assert max(small_ids.count(i) for i in set(small_ids)) - min(small_ids.count(i) for i in set(small_ids)) <= 1
    assert mix_datasets(spec, sources) == (records, counts)  # same seed, same records
    assert mix_datasets(spec.model_copy(update={"seed": 4}), sources)[0] != records


def test_materialised_mixture_is_keyed_by_its_components_and_reports_its_counts(tmp_path):
    small = ArithmeticData(generator="arithmetic", n=50, seed=1, role="train")
    large = ArithmeticData(generator="arithmetic", n=300, seed=2, role="train")
    spec = MixtureData(mixture={"small": 0.7, "large": 0.3}, n=400, seed=3, role="train")
    datasets = {"small": small, "large": large, "mixed": spec}
    path = materialize(spec, tmp_path, tmp_path / "cache", datasets)
    report = json.loads(path.with_name(path.stem + ".mixture.json").read_text())
    assert report["recipe"] == {"small": 0.7, "large": 0.3}
    assert sum(report["counts"].values()) == len(read_materialized(path)) == 400
    assert report["available"] == {"small": 50, "large": 300}
    other = materialize(spec, tmp_path, tmp_path / "cache",
                        {**datasets, "large": large.model_copy(update={"seed": 5})})
    assert other != path  # a component that changes changes the mixture


def test_a_training_stage_logs_the_recipe_and_realised_counts(home, tmp_path):
    from flows.recording.home import configure_environment
    from flows.planning.lineage import RunOptions
    from flows.execution.pipeline import run_pipeline
    from flows.spec.loading import load_pipeline
    from flows.recording.tracking import Tracker

    home = configure_environment()
    loaded = load_pipeline(write(tmp_path / "p.yaml", PIPELINE))
    report = run_pipeline(loaded, RunOptions(), home)
    run = Tracker(home).get_run(report.rows[0].run_id)
    params = run.data.params
    assert params["data.mixed.mixture.small.weight"] == "0.7"
    assert params["data.mixed.mixture.large.weight"] == "0.3"
    counts = {name: int(params[f"data.mixed.mixture.{name}.count"]) for name in ("small", "large")}
    assert sum(counts.values()) == 400 and 240 < counts["small"] < 320
    artifact = Tracker(home).client.download_artifacts(run.info.run_id, "data_mixture_mixed.json", str(tmp_path))
    assert json.loads(open(artifact).read())["counts"] == counts


@pytest.mark.parametrize("mixed, fragment", [
    ("{mixture: {small: 0.5, heldout: 0.5}, n: 10, role: train}",
     "data.mixed.mixture.heldout: dataset 'heldout' has role heldout and cannot be a component of train mixture"),
    ("{mixture: {heldout: 0.5, small: 0.5}, n: 10, role: heldout}",
     "data.mixed.mixture.small: heldout mixture 'mixed' cannot draw from train dataset 'small'"),
    ("{mixture: {smal: 1.0}, n: 10, role: train}", "unknown dataset 'smal' (did you mean 'small'?)"),
    ("{mixture: {small: 0.0}, n: 10, role: train}", "weights must be positive and finite"),
])
def test_bad_mixtures_are_refused_with_exit_2(tmp_path, capsys, mixed, fragment):
    pipeline = write(tmp_path / "p.yaml", PIPELINE.replace(
        "{mixture: {small: 0.7, large: 0.3}, n: 400, seed: 3, role: train}", mixed))
    assert run_cli("validate", str(pipeline)) == 2
    assert fragment in capsys.readouterr().err
