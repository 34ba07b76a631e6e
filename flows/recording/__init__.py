"""Where runs live and how they are recorded, so that nothing is lost.

``home`` is the folder a user's runs live in; ``tracking`` is MLflow as the source of truth
(experiments, pipeline and stage runs, published outputs); ``journal`` writes what MLflow could
not take to disk and replays it; ``data_inputs`` and ``model_registry`` are MLflow's dataset
inputs and registered models; ``store`` says whether the tracking store answers; ``tags`` names
every tag; ``locks`` orders the processes sharing a home. It may import ``flows.terminal`` (a
stage's log) and ``flows.servers.db_templates`` (a new home's migrated databases).
"""
