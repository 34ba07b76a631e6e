"""A new home's MLflow store and Prefect database start as copies of the first home's freshly
migrated ones (flows/db_templates.py): they hold none of that home's runs, MLflow points its
default experiment at the new place, a Prefect server runs flows on the copy, and a database a
run has written to is never taken as a template. Real SQLite stores, real Prefect servers."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

from conftest import ROOT
from flows.db_templates import save_template, template_path


def new_store(home: Path, monkeypatch):
    from flows.home import configure_environment
    from flows.tracking import Tracker

    monkeypatch.setenv("POSTTRAIN_HOME", str(home))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    # the store the environment names, whatever an earlier test in this process set with mlflow.set_tracking_uri
    monkeypatch.setattr("mlflow.tracking._tracking_service.utils._tracking_uri", None)
    home.mkdir(parents=True)
    monkeypatch.chdir(home)  # MLflow's default experiment keeps its artifacts under ./mlruns
    configure_environment()
    return Tracker(home).client


def test_a_new_mlflow_store_is_a_copy_of_the_first_ones_schema_without_its_runs(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("POSTTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    first = new_store(tmp_path / "first", monkeypatch)
    template = template_path("mlflow")
    assert template.parent == tmp_path / "cache" and template.is_file()
    experiment = first.create_experiment("pipeline")
    first.create_run(experiment, run_name="from the first home")

    caplog.set_level(logging.INFO, logger="mlflow.store.db.utils")
    caplog.clear()  # what the first store logged, if logging was at INFO already
    second = new_store(tmp_path / "second", monkeypatch)
    assert "Creating initial MLflow database tables" not in caplog.text  # copied, not migrated
    [default] = second.search_experiments()
    assert default.name == "Default" and "second" in default.artifact_location, default.artifact_location
    assert not second.search_runs([default.experiment_id])
    assert second.create_experiment("pipeline")  # a working store

    template.unlink()  # a store a run wrote to is never kept as the template
    assert not save_template("mlflow", tmp_path / "first" / "mlflow.db") and not template.exists()


FLOW = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path
    from prefect import flow
    from flows.home import configure_environment
    from flows.prefect_server import prefect_api, stop_server

    home = configure_environment()

    @flow
    def hello():
        return 42

    try:
        with prefect_api(home):
            print(json.dumps({"result": hello()}))
    finally:
        stop_server(home)
""")


def run_a_flow(home: Path, cache: Path) -> dict:
    env = {**os.environ, "POSTTRAIN_HOME": str(home), "POSTTRAIN_CACHE_DIR": str(cache),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    for key in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL", "PREFECT_HOME"):
        env.pop(key, None)
    done = subprocess.run([sys.executable, "-c", FLOW], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_a_new_homes_prefect_server_starts_on_a_copy_of_the_first_ones_database(tmp_path):
    cache = tmp_path / "cache"
    assert run_a_flow(tmp_path / "first", cache) == {"result": 42}
    [template] = cache.glob("prefect-*.db")
    with contextlib.closing(sqlite3.connect(template)) as db:
        assert db.execute("PRAGMA journal_mode").fetchone() == ("delete",)  # no -wal file beside it to miss
        assert db.execute("SELECT count(*) FROM flow_run").fetchone() == (0,)  # saved before the flow ran
        assert db.execute("SELECT count(*) FROM block_type").fetchone()[0] > 0
        db.execute("INSERT INTO configuration (id, key, value) VALUES ('marker', 'posttrain-test', '{}')")
        db.commit()

    assert run_a_flow(tmp_path / "second", cache) == {"result": 42}
    with contextlib.closing(sqlite3.connect(tmp_path / "second" / "prefect" / "prefect.db")) as db:
        assert db.execute("SELECT key FROM configuration WHERE id = 'marker'").fetchone() == ("posttrain-test",)
        assert db.execute("SELECT count(*) FROM flow_run").fetchone() == (1,)


def test_installing_a_prefect_collection_changes_the_prefect_template(tmp_path, monkeypatch):
    """Prefect registers the block types of the collections installed beside it: a template saved
    before one was installed would lack them, so it is not the template any more."""
    monkeypatch.setenv("POSTTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    before = template_path("prefect")
    info = tmp_path / "site" / "prefect_example-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: prefect-example\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[prefect.collections]\nprefect_example = prefect_example\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    after = template_path("prefect")
    assert before.parent == after.parent and before != after
    assert template_path("mlflow").name.startswith("mlflow-")  # MLflow's name is its version alone
