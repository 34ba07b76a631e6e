"""What runs: the stage graph, fingerprints and the run plan, and the job each execution gets.

``graph`` derives the stages' edges from their references; ``lineage`` fingerprints each stage
(config, data, upstream runs, code version) and plans run / cached / skip from MLflow;
``job`` freezes one stage execution into a serialisable ``StageJob``; ``iterate`` holds what an
``iterate:`` block's rounds do. Only ``graph`` calls ``iterate``: it unrolls the rounds, adds the failure
set's edge and answers which round a step is; execution knows a round only as ``StageJob.round``
(its tags, fingerprint and data), never the block. It may import ``flows.spec`` and ``flows.recording.tags``;
nothing here writes.
"""
