"""The ML half of posttrain: one module per stage kind, and the packages the kinds share.

A stage is a plain function ``run(config, inputs, ctx) -> outputs`` over its typed config,
its ``stages.context.StageInputs`` (datasets, checkpoints and reward specs, resolved to local
paths) and a tracking handle (``stages.context.StageContext``); ``outputs`` holds the paths it
staged and its ``metrics``. A kind declares itself once, as ``KIND`` (a ``StageKind``) in its own
module at this level (sft, reward_model, rl with grpo / ppo / difficulty, dpo and kto with
preference_training, online_dpo, eval, benchmark), and ``registry`` lists the kinds. What they
share lives in packages: ``data`` (what they read), ``models`` (what they load), ``engines``
(what samples a model: HF generate, in-process vLLM, a generation server), ``rollout`` (where a sample is made), ``rewards`` (where it is scored) and ``training`` (trainer callbacks,
several processes, alerts). ``scorers`` binds a stage's reward models and judges (where ``rewards`` meets ``rollout``).
``sampling`` is the one schema of a ``sampling:`` and its rules, which any
package may import (it imports nothing of posttrain but ``spec_model``). ``intervals`` is the error-bar maths eval logs and ``posttrain compare``
reads (SE clustered by prompt, paired differences, seeds, power). Nothing in this package imports Prefect or reads pipeline YAML;
``flows`` does the orchestration.
"""
