"""Rewards: where every sample is scored.

``spec`` (what a pipeline declares, what a reward returns), ``builtin_rewards``, ``registry`` (name
to function), ``schemas``, ``scoring`` (the one scorer), ``known_cases``, ``worker`` (a reward's wall
time bounded), and rewards with machinery of their own: ``code_tests`` / ``sandbox``,
``math_answer``, ``reward_model``, ``judge``. It may import ``stages.models``, ``stages.sampling``,
``stages.context`` and ``stages.preference_math``; never ``stages.rollout`` or a stage kind."""
