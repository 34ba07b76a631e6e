"""What every training stage shares, whatever its algorithm.

Metrics and progress from a Hugging Face-style trainer to the stage's run (``callbacks``),
resumable checkpoints and resuming from them as if never stopped (``resume``), several training
processes for one stage (``data_parallel``), and the silent-failure alerts of
an RL or online DPO stage (``alerts``). It may import ``stages.context`` and ``stages.spec_model``
only.
"""
