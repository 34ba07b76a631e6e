"""Where runs live: one folder, ``$POSTTRAIN_HOME`` (default ``./.posttrain``).

It holds the MLflow SQLite store (``mlflow.db``), MLflow artifacts (``artifacts/``), the
Prefect home (``prefect/``, whose SQLite database backs the embedded Prefect API server that
``flows/prefect_server.py`` starts for a run), built
base models and materialised datasets (``cache/``), published stage outputs
(``outputs/``) and scratch work dirs (``work/``). ``MLFLOW_TRACKING_URI`` and
``PREFECT_API_URL``, when set, point at real servers instead, with no other change.

``configure_environment`` must run before Prefect is imported: Prefect reads its settings
from the environment at import time.
"""

from __future__ import annotations

import os
from pathlib import Path


def posttrain_home() -> Path:
    return Path(os.environ.get("POSTTRAIN_HOME", ".posttrain")).expanduser().resolve()


def configure_environment() -> Path:
    home = posttrain_home()
    home.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{home / 'mlflow.db'}")
    os.environ.setdefault("PREFECT_HOME", str(home / "prefect"))
    # Analytics off: saves seconds at start-up and avoided "database is locked" errors here.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    # The embedded API server's (and Prefect's own ephemeral one's) default 20 s start-up budget was seen to run out on a
    # loaded 2-core machine; a slow start is not a reason to fail a pipeline.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    # MLflow's own HTTP retries default to ~2 min per call; posttrain retries and journals
    # itself (flows/recording.py), so one call gives up after a few seconds.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "3")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return home


def uses_local_mlflow() -> bool:
    return os.environ.get("MLFLOW_TRACKING_URI", "").startswith("sqlite:")


def artifact_root(home: Path) -> str | None:
    """Artifact location for new experiments: under the home for the local store, else the server's."""
    return (home / "artifacts").as_uri() if uses_local_mlflow() else None
