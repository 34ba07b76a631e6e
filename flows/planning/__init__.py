"""What runs: the stage graph, fingerprints and the run plan, and the job each execution gets.

``graph`` derives the stages' edges from their references; ``lineage`` fingerprints each stage
(config, data, upstream runs, code version) and plans run / cached / skip from MLflow;
``job`` freezes one stage execution into a serialisable ``StageJob``; ``iterate`` unrolls an
``iterate:`` block into rounds. It may import ``flows.spec`` and ``flows.recording.tags``;
nothing here writes.
"""
