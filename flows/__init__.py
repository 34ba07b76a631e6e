"""The orchestration half of posttrain: spec, graph, lineage, Prefect flows, tracking, CLI.

Nothing here touches tensors; stages are called through their public ``run`` functions.
"""

__version__ = "0.1.0"
