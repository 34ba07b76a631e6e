"""Data: what a stage trains and evaluates on, in one canonical record form: declarations
(``specs``), sources (``sources``, ``hub``, ``reasoning_gym``, ``failures``), ``preferences`` and
SFT ``packing``. It may import ``stages.spec_model`` and ``stages.rewards`` (answer formats);
never a stage kind or the rollout layer."""
