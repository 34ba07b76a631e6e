"""A new home's MLflow store and Prefect database start as copies of the first home's freshly
migrated ones (flows/servers/db_templates.py): they hold none of that home's runs, MLflow points its
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
from flows.servers.db_templates import save_template, template_path


def new_store(home: Path, monkeypatch):
    from flows.recording.home import configure_environment
    from flows.recording.tracking import Tracker

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
    from flows.recording.home import configure_environment
    from flows.servers.prefect_server import prefect_api, stop_server

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


def run_a_flow(home: Path, cache: Path | None) -> dict:
    """A flow run on posttrain's Prefect server for ``home``, with templates in ``cache`` (None: off)."""
    env = {**os.environ, "POSTTRAIN_HOME": str(home), "POSTTRAIN_CACHE_DIR": "" if cache is None else str(cache),
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


# ------------------------------------------------------------------ the templates posttrain ships


def pinned_version(library: str) -> str | None:
    for line in (ROOT / "constraints" / "cpu.txt").read_text().splitlines():
        name, _, version = line.partition("==")
        if name.strip().lower() == library:
            return version.strip()
    return None


def schema_of(database: Path) -> dict:
    """What a library's migrations and start-up decide: tables, indexes and their SQL, the revision, block types."""
    with contextlib.closing(sqlite3.connect(database)) as db:
        tables = {name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        # a table's clauses in any order: Alembic's batch migrations write its constraints in set order
        shape = {
            "sql": sorted((kind, name, sorted(line.strip().rstrip(",") for line in (sql or "").splitlines()))
                          for kind, name, sql in db.execute("SELECT type, name, sql FROM sqlite_master "
                                                            "WHERE name NOT LIKE 'sqlite_%'")),
            "revision": db.execute("SELECT version_num FROM alembic_version").fetchall(),
        }
        if "block_schema" in tables:
            shape["block types"] = sorted(db.execute("SELECT slug FROM block_type"))
            shape["block schemas"] = sorted(db.execute("SELECT checksum, version FROM block_schema"))
    return shape


def unpacked(library: str, tmp_path: Path) -> Path:
    import gzip

    from flows.servers.db_templates import shipped_path

    shipped = shipped_path(library)
    assert shipped.is_file(), (f"no shipped {library} template for the installed version ({shipped.name}): run "
                               "`python -m flows.servers.make_db_templates` after changing a pin in constraints/cpu.txt")
    target = tmp_path / f"shipped-{library}.db"
    target.write_bytes(gzip.decompress(shipped.read_bytes()))
    return target


def test_the_pinned_versions_have_shipped_templates_equal_to_a_fresh_migration(tmp_path, monkeypatch):
    """What posttrain ships is what MLflow's and Prefect's own migrations make today, with no run's rows."""
    from importlib import metadata

    for library in ("mlflow", "prefect", "pydantic"):
        if metadata.version(library) != pinned_version(library):
            import pytest

            pytest.skip(f"{library} {metadata.version(library)} is installed, not the pinned "
                        f"{pinned_version(library)}: the shipped templates are for the pinned versions")
    monkeypatch.setenv("POSTTRAIN_CACHE_DIR", "")  # templates off: both databases are migrated
    new_store(tmp_path / "migrated", monkeypatch)
    assert schema_of(unpacked("mlflow", tmp_path)) == schema_of(tmp_path / "migrated" / "mlflow.db")

    env_home = tmp_path / "prefect-migrated"
    assert run_a_flow(env_home, cache=None) == {"result": 42}
    assert schema_of(unpacked("prefect", tmp_path)) == schema_of(env_home / "prefect" / "prefect.db")


def test_a_machines_first_store_is_unpacked_from_the_shipped_template_not_migrated(tmp_path, monkeypatch, caplog):
    from flows.servers import db_templates
    monkeypatch.setenv("POSTTRAIN_CACHE_DIR", str(tmp_path / "empty-cache"))
    caplog.set_level(logging.INFO, logger="mlflow.store.db.utils")
    caplog.clear()
    client = new_store(tmp_path / "first", monkeypatch)
    assert "Creating initial MLflow database tables" not in caplog.text
    assert template_path("mlflow").is_file()  # unpacked into the cache, for the next home
    assert client.create_experiment("pipeline") and client.search_experiments()

    # A shipped file that is not a template (cut short here) is passed over: the store is migrated as before
    broken = tmp_path / "broken-shipped"
    broken.mkdir()
    good = db_templates.shipped_path("mlflow")
    (broken / good.name).write_bytes(good.read_bytes()[: len(good.read_bytes()) // 2])
    monkeypatch.setattr(db_templates, "SHIPPED", broken)
    monkeypatch.setenv("POSTTRAIN_CACHE_DIR", str(tmp_path / "another-cache"))
    caplog.clear()
    client = new_store(tmp_path / "second", monkeypatch)
    assert "Creating initial MLflow database tables" in caplog.text
    assert client.create_experiment("pipeline")
    assert template_path("mlflow").is_file() and not list((tmp_path / "another-cache").glob("*.partial"))
