"""Whether the MLflow tracking store answers, and which errors mean it does not.

Shared by the journal that keeps writes while the store is away (``flows/recording/journal.py``)
and the model registry (``flows/recording/model_registry.py``), which both must tell "unreachable" from
"the request was wrong".
"""

from __future__ import annotations

import os


class TrackingUnavailable(ConnectionError):
    """The MLflow tracking store cannot be reached (a ConnectionError, so Prefect retries it)."""


class TrackingUnusable(ValueError):
    """``MLFLOW_TRACKING_URI`` names something that is not a usable MLflow store: bad input."""


def is_unavailable(error: BaseException) -> bool:
    """Whether an error means "the store is unreachable" rather than "the request was wrong"."""
    import requests

    seen = error
    for _ in range(5):  # walk the cause/context chain a little way
        if seen is None:
            break
        if isinstance(seen, (TrackingUnavailable, requests.exceptions.ConnectionError, requests.exceptions.Timeout,
                             ConnectionError, TimeoutError)):
            return True
        seen = seen.__cause__ or seen.__context__
    message = str(error)
    return "Max retries exceeded" in message or "Connection refused" in message or "Connection aborted" in message


def tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI", "")


def check_reachable(timeout: float = 10.0) -> None:
    """Raise TrackingUnavailable unless an HTTP tracking server answers ``/health`` (no-op for SQLite)."""
    uri = tracking_uri()
    if not uri.startswith(("http://", "https://")):
        return
    import requests

    try:
        response = requests.get(uri.rstrip("/") + "/health", timeout=timeout)
    except requests.exceptions.RequestException as error:
        raise TrackingUnavailable(f"the MLflow tracking server at {uri} is unreachable ({type(error).__name__})") from None
    if response.status_code >= 500:
        raise TrackingUnavailable(f"the MLflow tracking server at {uri} answered /health with {response.status_code}")


def check_tracking_store(timeout: float = 10.0) -> None:
    """Refuse a tracking URI that cannot be an MLflow store before anything is written: a scheme MLflow
    has no store for (``TrackingUnusable``), a server that does not answer (``TrackingUnavailable``), and
    an address that answers but is not an MLflow server, or refuses our credentials (``TrackingUnusable``)."""
    uri = tracking_uri()
    scheme = uri.partition(":")[0].lower() if ":" in uri else ""
    if not uri or scheme == "sqlite":
        return
    if scheme in ("http", "https"):
        check_reachable(timeout)
        _check_is_mlflow_server(uri, timeout)
        return
    if scheme in ("", "file"):
        raise TrackingUnusable(f"MLFLOW_TRACKING_URI {uri!r} is a file store, which MLflow 3 no longer opens: "
                               "use a sqlite:/// URI, a database or an MLflow server's http(s) address")
    from mlflow.tracking._tracking_service.utils import _tracking_store_registry

    try:
        _tracking_store_registry.get_store_builder(uri)
    except Exception:
        schemes = sorted(s for s in _tracking_store_registry._registry if s)
        raise TrackingUnusable(f"MLFLOW_TRACKING_URI {uri!r}: MLflow has no tracking store for scheme {scheme!r} "
                               f"(it takes {', '.join(schemes)})") from None


def _check_is_mlflow_server(uri: str, timeout: float) -> None:
    """An MLflow server answers ``/version`` with its version (with the credentials MLflow's client sends)."""
    import re

    import requests

    user, password = os.environ.get("MLFLOW_TRACKING_USERNAME"), os.environ.get("MLFLOW_TRACKING_PASSWORD")
    token = os.environ.get("MLFLOW_TRACKING_TOKEN")
    try:
        response = requests.get(uri.rstrip("/") + "/version", timeout=timeout,
                                auth=(user, password or "") if user else None,
                                headers={"Authorization": f"Bearer {token}"} if token and not user else None)
    except requests.exceptions.RequestException as error:
        raise TrackingUnavailable(f"the MLflow tracking server at {uri} is unreachable ({type(error).__name__})") from None
    if response.status_code in (401, 403):
        what = ("refused the credentials in MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD" if user or token
                else "needs credentials: set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD")
        raise TrackingUnusable(f"the MLflow tracking server at {uri} {what} (HTTP {response.status_code})")
    if response.status_code >= 500:
        raise TrackingUnavailable(f"the MLflow tracking server at {uri} answered /version with {response.status_code}")
    if response.status_code != 200 or not re.fullmatch(r"\d+\.\d+\S*", response.text.strip()):
        raise TrackingUnusable(f"MLFLOW_TRACKING_URI {uri} answers but is not an MLflow tracking server (GET /version "
                               f"gave HTTP {response.status_code} {response.text.strip()[:60]!r}, not MLflow's version)")
