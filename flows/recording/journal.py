"""Recording into MLflow without ever losing what could not be recorded.

Training must not die because the tracking server did. Every write posttrain makes to a
run goes through a ``Recorder``: while the store answers, writes go straight in; the
first write that fails because the store is *unreachable* (a connection refused or
reset, a timeout, repeated 5xx answers — not a bad request) switches that run's recorder
to a local journal, ``$POSTTRAIN_HOME/pending/<run_id>.json``, and every later write for
the run is appended there in order. ``replay_pending`` sends journals once the store is
back (``posttrain sync``, and the start of every ``posttrain run``), oldest write first,
and deletes each journal only after its last write landed. A journal that ends with the
run's FINISHED status also carries its published outputs, so a stage that finished while
the server was away becomes a cache hit as soon as it is replayed.

Metric writes are buffered and sent as one batch every ``FLUSH_SECONDS`` (or
``FLUSH_SIZE`` values), so per-step logging never waits on the store.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from flows.recording.store import check_reachable, is_unavailable

FLUSH_SECONDS = 2.0
FLUSH_SIZE = 1000


def pending_dir(home: Path) -> Path:
    return home / "pending"


def _jsonable(value):
    if hasattr(value, "item"):  # numpy and torch scalars
        return value.item()
    return str(value)


def _write_json_atomic(path: Path, payload: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".writing-", suffix=".json", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        json.dump(payload, handle, default=_jsonable)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


class Recorder:
    """Every write to one MLflow run, journalled locally once the store is unreachable."""

    def __init__(self, client, run_id: str, home: Path):
        self.client = client
        self.run_id = run_id
        self.home = home
        self.journal: list[dict] = []
        self.unavailable: str | None = None  # why the store was given up on, for the report
        self._metrics: list[list] = []
        self._metrics_since = time.monotonic()
        self._files = pending_dir(home) / run_id

    @property
    def offline(self) -> bool:
        return self.unavailable is not None

    @property
    def journal_path(self) -> Path:
        return pending_dir(self.home) / f"{self.run_id}.json"

    # ---- the writes

    def params(self, params: dict[str, Any]) -> None:
        self._do({"op": "params", "params": {str(k): str(v)[:6000] for k, v in params.items()}})

    def tags(self, tags: dict[str, str]) -> None:
        self._do({"op": "tags", "tags": {str(k): str(v) for k, v in tags.items()}})

    def metrics(self, metrics: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        self._metrics.extend([name, float(value), now, step] for name, value in metrics.items())
        if len(self._metrics) >= FLUSH_SIZE or time.monotonic() - self._metrics_since >= FLUSH_SECONDS:
            self.flush_metrics()

    def flush_metrics(self) -> None:
        batch, self._metrics = self._metrics, []
        self._metrics_since = time.monotonic()
        for start in range(0, len(batch), FLUSH_SIZE):
            self._do({"op": "metrics", "metrics": batch[start : start + FLUSH_SIZE]})

    def text(self, text: str, name: str) -> None:
        self._do({"op": "text", "text": text, "name": name})

    def table(self, columns: dict[str, list], name: str) -> None:
        self._do({"op": "table", "columns": columns, "name": name})

    def figure(self, figure, name: str) -> None:
        if self.offline:
            self._files.mkdir(parents=True, exist_ok=True)
            path = self._files / name.replace("/", "_")
            figure.savefig(path)
            self._do({"op": "artifact", "path": str(path), "artifact_path": os.path.dirname(name) or None})
            return
        try:
            self.client.log_figure(self.run_id, figure, name)
        except Exception as error:
            if not is_unavailable(error):
                raise
            self._go_offline(error)
            self.figure(figure, name)

    def artifacts(self, path: str, artifact_path: str | None) -> None:
        """A file or a directory (logged as its contents) that lies on this disk for good."""
        self._do({"op": "artifact", "path": str(path), "artifact_path": artifact_path})

    def datasets(self, datasets: list[dict]) -> None:
        """The run's dataset inputs (``flows.data_inputs.stage_datasets``' dicts)."""
        if datasets:
            self._do({"op": "datasets", "datasets": datasets})

    def model(self, op: dict) -> None:
        """A logged-model / registered-model write (``flows.recording.model_registry``), journalled like the rest."""
        self._do(op)

    def terminate(self, status: str) -> None:
        self.flush_metrics()
        self._do({"op": "terminate", "status": status})

    # ---- the journal

    def _do(self, op: dict) -> None:
        if self.offline:
            self.journal.append(op)
            self.save_journal()
            return
        try:
            apply_op(self.client, self.run_id, op)
        except Exception as error:
            if not is_unavailable(error):
                raise
            self._go_offline(error)
            self.journal.append(op)
            self.save_journal()

    def _go_offline(self, error: BaseException) -> None:
        first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
        self.unavailable = f"{type(error).__name__}: {first_line[:300]}"

    def save_journal(self) -> None:
        _write_json_atomic(self.journal_path, {"run_id": self.run_id, "reason": self.unavailable, "ops": self.journal})

    def retry(self, seconds: float) -> bool:
        """Try to send the journal for up to ``seconds`` (backing off); True once all of it landed."""
        if not self.offline:
            return True
        deadline = time.monotonic() + seconds
        delay = 1.0
        while True:
            try:
                check_reachable(timeout=min(10.0, max(1.0, deadline - time.monotonic())))
                replay_journal(self.client, self.journal_path)
            except Exception as error:
                if not is_unavailable(error) or time.monotonic() + delay > deadline:
                    return False
                time.sleep(delay)
                delay = min(delay * 2, 15.0)
                continue
            self.journal, self.unavailable = [], None
            return True

    def summary(self) -> str:
        """What is waiting in the journal, in words."""
        counts: dict[str, int] = {}
        for op in self.journal:
            key = op["op"]
            counts[key] = counts.get(key, 0) + (len(op["metrics"]) if key == "metrics" else 1)
        names = {"metrics": "metric values", "params": "param batches", "tags": "tag batches", "text": "texts",
                 "table": "tables", "artifact": "artifact paths", "datasets": "dataset input batches",
                 "terminate": "final status",
                 "model.register": "model registrations", "model.link_eval": "model score links"}
        parts = [f"{n} {names.get(k, k)}" for k, n in counts.items()]
        return ", ".join(parts) or "nothing"


def apply_op(client, run_id: str, op: dict) -> None:
    kind = op["op"]
    if kind == "params":
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in op["params"].items()]
        for start in range(0, len(items), 100):
            client.log_batch(run_id, params=items[start : start + 100])
    elif kind == "tags":
        from mlflow.entities import RunTag

        client.log_batch(run_id, tags=[RunTag(k, v) for k, v in op["tags"].items()])
    elif kind == "metrics":
        from mlflow.entities import Metric

        client.log_batch(run_id, metrics=[Metric(name, value, ts, step) for name, value, ts, step in op["metrics"]])
    elif kind == "text":
        client.log_text(run_id, op["text"], op["name"])
    elif kind == "table":
        client.log_table(run_id, data=op["columns"], artifact_file=op["name"])
    elif kind == "artifact":
        if link_into_local_artifacts(client, run_id, Path(op["path"]), op["artifact_path"]):
            return
        if Path(op["path"]).is_dir():
            client.log_artifacts(run_id, op["path"], artifact_path=op["artifact_path"])
        else:
            client.log_artifact(run_id, op["path"], artifact_path=op["artifact_path"])
    elif kind == "datasets":
        from flows.recording.data_inputs import log_datasets

        log_datasets(client, run_id, op["datasets"])
    elif kind == "terminate":
        client.set_terminated(run_id, status=op["status"])
    elif kind.startswith("model."):  # logged / registered models of the run's checkpoint or scores
        from flows.recording.model_registry import apply_model_op

        apply_model_op(client, run_id, op)
    else:
        raise ValueError(f"unknown journal operation {kind!r}")


def link_into_local_artifacts(client, run_id: str, path: Path, artifact_path: str | None) -> bool:
    """Log ``path`` (a file, or a directory's contents) as the run's artifacts by hard-linking its files into
    the run's artifact directory, when that is a directory on the same file system (the embedded store):
    a published checkpoint then takes its disk space once, not twice (outputs/ and artifacts/ share the
    files, which nobody writes to after publication). False (nothing linked) where it cannot be done:
    an artifact store elsewhere, or another file system; the caller copies then."""
    from mlflow.utils.file_utils import local_file_uri_to_path

    uri = client.get_run(run_id).info.artifact_uri
    if not uri.startswith("file:"):
        return False
    root = Path(local_file_uri_to_path(uri)) / (artifact_path or "")
    files = ([(path, root / path.name)] if path.is_file() else
             [(source, root / source.relative_to(path)) for source in sorted(path.rglob("*")) if source.is_file()])
    linked: list[Path] = []
    try:
        for source, target in files:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.unlink(missing_ok=True)  # a replayed write: the same file again
            os.link(source, target)
            linked.append(target)
    except OSError:  # another device (EXDEV), or a file system without hard links: copy instead
        for target in linked:
            target.unlink(missing_ok=True)
        return False
    return True


class BrokenJournal(ValueError):
    """A journal in ``pending/`` that cannot be read (truncated, edited by hand): named, never guessed at."""


def read_journal(path: Path) -> dict:
    """A journal's payload; BrokenJournal says which file and why when it is not one."""
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as error:
        raise BrokenJournal(f"{path}: cannot be read as a journal ({type(error).__name__}: {error}); it may have "
                            "been cut short by a full disk or a crash. Its run's remaining records are lost: move "
                            "the file out of pending/ (or delete it) to go on") from None
    if not (isinstance(payload, dict) and isinstance(payload.get("run_id"), str)
            and isinstance(payload.get("ops"), list)):
        raise BrokenJournal(f"{path}: not a posttrain journal (needs `run_id` and `ops`); move it out of pending/ "
                            "(or delete it) to go on")
    return payload


def broken_journals(home: Path) -> list[str]:
    """What is wrong with each journal in ``pending/`` that cannot be replayed."""
    problems = []
    for run_id in pending_runs(home):
        try:
            read_journal(pending_dir(home) / f"{run_id}.json")
        except BrokenJournal as error:
            problems.append(str(error))
    return problems


def replay_journal(client, path: Path) -> None:
    """Send one run's journal in order; rewrite it after each write so a crash never repeats much."""
    payload = read_journal(path)
    ops = payload["ops"]
    while ops:
        apply_op(client, payload["run_id"], ops[0])
        ops.pop(0)
        if ops:
            _write_json_atomic(path, payload)
    path.unlink()
    files = path.with_suffix("")
    if files.is_dir():
        import shutil

        shutil.rmtree(files, ignore_errors=True)


def pending_runs(home: Path) -> list[str]:
    folder = pending_dir(home)
    return sorted(p.stem for p in folder.glob("*.json")) if folder.is_dir() else []


def replay_pending(client, home: Path) -> tuple[list[str], list[str]]:
    """Send every journal in ``$POSTTRAIN_HOME/pending``; (run ids recorded, run ids still pending).

    A journal that cannot be read stays pending (``broken_journals`` says which and why) and
    holds up no other.
    """
    done, left = [], []
    folder = pending_dir(home)
    for run_id in pending_runs(home):
        try:
            replay_journal(client, folder / f"{run_id}.json")
        except BrokenJournal:
            left.append(run_id)
        except Exception as error:
            if not is_unavailable(error):
                raise
            left.append(run_id)
        else:
            done.append(run_id)
    return done, left
