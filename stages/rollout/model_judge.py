"""A judge model (stages/rewards/judge.py) answering through an engine (stages/engines): rewards/ binds its judges
with the opener below, handed to it by stages/scorers.py, so that rewards/ imports nothing of rollout/."""

from __future__ import annotations

from pathlib import Path

from stages.rewards.spec import RewardSpec


class ModelJudge:
    """``conversations -> replies`` by a checkpoint through its engine, opened on first use."""

    def __init__(self, spec: RewardSpec, checkpoint: Path, trust_remote_code: bool = False):
        self.spec, self.checkpoint, self.trust_remote_code = spec, checkpoint, trust_remote_code
        self.engine = None

    def __call__(self, conversations: list[list[dict]]) -> list[str]:
        from stages.engines.machine import checkpoint_dtype
        from stages.engines.opening import open_engine
        from stages.engines.settings import EngineSettings
        from stages.rollout.episodes import complete

        if self.engine is None:
            # in the checkpoint's own dtype on any machine: a judge's greedy verdict is a score, and bfloat16's
            # rounding changes greedy replies (docs/benchmarks.md, "The engine on a CPU")
            self.engine = open_engine(self.spec.backend, self.checkpoint, keep_logprobs=False,
                                      trust_remote_code=self.trust_remote_code,
                                      prompt_batch_size=self.spec.batch_size,
                                      engine=EngineSettings(dtype=checkpoint_dtype(self.checkpoint)))
        return [group[0].text for group in complete(self.engine, conversations, self.spec.sampling)]


def open_model_judge(spec: RewardSpec, checkpoint: Path, trust_remote_code: bool = False) -> tuple[ModelJudge, str]:
    """The judge of ``spec`` on ``checkpoint``, not loaded yet, and the backend it will sample on."""
    from stages.engines.opening import choose_backend

    return ModelJudge(spec, checkpoint, trust_remote_code), choose_backend(spec.backend, checkpoint, refuse=False).name
