"""The ML half of posttrain: one module per stage kind (``run(config, inputs, ctx)``, its ``KIND`` listed in
``registry``) and the packages the kinds share (docs/architecture.md). Nothing here imports Prefect or reads YAML."""
