"""The ML half of posttrain: one module per stage kind, plus what stages share.

A stage is a plain function ``run(config, inputs, ctx) -> outputs`` over its typed config,
resolved upstream outputs (local paths) and a tracking handle. Nothing in this package
imports Prefect or reads pipeline YAML; ``flows`` does the orchestration.
"""
