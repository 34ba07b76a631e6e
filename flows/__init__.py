"""The orchestration half of posttrain: from a pipeline file to stage runs recorded in MLflow.

Nothing here touches tensors; a stage is called through its kind's ``run``. The packages, in the
order a run goes through them:
- ``spec``: the pipeline file read into typed models (``loading``, ``schema``), checked across
  fields (``validate``), and shown to editors (``reference``: its JSON Schema and reference page);
- ``planning``: the stage graph, fingerprints and the run plan (``lineage``), the frozen
  ``StageJob`` each execution gets (``job``), and ``iterate``'s rounds;
- ``execution``: ``execute(job)``, the one way a stage runs, and what drives it: the pipeline
  loop (``pipeline``), Prefect (``deployment``, the one module that imports it), several
  processes and nodes (``distributed``, ``rank``, ``node``) and the locks between processes;
- ``recording``: MLflow as the source of truth (``tracking``), the journal that loses nothing
  when it does not answer (``journal``), dataset inputs, the model registry, tags, the home;
- ``servers``: what a run starts and keeps for the next one: posttrain's Prefect API server, the
  shipped database templates, start-up without garbage collection, the warm process, the UI.
At the top: the command line (``cli``), what it prints (``terminal``), and the commands that are
not a run (``checks``: check-reward; ``compare``), and ``sweep``, which runs many (seeds and a grid
of overrides, as one flow).
"""

__version__ = "0.1.0"
