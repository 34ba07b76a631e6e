"""Every MLflow tag posttrain writes or reads, in one place (``posttrain.*`` on runs and models).

A tag is part of the store's schema: cache lookups, ``posttrain compare``, the reaper and
``posttrain sync`` all search by these names, so they are never spelled inline elsewhere.
"""

from __future__ import annotations

from stages.context import ALERT_TAG, RESUMED_TAG

# ------------------------------------------------------------------ every run
TAG_ROLE = "posttrain.role"  # "pipeline", "stage" or "compare"
TAG_PIPELINE = "posttrain.pipeline"
TAG_VERSION = "posttrain.version"
TAG_HOST = "posttrain.host"  # who runs the run: what the reaper of dead runs checks
TAG_PID = "posttrain.pid"
TAG_PROCESS_START = "posttrain.process_start"
TAG_ERROR = "posttrain.error"  # why a run failed or was killed, in words
TAG_ALERT = ALERT_TAG  # a stage that learns nothing, and the likely cause (stages/training/alerts.py)
TAG_RESUMED = RESUMED_TAG  # JSON {step, run, checkpoint}: a stage that resumed where an earlier run stopped
TAG_PREFECT_FLOW_RUN = "posttrain.prefect_flow_run_id"

# ------------------------------------------------------------------ an experiment (one per pipeline)
# MLflow's own marker of what an experiment holds (its UI's "experiment type"): posttrain's are model training,
# not GenAI apps. MLflow 3.17's UI itself opens an experiment by the `workflowType` URL parameter instead
# (flows/servers/ui.py prints links with it).
TAG_EXPERIMENT_KIND = "mlflow.experimentKind"
MODEL_TRAINING_KIND = "custom_model_development"

# ------------------------------------------------------------------ a pipeline run
TAG_STAGE_RUNS = "posttrain.stage_runs"  # JSON: stage -> the run whose outputs this pipeline run used
TAG_DISPATCHED = "posttrain.dispatched."  # + stage: JSON result of a stage a work pool ran

# ------------------------------------------------------------------ a stage run
TAG_STAGE = "posttrain.stage"
TAG_KIND = "posttrain.kind"
TAG_FINGERPRINT = "posttrain.fingerprint"
TAG_SEED = "posttrain.seed"  # the seed the stage ran with: its own, else the pipeline's
TAG_UPSTREAM = "posttrain.upstream"  # JSON: upstream stage -> run id
TAG_OUTPUTS = "posttrain.outputs"  # JSON: output name -> local path; set only once published
TAG_POOL = "posttrain.pool"
TAG_ROUND = "posttrain.round"  # an iteration round, where a pipeline iterates
TAG_ROUND_OF = "posttrain.round_of"  # the stage a round's step repeats
TAG_FAILURE_SET = "posttrain.failure_set"  # runs:/<collect run>/outputs/failures.jsonl that train@r read
TAG_FAILURE_SET_SHA256 = "posttrain.failure_set_sha256"
TAG_VARIANT = "posttrain.variant"  # a sweep's overrides that reach this stage ("-": none do), e.g. "stages.grpo.kl_beta=0.1"
TAG_SWEEP = "posttrain.sweep"  # on stage and pipeline runs of a sweep: the sweep's parent run id
TAG_EVAL_SETTINGS = "posttrain.eval_settings"  # = stages.eval.EVAL_SETTINGS_TAG (stages do not import flows)
TAG_DATA_CONTEXT = "mlflow.data.context"  # on a dataset input: the dataset's role (train, probe, heldout)

# ------------------------------------------------------------------ the model registry
TAG_MODEL_ID = "posttrain.model_id"
TAG_MODEL_VERSION = "posttrain.model_version"  # "NAME/VERSION" of the registered model version
TAG_MODEL_ERROR = "posttrain.model_error"
TAG_CHECKPOINT_URI = "posttrain.checkpoint_uri"  # on a model version: where its checkpoint's files are
TAG_LINKED_MODEL_ID = "posttrain.linked_model_id"  # on an eval run: the logged model its scores were copied to
TAG_RUN_ID = "posttrain.run_id"  # on a model version: the stage run that produced it
TAG_PRODUCES = "posttrain.produces"  # on a registered model: "policy" or "reward_model"
TAG_MODEL_VERSIONS_UI = "mlflow.modelVersions"  # what mlflow.register_model sets: the UI links model -> versions

# ------------------------------------------------------------------ posttrain compare
TAG_COMPARE_METRIC = "posttrain.compare.metric"
TAG_COMPARE_SETTINGS = "posttrain.compare.settings"
TAG_COMPARE_PROMOTED = "posttrain.compare.promoted"
TAG_COMPARE_FORCED = "posttrain.compare.forced"  # --promote --force over a lead within noise: the interval, in words
