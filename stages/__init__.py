"""The ML half of posttrain: one module per stage kind, and the packages the kinds share.

A stage is a function ``run(config, inputs: StageInputs, ctx: StageContext) -> outputs``
(``stages.context``); each kind declares its ``KIND`` in its own module and ``registry`` lists
them. Shared packages: ``data``, ``models``, ``engines`` (what samples a model: HF generate,
in-process vLLM, a generation server), ``rollout`` (where a sample is made), ``rewards`` (where it
is scored), ``training``; ``scorers`` binds reward models and judges; ``sampling`` (the
``sampling:`` schema, importable from anywhere) and ``intervals`` (error bars). Nothing here
imports Prefect or reads pipeline YAML: that is ``flows``."""
