"""A stage's datasets as MLflow dataset inputs: the lineage MLflow's UI and ``search_runs`` show.

Every stage run records each dataset it read (``config.dataset_names()``) as a dataset input:
- name: the dataset's name in the pipeline's ``data:`` (``train``, ``heldout``);
- digest: the first 16 hex digits of the SHA-256 of the canonical JSONL the stage read, so
  two runs show the same digest exactly when they read the same records;
- source: that file (``source_type`` ``local``: MLflow's ``{"uri": ...}`` form);
- profile: ``{"num_rows": records, "spec": the declaration}`` (generator and seed, or path; a Hugging
  Face dataset's adds ``resolved``: ``hub:ID@COMMIT`` or ``folder:DIGEST``);
- context (the input tag ``mlflow.data.context``): the dataset's declared role, ``train``,
  ``probe`` or ``heldout``.

The write is one journal operation (``datasets``) of the stage's ``Recorder``: with the
store unreachable it waits in the journal like every other write.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from flows.recording.tags import TAG_DATA_CONTEXT
from stages.data.specs import HubData
from stages.data.hub import identity

SOURCE_TYPE = "local"


def stage_datasets(loaded, inputs) -> list[dict]:
    """What the stage reads, one JSON-able dict per dataset (``inputs``: a ``stages.context.StageInputs``)."""
    spec = loaded.spec
    found = []
    for name, path in inputs.datasets.items():
        path = path.resolve()
        digest, rows = digest_and_rows(path)
        declared = spec.data[name]
        described = declared.model_dump(mode="json", exclude_none=True)
        if isinstance(declared, HubData):  # the commit (or folder digest) read, not a moving branch name
            described["resolved"] = identity(declared, loaded.base_dir)
        found.append({"name": name, "digest": digest, "source": path.as_uri(), "rows": rows,
                      "role": declared.role, "spec": described})
    return found


def digest_and_rows(path: Path) -> tuple[str, int]:
    """(SHA-256 of the file, 16 hex digits; its non-blank lines = records), in one pass."""
    digest = hashlib.sha256()
    rows = 0
    with open(path, "rb") as handle:
        for line in handle:
            digest.update(line)
            rows += bool(line.strip())
    return digest.hexdigest()[:16], rows


def log_datasets(client, run_id: str, datasets: list[dict]) -> None:
    """Record ``stage_datasets``' dicts as the run's dataset inputs (a journal operation's body)."""
    from mlflow.entities import Dataset, DatasetInput, InputTag

    entries = [
        DatasetInput(
            Dataset(name=d["name"], digest=d["digest"], source_type=SOURCE_TYPE, source=json.dumps({"uri": d["source"]}),
                    profile=json.dumps({"num_rows": d["rows"], "spec": d["spec"]})),
            tags=[InputTag(TAG_DATA_CONTEXT, d["role"])],
        )
        for d in datasets
    ]
    if not entries:
        return
    from mlflow.exceptions import MlflowException

    for attempt in range(5):
        try:
            client.log_inputs(run_id, datasets=entries)
            return
        except MlflowException as error:
            # MLflow's SQL store looks a dataset up, then inserts it: two runs logging the same dataset at
            # once (ten `--only` evals of one pipeline) race, and the loser's insert breaks the unique key.
            # Its transaction is rolled back, and the retry finds the winner's row and links to it.
            duplicate = any(text in str(error) for text in ("UNIQUE constraint failed", "UniqueViolation", "Duplicate entry"))
            if not duplicate or "dataset" not in str(error).lower() or attempt == 4:
                raise
            time.sleep(0.05 * (attempt + 1))


def pipeline_datasets(client, stage_run_ids, offline: bool) -> list[dict]:
    """The datasets of the stage runs a pipeline run used (cached ones included), once each: logged on
    the pipeline run too, so its row in the UI's run list shows them. Empty while the store is away."""
    from flows.recording.store import is_unavailable

    if offline:
        return []
    found: dict[tuple[str, str], dict] = {}
    try:
        for run_id in filter(None, stage_run_ids):
            for entry in client.get_run(run_id).inputs.dataset_inputs:
                d = entry.dataset
                profile = json.loads(d.profile or "{}")
                found[(d.name, d.digest)] = {
                    "name": d.name, "digest": d.digest, "source": json.loads(d.source).get("uri", ""),
                    "rows": profile.get("num_rows"), "spec": profile.get("spec"),
                    "role": next((t.value for t in entry.tags if t.key == TAG_DATA_CONTEXT), "")}
    except Exception as error:
        if not is_unavailable(error):
            raise
        return []
    return list(found.values())
