"""Where runs live: one folder, ``$POSTTRAIN_HOME`` (default ``./.posttrain``).

It holds the MLflow SQLite store (``mlflow.db``), MLflow artifacts (``artifacts/``), the
Prefect home (``prefect/``, whose SQLite database backs the embedded Prefect API server that
``flows/servers/prefect_server.py`` starts for a run), built
base models and materialised datasets (``cache/``), published stage outputs
(``outputs/``) and scratch work dirs (``work/``). ``MLFLOW_TRACKING_URI`` and
``PREFECT_API_URL``, when set, point at real servers instead, with no other change.

``configure_environment`` must run before Prefect is imported: Prefect reads its settings
from the environment at import time.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import quote, unquote


def posttrain_home() -> Path:
    return Path(os.environ.get("POSTTRAIN_HOME", ".posttrain")).expanduser().resolve()


class HomeError(Exception):
    """$POSTTRAIN_HOME cannot hold runs (a file, unwritable, on a read-only mount)."""


def home_problem(home: Path) -> str | None:
    """Why ``home`` cannot hold posttrain's files, found without writing anything; None if it can."""
    where = f"POSTTRAIN_HOME {str(home)!r}"
    if home.exists():
        if not home.is_dir():
            return f"{where} is a file, not a directory; point POSTTRAIN_HOME at a directory"
        if not os.access(home, os.W_OK | os.X_OK):
            return f"{where} is not writable here (permissions or a read-only mount)"
        return None
    parent = home.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        return f"{where} cannot be created: {str(parent)!r} is a file, not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{where} does not exist and cannot be created: {str(parent)!r} is not writable (permissions or " \
               "a read-only mount)"
    return None


def sqlite_uri(path: Path, driver: str = "sqlite") -> str:
    """A SQLite URL for ``path`` with the path escaped: a `?` or `#` in it would otherwise start the URL's query
    or fragment and put the database somewhere else (SQLAlchemy unescapes it again)."""
    return f"{driver}:///{quote(str(path), safe='/')}"


def configure_environment(create: bool = True) -> Path:
    """Point MLflow and Prefect at the home (unless set to servers); with ``create``, make the home.

    The CLI configures with ``create=False`` and creates the home only once the whole input is
    accepted (``ensure_home``), so refused input leaves nothing behind.
    """
    home = posttrain_home()
    os.environ.setdefault("MLFLOW_TRACKING_URI", sqlite_uri(home / "mlflow.db"))
    os.environ.setdefault("PREFECT_HOME", str(home / "prefect"))
    prefect_db = home / "prefect" / "prefect.db"
    if sqlite_uri(prefect_db) != f"sqlite:///{prefect_db}":  # Prefect's default URL would not escape the path
        os.environ.setdefault("PREFECT_SERVER_DATABASE_CONNECTION_URL", sqlite_uri(prefect_db, "sqlite+aiosqlite"))
    # Analytics off: saves seconds at start-up and avoided "database is locked" errors here.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    # The embedded API server's (and Prefect's own ephemeral one's) default 20 s start-up budget was seen to run out on a
    # loaded 2-core machine; a slow start is not a reason to fail a pipeline.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    # MLflow's own HTTP retries default to ~2 min per call; posttrain retries and journals
    # itself (flows/recording/journal.py), so one call gives up after a few seconds.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "3")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if create:
        ensure_home(home)
    return home


def uses_local_mlflow() -> bool:
    return os.environ.get("MLFLOW_TRACKING_URI", "").startswith("sqlite:")


def local_store_path() -> Path | None:
    """The SQLite file of the MLflow store this process's clients open (None if not a SQLite store), unescaped."""
    from mlflow import get_tracking_uri

    uri = get_tracking_uri()  # MLFLOW_TRACKING_URI, unless something called mlflow.set_tracking_uri
    return Path(unquote(uri.removeprefix("sqlite:///"))) if uri.startswith("sqlite:///") else None


def artifact_root(home: Path) -> str | None:
    """Artifact location for new experiments: under the home for the local store, else the server's."""
    return (home / "artifacts").as_uri() if uses_local_mlflow() else None


def ensure_home(home: Path) -> Path:
    """Create the home (after ``home_problem`` said it can be) and ready MLflow for it; HomeError says why not."""
    create_home_dir(home)
    _mlflow_makes_the_real_parent_dir()
    return home


def create_home_dir(home: Path) -> None:
    """The home's directory alone (importing nothing); HomeError says why it cannot be."""
    problem = home_problem(home)
    if problem:
        raise HomeError(problem)
    try:
        home.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise HomeError(f"POSTTRAIN_HOME {str(home)!r} cannot be created ({error.strerror or error})") from None


def _mlflow_makes_the_real_parent_dir() -> None:
    """MLflow 3 makes a SQLite store's parent dir from the URL text, still escaped: with a `?` in the
    home's path it would create an empty ``...%3F...`` directory beside the home. Unescape first."""
    try:
        from mlflow.store.db import utils
    except ImportError:
        return
    make = getattr(utils, "_make_parent_dirs_if_sqlite", None)
    if make is None or getattr(make, "unescapes", False):
        return

    def unescaped(db_uri: str) -> None:
        prefix = "sqlite:///"
        make(prefix + unquote(db_uri[len(prefix):]) if db_uri.startswith(prefix) else db_uri)

    unescaped.unescapes = True
    utils._make_parent_dirs_if_sqlite = unescaped
