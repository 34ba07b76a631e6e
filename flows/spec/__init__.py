"""The pipeline file: read, typed, checked, shown.

``loading`` reads the YAML (line numbers, ``--set`` overrides, every error at once) into the
typed models of ``schema``; ``validate`` holds the checks across fields (references, leakage,
rewards, data, models, resources); ``reference`` is the JSON Schema and reference page editors
read. It may import ``flows.planning`` (the stage graph, which also checks the ``iterate:`` block
the file declares) and, for the multi-process rules of a stage kind, ``flows.execution.distributed``;
the ML it knows only through ``stages.registry`` and the kinds' config models.
"""
