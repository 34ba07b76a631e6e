"""What every training stage shares: trainer metrics (``callbacks``), resumable checkpoints
(``resume``), several processes (``data_parallel``) and silent-failure alerts (``alerts``).
It may import ``stages.context`` and ``stages.spec_model`` only."""
