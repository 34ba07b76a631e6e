"""The ML half of posttrain: one module per stage kind, plus what stages share.

A stage is a plain function ``run(config, inputs, ctx) -> outputs`` over its typed config,
its ``stages.context.StageInputs`` (datasets, checkpoints and reward specs, resolved to local
paths) and a tracking handle (``stages.context.StageContext``); ``outputs`` holds the paths it
staged and its ``metrics``. Nothing in this package
imports Prefect or reads pipeline YAML; ``flows`` does the orchestration.
"""
