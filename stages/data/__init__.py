"""Data: what a stage trains and evaluates on, in one canonical record form.

The ``data:`` declarations (``specs``), where they come from (built-in generators and local
files in ``sources``, the Hugging Face hub and dataset folders in ``hub``, reasoning-gym tasks in
``reasoning_gym``, an ``iterate`` round's failure set in ``failures``), preference pairs
(``preferences``) and SFT packing (``packing``). It may import ``stages.spec_model`` and, for the
answer formats a task's records carry, ``stages.rewards``; never a stage kind or the rollout layer.
"""
