"""Remake the database templates posttrain ships (``flows/servers/shipped_databases/``) for the installed versions.

    python -m flows.servers.make_db_templates

Run it after changing the MLflow, Prefect or pydantic pin in ``constraints/cpu.txt`` (with those
versions installed): it builds a new home's MLflow store and Prefect database exactly as a run
does, by the libraries' own migrations (and Prefect's block registration), in a temporary home
and cache, and writes the templates that run saved, gzipped, under the names the installed
versions give them. ``tests/test_db_templates.py`` checks that the shipped ones match a fresh
migration and that the pinned versions have theirs.
"""

from __future__ import annotations

import gzip
import os
import shutil
import sys
import tempfile
from pathlib import Path

from flows.servers import db_templates
def main() -> int:
    shipped = db_templates.SHIPPED
    with tempfile.TemporaryDirectory(prefix="posttrain-templates-") as scratch:
        os.environ.update(POSTTRAIN_HOME=str(Path(scratch) / "home"), POSTTRAIN_CACHE_DIR=str(Path(scratch) / "cache"))
        for name in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL", "PREFECT_HOME"):
            os.environ.pop(name, None)
        db_templates.SHIPPED = Path(scratch) / "none"  # made by the migrations, not unpacked from those shipped now
        try:
            made = _migrate()
        finally:
            db_templates.SHIPPED = shipped
        if made is None:
            return 1
        shipped.mkdir(exist_ok=True)
        for library, template in made.items():
            for old in shipped.glob(f"{library}-*.db.gz"):
                old.unlink()
            target = shipped / f"{template.name}.gz"
            with open(template, "rb") as source, open(target, "wb") as raw, \
                    gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=9, mtime=0) as packed:
                shutil.copyfileobj(source, packed)  # no name or time in the header
            print(f"flows/{shipped.name}/{target.name}: {target.stat().st_size} bytes")
    return 0


def _migrate() -> dict[str, Path] | None:
    """A new home's two databases, built as a run builds them; the templates that saved (None: one was not)."""
    from flows.recording.home import configure_environment
    from flows.servers.prefect_server import prefect_api, stop_server
    from flows.recording.tracking import Tracker

    home = configure_environment()
    Tracker(home)  # migrates the new MLflow store and saves it as the template
    try:
        with prefect_api(home):  # the server migrates its database, registers block types; the template is saved
            pass
    finally:
        stop_server(home)
    made = {library: db_templates.template_path(library) for library in ("mlflow", "prefect")}
    for library, template in made.items():
        if not template.is_file():
            print(f"no {library} template was made in {template.parent}", file=sys.stderr)
            return None
    return made


if __name__ == "__main__":
    sys.exit(main())
