"""Freshly migrated, empty SQLite databases, kept once per library version, that a new home copies.

A new home's MLflow store and Prefect database are SQLite files their libraries build by
running every schema migration since their first release: about 1 s for MLflow 3.17 and
3 s for Prefect 3.9 (which then registers its ~50 block types) on a 2-core machine, all
before a fresh run's first stage. What they build depends only on the library's version,
so the first home made with a version saves a copy of its database as it stood right after
the migrations (nothing of a run in it yet), and later homes copy that copy instead.

The copies live in ``$POSTTRAIN_CACHE_DIR`` (default ``$XDG_CACHE_HOME/posttrain``, else
``~/.cache/posttrain``), one file per library and version (``mlflow-3.17.2.db``; Prefect's name
also hashes the Prefect collections installed, whose block types it registers). They are
an optimisation only: a cache that cannot be written or read is ignored and the library
migrates as it would have. A copy is written to a temporary name and renamed into place,
so a reader never sees half of one; ``POSTTRAIN_CACHE_DIR=`` (empty) turns them off.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import sqlite3
import tempfile
from importlib import metadata
from pathlib import Path

# Tables each library fills while it migrates and starts up, and nothing else: a database
# holding rows anywhere else (a run already used it) is never saved as a template.
SCHEMA_TABLES = {
    "mlflow": {"alembic_version", "workspaces"},
    "prefect": {"alembic_version", "block_type", "block_schema", "block_schema_reference"},
}


def cache_dir() -> Path | None:
    configured = os.environ.get("POSTTRAIN_CACHE_DIR")
    if configured is not None:
        return Path(configured) if configured else None
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "posttrain"


def template_path(library: str) -> Path | None:
    """Where the template for the installed version of ``library`` lives (None: templates are off)."""
    where = cache_dir()
    if where is None:
        return None
    try:
        version = metadata.version(library)
    except metadata.PackageNotFoundError:
        return None
    if library == "prefect":  # its block types come from Prefect and from the collections installed beside it
        collections = sorted(f"{e.name}={e.value}@{e.dist.name if e.dist else ''}-{e.dist.version if e.dist else ''}"
                             for e in metadata.entry_points(group="prefect.collections"))
        if collections:
            version += "-" + hashlib.sha256("\n".join(collections).encode()).hexdigest()[:12]
    return where / f"{library}-{version}.db"


def copy_template(library: str, database: Path) -> bool:
    """Make ``database`` (which must not exist) a copy of the library's template; whether it did."""
    template = template_path(library)
    if template is None or not template.is_file() or database.exists():
        return False
    database.parent.mkdir(parents=True, exist_ok=True)
    partial = database.with_name(database.name + ".partial")
    try:
        shutil.copyfile(template, partial)
        os.replace(partial, database)
    except OSError:
        partial.unlink(missing_ok=True)
        return False
    return True


def save_template(library: str, database: Path) -> bool:
    """Save ``database`` as the library's template, once, if only migrations have written to it.

    Uses SQLite's online backup, so a database in use by its server is copied consistently;
    MLflow's default experiment (its artifact location is the home's) is left out: MLflow
    creates it again, pointing at the new home, when it opens the copy."""
    template = template_path(library)
    if template is None or template.exists() or not database.is_file():
        return False
    try:
        template.parent.mkdir(parents=True, exist_ok=True)
        fd, partial = tempfile.mkstemp(dir=template.parent, prefix=template.name, suffix=".partial")
        os.close(fd)
    except OSError:
        return False
    try:
        with contextlib.closing(sqlite3.connect(database)) as source, \
                contextlib.closing(sqlite3.connect(partial)) as copy:
            source.backup(copy)
            copy.execute("PRAGMA journal_mode=DELETE")  # all in the one file that is copied (Prefect's is WAL)
            if library == "mlflow":
                copy.execute("DELETE FROM experiment_tags")
                copy.execute("DELETE FROM experiments")
                copy.commit()
            if _has_rows_beyond_the_schema(copy, SCHEMA_TABLES[library]):
                return False
        os.replace(partial, template)
        return True
    except (OSError, sqlite3.Error):
        return False
    finally:
        Path(partial).unlink(missing_ok=True)


def _has_rows_beyond_the_schema(connection: sqlite3.Connection, schema_tables: set[str]) -> bool:
    tables = [name for (name,) in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
    if not schema_tables <= set(tables):
        return True  # not what this library's migrations make
    return any(connection.execute(f'SELECT 1 FROM "{table}" LIMIT 1').fetchone()
               for table in tables if table not in schema_tables and not table.startswith("sqlite_"))
