"""How a stage runs: ``execute(job)`` and everything that drives it.

``execute`` is the one way a stage runs (lock, cache check, run, publish), in-process, on a
work pool's worker or in each rank; ``pipeline`` is the loop (plan -> jobs -> loop -> report);
``deployment`` is all of Prefect (the flows, their tasks, deployments, stages sent to pools);
``distributed``, ``rank`` and ``node`` run a stage on several processes and nodes. It imports
flows.spec, flows.planning, flows.recording, flows.servers and flows.terminal (never the commands:
cli, compare, checks, ui); only ``flows.cli`` and ``flows.servers.warm`` import it.
"""
