"""Whether the MLflow tracking store answers, and which errors mean it does not.

Shared by the journal that keeps writes while the store is away (``flows/recording.py``)
and the model registry (``flows/model_registry.py``), which both must tell "unreachable" from
"the request was wrong".
"""

from __future__ import annotations

import os


class TrackingUnavailable(ConnectionError):
    """The MLflow tracking store cannot be reached (a ConnectionError, so Prefect retries it)."""


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
