"""Rewards: where every sample is scored.

What a pipeline declares of a reward and what a reward returns (``spec``), the built-in rewards
(``builtin_rewards``), a reward's name to its function (``registry``), what each reward accepts
(``schemas``), the one scorer every stage uses (columns built once, each reward isolated to the
completion that broke it, the ``reward_errors`` policy once: ``scoring``), a reward's known cases
checked before training (``known_cases``), the worker process that bounds each reward's wall
time in any thread (``worker``, ``worker_process``), and the rewards with machinery of their own:
code run in a bubblewrap sandbox (``code_tests``, ``sandbox``), math-verify answers
(``math_answer``), a trained reward model (``reward_model``) and an LLM judge with its audit
(``judge``, whose model judge opens an engine of ``stages.rollout`` when it is first asked). It may
import ``stages.models``, ``stages.sampling``, ``stages.context``, the Bradley-Terry maths of
``stages.preference_math`` and, late and in the judge only, ``stages.rollout``; never a stage kind.
"""
