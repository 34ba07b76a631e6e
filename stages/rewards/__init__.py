"""Rewards: where every sample is scored.

The reward registry (built-ins, dotted paths to user functions, weighted sums: ``registry``),
what each reward accepts (``schemas``), the one scorer every stage uses (columns built once, the
``reward_errors`` policy once: ``scoring``), the worker process that bounds each reward's wall
time in any thread (``worker``, ``worker_process``), and the rewards with machinery of their own:
code run in a bubblewrap sandbox (``code_tests``, ``sandbox``), math-verify answers
(``math_answer``), a trained reward model (``reward_model``) and an LLM judge with its audit
(``judge``, which samples through ``stages.rollout``). It may import ``stages.models``,
``stages.rollout.generation``, ``stages.context`` and the Bradley-Terry maths of
``stages.preference_math``; never a stage kind.
"""
