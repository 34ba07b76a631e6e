"""Rewards: where every sample is scored.

What a pipeline declares of a reward and what a reward returns (``spec``), the built-in rewards
(``builtin_rewards``), a reward's name to its function (``registry``), what each reward accepts
(``schemas``), the one scorer every stage uses (columns built once, each reward isolated to the
completion that broke it, the ``reward_errors`` policy once: ``scoring``), a reward's known cases
checked before training (``known_cases``), the worker process that bounds each reward's wall
time in any thread (``worker``, ``worker_process``), and the rewards with machinery of their own:
code run in a bubblewrap sandbox (``code_tests``, ``sandbox``), math-verify answers
(``math_answer``), a trained reward model (``reward_model``) and an LLM judge with its audit
(``judge``; a model judge samples through ``stages.rollout.model_judge``, handed in by
``stages.scorers``). It may import ``stages.models``, ``stages.sampling``, ``stages.context`` and the
Bradley-Terry maths of ``stages.preference_math``; never ``stages.rollout``, never a stage kind.
"""
