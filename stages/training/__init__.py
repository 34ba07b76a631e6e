"""What every training stage shares: metrics, resumable checkpoints, several processes, alerts.
It may import ``stages.context`` and ``stages.spec_model`` only."""
