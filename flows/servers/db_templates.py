"""Freshly migrated, empty SQLite databases, kept once per library version, that a new home copies.

A new home's MLflow store and Prefect database are SQLite files their libraries build by
running every schema migration since their first release: about 1 s for MLflow 3.17 and
3 s for Prefect 3.9 (which then registers its ~50 block types) on a 2-core machine, all
before a fresh run's first stage. What they build depends only on the library's version,
so the first home made with a version saves a copy of its database as it stood right after
the migrations (nothing of a run in it yet), and later homes copy that copy instead.

The copies live in ``$POSTTRAIN_CACHE_DIR`` (default ``$XDG_CACHE_HOME/posttrain``, else
``~/.cache/posttrain``), one file per library and version (``mlflow-3.17.2.db``; Prefect's name
also hashes pydantic's version, from which its block schemas are made, and the Prefect
collections installed, whose block types it registers). They are an optimisation only: a
cache that cannot be written or read is ignored and the library migrates as it would have.
A copy is written to a temporary name and renamed into place, so a reader never sees half
of one; ``POSTTRAIN_CACHE_DIR=`` (empty) turns them off.

posttrain also ships the templates of the versions ``constraints/cpu.txt`` pins, gzipped in
``flows/servers/shipped_databases/`` (``python -m flows.servers.db_templates`` remakes them), so that a
machine's very first run does not migrate either: a shipped template whose name is the
installed versions' is unpacked into the cache the first time one is needed.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import os
import shutil
import sqlite3
import tempfile
import zlib
from importlib import metadata
from pathlib import Path

from stages.models.pretrained import machine_cache_dir

# Tables each library fills while it migrates and starts up, and nothing else: a database
# holding rows anywhere else (a run already used it) is never saved as a template.
SCHEMA_TABLES = {
    "mlflow": {"alembic_version", "workspaces"},
    "prefect": {"alembic_version", "block_type", "block_schema", "block_schema_reference"},
}


def template_name(library: str) -> str | None:
    """The template's file name for the installed version of ``library`` (None: not installed)."""
    try:
        version = metadata.version(library)
    except metadata.PackageNotFoundError:
        return None
    if library == "prefect":  # its block schemas come from pydantic, its block types also from the collections
        made_by = [f"pydantic={metadata.version('pydantic')}"]
        made_by += sorted(f"{e.name}={e.value}@{e.dist.name if e.dist else ''}-{e.dist.version if e.dist else ''}"
                          for e in metadata.entry_points(group="prefect.collections"))
        version += "-" + hashlib.sha256("\n".join(made_by).encode()).hexdigest()[:12]
    return f"{library}-{version}.db"


def template_path(library: str) -> Path | None:
    """Where the template for the installed version of ``library`` lives (None: templates are off)."""
    where, name = machine_cache_dir(), template_name(library)
    return None if where is None or name is None else where / name


def copy_template(library: str, database: Path) -> bool:
    """Make ``database`` (which must not exist) a copy of the library's template; whether it did."""
    template = template_path(library)
    if template is None or database.exists() or not (template.is_file() or unpack_shipped(library, template)):
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


SHIPPED = Path(__file__).with_name("shipped_databases")


def shipped_path(library: str) -> Path | None:
    """The gzipped template posttrain ships for the installed version of ``library`` (whether or not it has one)."""
    name = template_name(library)
    return None if name is None else SHIPPED / f"{name}.gz"


def unpack_shipped(library: str, template: Path) -> bool:
    """Put the shipped template of the installed version at ``template``, if posttrain ships one; whether it did.

    A shipped file that is not such a template (cut short, holding rows of a run) is not used."""
    shipped = SHIPPED / f"{template.name}.gz"

    def unpack(partial: Path) -> None:
        with gzip.open(shipped, "rb") as packed, open(partial, "wb") as unpacked:
            shutil.copyfileobj(packed, unpacked)

    return shipped.is_file() and _write_template(library, template, unpack)


def save_template(library: str, database: Path) -> bool:
    """Save ``database`` as the library's template, once, if only migrations have written to it.

    Uses SQLite's online backup, so a database in use by its server is copied consistently;
    MLflow's default experiment (its artifact location is the home's) is left out: MLflow
    creates it again, pointing at the new home, when it opens the copy."""
    template = template_path(library)
    if template is None or template.exists() or not database.is_file():
        return False

    def backup(partial: Path) -> None:
        with contextlib.closing(sqlite3.connect(database)) as source, \
                contextlib.closing(sqlite3.connect(partial)) as copy:
            source.backup(copy)
            copy.execute("PRAGMA journal_mode=DELETE")  # all in the one file that is copied (Prefect's is WAL)
            if library == "mlflow":
                copy.execute("DELETE FROM experiment_tags")
                copy.execute("DELETE FROM experiments")
                copy.commit()

    return _write_template(library, template, backup)


def _write_template(library: str, template: Path, fill) -> bool:
    """Make ``template`` from a temporary file that ``fill(partial)`` writes, renamed into place only if it
    holds nothing beyond the library's schema (a reader never sees half of one); whether it did."""
    try:
        template.parent.mkdir(parents=True, exist_ok=True)
        fd, partial = tempfile.mkstemp(dir=template.parent, prefix=template.name, suffix=".partial")
        os.close(fd)
    except OSError:
        return False
    try:
        fill(Path(partial))
        with contextlib.closing(sqlite3.connect(Path(partial).as_uri() + "?mode=ro", uri=True)) as copy:
            if _has_rows_beyond_the_schema(copy, SCHEMA_TABLES[library]):
                return False
        os.replace(partial, template)
        return True
    except (OSError, EOFError, zlib.error, sqlite3.Error):
        return False
    finally:
        Path(partial).unlink(missing_ok=True)


def _has_rows_beyond_the_schema(connection: sqlite3.Connection, schema_tables: set[str]) -> bool:
    tables = [name for (name,) in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
    if not schema_tables <= set(tables):
        return True  # not what this library's migrations make
    return any(connection.execute(f'SELECT 1 FROM "{table}" LIMIT 1').fetchone()
               for table in tables if table not in schema_tables and not table.startswith("sqlite_"))
