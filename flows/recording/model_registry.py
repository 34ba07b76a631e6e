"""Checkpoints as MLflow logged models and registered model versions, with eval metrics linked.

Naming. Every policy checkpoint of a pipeline (sft, rl, dpo, kto, online_dpo: every kind whose
``StageKind.produces`` is ``policy``) becomes one *version* of one registered model
named after the pipeline (``quickstart``): versions are numbered in the order checkpoints
were published, the alias ``champion`` (``posttrain compare --promote``) points at the best
one, and that version's ``posttrain.checkpoint_uri`` tag says where its files are. A kind
that is not a policy (``produces="reward_model"``) goes to its own registered model,
``<pipeline>-reward_model``, so a scorer is never ranked against policies nor made champion.

What is written, per checkpoint-producing stage run (``register_checkpoint``):
- a logged model in the pipeline's experiment, named after the stage, ``source_run_id`` the
  stage run, ``model_type`` policy / reward_model, params stage / kind / fingerprint, and the
  run's output link (``log_outputs``): the experiment's *Models* tab lists it;
- a registered model version whose source is ``models:/<model_id>`` (MLflow 3's link from a
  version to its logged model: the UI shows the logged model's metrics on the version page)
  and whose tag ``posttrain.checkpoint_uri`` is the run's ``outputs/checkpoint`` artifact
  folder, the weights themselves (``mlflow artifacts download -u URI``); the logged model holds
  no copy of them;
- on the stage run, tags ``posttrain.model_id`` and ``posttrain.model_version`` (``NAME/VERSION``),
  which make registration idempotent (a replayed journal or a compare backfill never
  registers twice).

Per eval stage run (``link_eval``): the run's scores are logged again with ``model_id`` set
to the evaluated checkpoint's logged model, ``dataset_name`` the eval dataset and
``dataset_digest`` the eval settings hash — so the MLflow UI's logged-model comparison shows
the same numbers, keyed by settings — and the run records the model as an input. The
logged model's tag ``posttrain.eval_settings`` lists every settings hash it was scored under.

Robustness. Both go through the stage's ``Recorder`` as one journal operation each
(``model.register`` / ``model.link_eval``), after the run's outputs are published: with the
store unreachable they wait in the journal and ``posttrain sync`` replays them. Any other
failure (a store without model-registry support, say) never fails the finished stage: it is
recorded as the run tag ``posttrain.model_error`` and printed, and ``posttrain compare``
registers whatever is still missing.
"""

from __future__ import annotations

import json
import sys
import time

from flows.recording.store import is_unavailable
from flows.recording.tags import (
    TAG_CHECKPOINT_URI,
    TAG_EVAL_SETTINGS,
    TAG_FINGERPRINT,
    TAG_KIND,
    TAG_LINKED_MODEL_ID,
    TAG_MODEL_ERROR,
    TAG_MODEL_ID,
    TAG_MODEL_VERSION,
    TAG_MODEL_VERSIONS_UI,
    TAG_OUTPUTS,
    TAG_PIPELINE,
    TAG_PRODUCES,
    TAG_ROUND,
    TAG_RUN_ID,
    TAG_STAGE,
)
from stages.registry import STAGE_KINDS


CHAMPION = "champion"
POLICY = "policy"

# Eval scores copied onto the evaluated checkpoint's logged model (pass_at_* are added by prefix).
LINKED_METRICS = ("reward_mean", "format_error_rate", "truncated_rate", "completion_tokens_mean",
                  "best_of_n_accuracy")


def registered_model_name(pipeline: str, produces: str = POLICY) -> str:
    """One registered model per pipeline for its policies; another per other kind of checkpoint."""
    return pipeline if produces == POLICY else f"{pipeline}-{produces}"


# ------------------------------------------------------------------ called by the orchestrator


def record_stage_model(recorder, pipeline: str, stage: str, config, upstream_runs: dict[str, str],
                       published: dict[str, str]) -> None:
    """After a stage published its outputs: register its checkpoint, or link its eval scores.

    Never raises for a registration problem (the stage has finished): an unreachable store
    journals the operation, anything else is recorded in ``posttrain.model_error``.
    """
    produces = STAGE_KINDS[config.kind].produces
    if produces is not None and "checkpoint" in published:
        op = {"op": "model.register", "pipeline": pipeline, "stage": stage, "kind": config.kind, "produces": produces,
              "artifact": f"outputs/{published['checkpoint'].rstrip('/').rsplit('/', 1)[-1]}"}
    elif STAGE_KINDS[config.kind].evaluates and getattr(config, "model", None) in upstream_runs:
        op = {"op": "model.link_eval", "checkpoint_run_id": upstream_runs[config.model],
              "data": getattr(config, "data", None) or config.kind}
    else:
        return  # nothing produced, or the base model was evaluated (it is not a registered checkpoint)
    try:
        recorder.model(op)
    except Exception as error:  # the Recorder re-raises what is not an outage
        _report(recorder.run_id, op["op"], error)


def apply_model_op(client, run_id: str, op: dict) -> None:
    """Apply a journalled model operation; raise only when the store is unreachable."""
    try:
        if op["op"] == "model.register":
            register_checkpoint(client, client.get_run(run_id), op["pipeline"], op.get("produces", POLICY),
                                op.get("artifact", "outputs/checkpoint"))
        elif op["op"] == "model.link_eval":
            eval_run = client.get_run(run_id)
            model_id = ensure_registered(client, op["checkpoint_run_id"])
            if model_id:
                link_eval(client, eval_run, model_id, op.get("data"))
        else:
            raise ValueError(f"unknown model operation {op['op']!r}")
    except Exception as error:
        if is_unavailable(error):
            raise
        _report(run_id, op["op"], error)
        try:
            client.set_tag(run_id, TAG_MODEL_ERROR, f"{op['op']}: {type(error).__name__}: {error}"[:5000])
        except Exception:  # already reported on stderr above; the stage's outcome stands
            return


def _report(run_id: str, what: str, error: BaseException) -> None:
    first = str(error).splitlines()[0][:300] if str(error) else ""
    print(f"posttrain: run {run_id}: {what} was not recorded in MLflow ({type(error).__name__}: {first}); "
          "the stage's outputs are unaffected and `posttrain compare` retries it", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ registration


def register_checkpoint(client, run, pipeline: str, produces: str = POLICY,
                        artifact: str = "outputs/checkpoint") -> str:
    """Logged model + registered model version for a stage run's checkpoint; its model id.

    Idempotent: a run that already carries ``posttrain.model_id`` is returned as it is (and
    given its registered version if only that step was missing).
    """
    from mlflow.entities import LoggedModelOutput, LoggedModelStatus

    tags = run.data.tags
    run_id = run.info.run_id
    model_id = tags.get(TAG_MODEL_ID)
    if model_id is None:
        stage = tags.get(TAG_STAGE, "checkpoint")
        model = client.create_logged_model(
            run.info.experiment_id, name=_logged_model_name(stage), source_run_id=run_id, model_type=produces,
            tags={k: v for k, v in {TAG_STAGE: stage, TAG_KIND: tags.get(TAG_KIND, ""),
                                    TAG_PIPELINE: pipeline, TAG_ROUND: tags.get(TAG_ROUND)}.items() if v},
            params={"stage": stage, "kind": tags.get(TAG_KIND, ""),
                    "fingerprint": tags.get(TAG_FINGERPRINT, ""), "artifact": artifact},
        )
        model_id = model.model_id
        client.finalize_logged_model(model_id, LoggedModelStatus.READY)
        client.log_outputs(run_id, [LoggedModelOutput(model_id, step=0)])
        client.set_tag(run_id, TAG_MODEL_ID, model_id)
    if TAG_MODEL_VERSION not in tags:
        name = registered_model_name(pipeline, produces)
        _ensure_registered_model(client, name, pipeline, produces)
        version = client.create_model_version(
            name, source=f"models:/{model_id}", run_id=run_id, model_id=model_id,
            tags={k: v for k, v in {TAG_STAGE: tags.get(TAG_STAGE, ""), TAG_RUN_ID: run_id,
                                    TAG_CHECKPOINT_URI: f"{run.info.artifact_uri.rstrip('/')}/{artifact}",
                                    TAG_ROUND: tags.get(TAG_ROUND)}.items() if v},
            description=f"checkpoint of stage {tags.get('posttrain.stage')!r} (run {run_id})",
            await_creation_for=0,
        )
        client.set_logged_model_tags(model_id, {TAG_MODEL_VERSIONS_UI: json.dumps(
            [{"name": version.name, "version": str(version.version)}])})
        client.set_tag(run_id, TAG_MODEL_VERSION, f"{version.name}/{version.version}")
    return model_id


def _logged_model_name(stage: str) -> str:
    """Logged model names may not contain / : . % or quotes."""
    return "".join("-" if c in "/:.%\"'" else c for c in stage) or "checkpoint"


def _ensure_registered_model(client, name: str, pipeline: str, produces: str) -> None:
    from mlflow.exceptions import MlflowException

    try:
        client.get_registered_model(name)
    except MlflowException:
        try:
            client.create_registered_model(
                name, tags={TAG_PIPELINE: pipeline, TAG_PRODUCES: produces},
                description=f"{produces} checkpoints of posttrain pipeline {pipeline!r}, one version per "
                            "published checkpoint; alias `champion` is set by `posttrain compare --promote`")
        except MlflowException:  # created meanwhile by another process
            client.get_registered_model(name)


def ensure_registered(client, checkpoint_run_id: str) -> str | None:
    """The logged model id of a checkpoint run, registering it first if that never happened
    (a run from before registration existed, or one whose registration failed)."""
    run = client.get_run(checkpoint_run_id)
    tags = run.data.tags
    if TAG_MODEL_ID in tags and TAG_MODEL_VERSION in tags:
        return tags[TAG_MODEL_ID]
    if run.info.status != "FINISHED" or TAG_OUTPUTS not in tags:
        return None
    outputs = json.loads(tags[TAG_OUTPUTS])
    if "checkpoint" not in outputs:
        return None
    pipeline = client.get_experiment(run.info.experiment_id).name
    kind = tags.get(TAG_KIND, "")
    produces = STAGE_KINDS[kind].produces if kind in STAGE_KINDS else POLICY
    artifact = f"outputs/{outputs['checkpoint'].rstrip('/').rsplit('/', 1)[-1]}"
    return register_checkpoint(client, run, pipeline, produces, artifact)


# ------------------------------------------------------------------ eval scores on the logged model


def linked_metric_names(metrics: dict[str, float]) -> list[str]:
    return [k for k in metrics if k.startswith(("pass_at_", "lm_eval/")) or k in LINKED_METRICS]


def link_eval(client, eval_run, model_id: str, data: str | None = None) -> None:
    """Log an eval run's scores against the evaluated checkpoint's logged model (once)."""
    from mlflow.entities import LoggedModelInput, Metric

    if eval_run.data.tags.get(TAG_LINKED_MODEL_ID) == model_id:
        return
    run_id = eval_run.info.run_id
    settings = eval_run.data.tags.get(TAG_EVAL_SETTINGS)
    data = data or eval_run.data.params.get("data")
    now = int(time.time() * 1000)
    metrics = [Metric(name, value, now, 0, model_id=model_id,
                      dataset_name=(data or "eval") if settings else None, dataset_digest=settings)
               for name, value in eval_run.data.metrics.items() if name in linked_metric_names(eval_run.data.metrics)]
    if metrics:
        client.log_batch(run_id, metrics=metrics)
    client.log_inputs(run_id, models=[LoggedModelInput(model_id)])
    if settings:
        known = client.get_logged_model(model_id).tags.get(TAG_EVAL_SETTINGS, "")
        hashes = sorted({h for h in known.split(",") if h} | {settings})
        client.set_logged_model_tags(model_id, {TAG_EVAL_SETTINGS: ",".join(hashes)})
    client.set_tag(run_id, TAG_LINKED_MODEL_ID, model_id)


# ------------------------------------------------------------------ the champion alias


def champion_version(client, name: str):
    """The version the ``champion`` alias points at, or None."""
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version_by_alias(name, CHAMPION)
    except MlflowException:
        return None


def promote(client, name: str, version: str):
    """Point ``champion`` at ``version``; the version it pointed at before (or None)."""
    previous = champion_version(client, name)
    client.set_registered_model_alias(name, CHAMPION, str(version))
    return previous
