"""The one policy sampler (stages/rollout/policy_sampler.py): which weights versions reach the engine, and
that a draw is seeded by the one seed scheme, as PPO and online DPO seeded theirs before it."""

from __future__ import annotations

import pytest

from stages.engines.interface import draw_offset
from stages.rollout.episodes import EpisodeRunner
from stages.rollout.policy_sampler import PolicySampler
from stages.sampling import SamplingSettings

PROMPTS = [[{"role": "user", "content": f"{a}+{a}"}] for a in range(3)]


class RecordingEngine:
    """Takes weights as a server does (``pushed`` says whether it pushed), records every version it is handed."""

    def __init__(self, pushed: bool = True):
        self.pushed, self.weights_version, self.taken = pushed, 0, []

    def take_weights(self, model, version: int) -> bool:
        self.taken.append(version)
        self.weights_version = version
        return self.pushed

    def close(self) -> None:
        self.taken.append("closed")


@pytest.fixture()
def tiny(tiny_checkpoint):
    from stages.models.loading import load_model_and_tokenizer

    return load_model_and_tokenizer(tiny_checkpoint, for_generation=True)


def test_a_version_reaches_the_engine_once_and_the_first_even_at_version_zero(tiny):
    _, tokenizer = tiny
    engine = RecordingEngine()
    sampler = PolicySampler(EpisodeRunner.completions(tokenizer), SamplingSettings(seed=0), engine)
    assert [sampler.take(None, v) for v in (0, 0, 1, 1, 2)] == [True, False, True, False, True]
    assert engine.taken == [0, 1, 2] and sampler.syncs == 3
    unpushed = PolicySampler(EpisodeRunner.completions(tokenizer), SamplingSettings(seed=0), RecordingEngine(False))
    assert unpushed.take(None, 0) is False and unpushed.syncs == 1  # taken, though nothing was pushed (HF)


def test_an_engine_that_holds_its_opened_weights_is_opened_on_first_use_and_given_only_newer_ones(tiny):
    _, tokenizer = tiny
    opened = []
    sampler = PolicySampler(EpisodeRunner.completions(tokenizer), SamplingSettings(seed=0),
                            opener=lambda: opened.append(RecordingEngine()) or opened[-1], opened_holds_weights=True)
    assert not opened and not sampler.holds(0)
    assert sampler.take(None, 0) is False and len(opened) == 1 and opened[0].taken == [] and sampler.syncs == 0
    assert sampler.take(None, 1) is True and opened[0].taken == [1] and sampler.syncs == 1
    sampler.close()
    assert opened[0].taken == [1, "closed"] and sampler.engine is None


def test_a_draw_samples_what_the_stage_seed_plus_its_draw_offset_samples(tiny):
    """Step s's batch, this process's shard from prompt 5 on: the samples of settings seeded
    ``seed + draw_offset(s, 5)``, as PPO drew them before the sampler; another draw gives others."""
    from stages.engines.hf_generate import HFEngine

    model, tokenizer = tiny
    settings = SamplingSettings(attempts=2, max_tokens=6, temperature=1.0, seed=11)
    engine = HFEngine(model, tokenizer, keep_logprobs=True)
    sampler = PolicySampler(EpisodeRunner.completions(tokenizer), settings, engine)

    def ids(groups):
        return [[episode.completion_ids for episode in group] for group in groups]

    drawn = sampler.draw(PROMPTS, 3, 5)
    before = EpisodeRunner.completions(tokenizer).run(engine, PROMPTS, settings.seeded(11 + draw_offset(3, 5)))
    assert ids(drawn) == ids(before)
    assert ids(sampler.draw(PROMPTS, 4, 5)) != ids(drawn)
