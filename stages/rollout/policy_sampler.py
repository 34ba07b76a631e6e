"""The one way a training stage samples its policy: step s's batch drawn by the episode runner through the
stage's engine, holding the policy's weights of the version asked for, seeded by the one seed scheme
(``draw_offset``). PPO, online DPO and GRPO's rollouts (policy_rollouts.py, served_rollouts.py) call it."""

from __future__ import annotations

from stages.engines.interface import draw_offset
from stages.rollout.episodes import Episode, EpisodeRunner
from stages.sampling import SamplingSettings


class PolicySampler:
    """Draws a stage's batches of the policy: ``runner``'s episodes at ``settings`` (seeded with the stage's seed),
    by ``engine``, or the engine ``opener`` opens on first use.

    ``take`` puts a version of the policy's weights into the engine unless it holds that version already;
    ``syncs`` counts the versions taken. ``opened_holds_weights``: the engine as opened counts as holding its
    ``weights_version`` (a generation server started from the policy's checkpoint serves version 0), so that
    version is not taken again; otherwise the first ``take`` always reaches the engine."""

    def __init__(self, runner: EpisodeRunner, settings: SamplingSettings, engine=None, opener=None,
                 opened_holds_weights: bool = False):
        self.runner, self.settings = runner, settings
        self.engine, self.opener = engine, opener
        self.opened_holds_weights = opened_holds_weights
        self.held: int | None = None if engine is None or not opened_holds_weights else engine.weights_version
        self.syncs = 0

    def opened(self):
        """The engine, opened now if not yet."""
        if self.engine is None:
            self.engine = self.opener()
            if self.opened_holds_weights:
                self.held = self.engine.weights_version
        return self.engine

    def holds(self, version: int) -> bool:
        return self.held is not None and self.held >= version

    def take(self, model, version: int) -> bool:
        """The engine samples ``model``'s weights of ``version`` (its optimizer updates) from now on; whether
        weights were pushed (none when it holds them already, or when it samples ``model`` itself)."""
        engine = self.opened()
        if self.holds(version):
            return False
        pushed = engine.take_weights(model, version)
        self.held, self.syncs = version, self.syncs + 1
        return pushed

    def draw(self, prompts: list[list[dict]], draw: int, first_prompt: int = 0, engine=None) -> list[list[Episode]]:
        """``settings.attempts`` episodes of each prompt, grouped by prompt: the stage's draw ``draw`` (its
        generation call; 0 first), for a batch whose first prompt is prompt ``first_prompt`` of the draw, by
        ``engine`` (default: the sampler's own)."""
        engine = self.opened() if engine is None else engine
        return self.runner.run(engine, prompts, self.settings, draw_offset(draw, first_prompt))

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine, self.held = None, None
