"""The agent loop: episodes of model turns and environment observations, as token ids (docs/algorithms.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

from stages.rollout.environments import (
    Environment,
    EnvironmentSpec,
    ToolResult,
    execute_tool_call,
    parse_tool_calls,
    tool_schemas,
)
from stages.engines.interface import Sample
from stages.sampling import SamplingSettings
from stages.rewards.scoring import ScoredBatch
from stages.rewards.spec import ENVIRONMENT_FN, RewardOutput, RewardSpec

ENDED_ANSWER, ENDED_TURNS, ENDED_TOKENS = "answer", "max_turns", "token_budget"


@dataclass
class Episode:
    """One episode: the prompt's ids, then model and observation ids with their mask and log-probs."""

    prompt_ids: list[int]
    messages: list[dict]  # the transcript: the start conversation, then assistant and tool messages
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # the sampled log-prob of model tokens, 0 for observations
    env_mask: list[int] = field(default_factory=list)  # 1: the model sampled it; 0: an observation
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    ended: str = ""  # answer, max_turns or token_budget
    answer: str | None = None  # the final turn's text when the episode ended with an answer
    tool_results: list[ToolResult] = field(default_factory=list)  # every call's result, in order
    weights_version: int = 0  # the policy version of its model turns (Sample.weights_version; one per episode)
    sampler_logprobs: bool = True  # every model token's log-prob is the sampler's (else the engine kept none)

    @property
    def budget_hit(self) -> bool:
        return self.ended in (ENDED_TURNS, ENDED_TOKENS)

    @property
    def used_tool(self) -> bool:
        return self.tool_calls > self.tool_errors

    def as_sample(self) -> Sample:
        """The episode as one sample: its answer (empty when a budget ended it), model tokens and log-probs."""
        model = [i for i, m in enumerate(self.env_mask) if m]
        return Sample(text=self.answer or "", token_ids=[self.completion_ids[i] for i in model],
                      logprobs=[self.logprobs[i] for i in model] if self.sampler_logprobs else [],
                      truncated=self.budget_hit, weights_version=self.weights_version)


def render_prompt_ids(tokenizer, messages: list[dict], tools: list[dict] | None) -> list[int]:
    """The start conversation rendered with its tools and the generation prompt, tokenised once."""
    text = tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def observation_ids(tokenizer, tool_messages: list[dict]) -> list[int]:
    """The template's rendering of ``tool_messages`` and the next generation prompt, as the ids that follow
    an assistant turn ending in the end-of-turn token (TRL's ``_get_tool_suffix_ids`` recipe)."""
    dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "dummy"}]
    prefix = tokenizer.apply_chat_template(dummy, tokenize=False)
    full = tokenizer.apply_chat_template(dummy + tool_messages, tokenize=False, add_generation_prompt=True)
    prefix_ids = tokenizer(prefix, add_special_tokens=False)["input_ids"]
    full_ids = tokenizer(full, add_special_tokens=False)["input_ids"]
    eos = [i for i, t in enumerate(prefix_ids) if t == tokenizer.eos_token_id]
    if eos:  # templates that put a newline after the end-of-turn token: the model's turn stops at the token
        prefix_ids = prefix_ids[: eos[-1] + 1]
    if full_ids[: len(prefix_ids)] != prefix_ids:
        raise ValueError("the chat template renders an assistant turn differently once tool messages follow; "
                         "its observations cannot be appended as ids")
    return full_ids[len(prefix_ids):]


class EpisodeRunner:
    """Runs episodes at fixed settings through an engine's ``generate_ids``; with no environment, one turn each."""

    def __init__(self, environment: Environment | None, spec: EnvironmentSpec | None, tokenizer):
        self.environment, self.spec, self.tokenizer = environment, spec, tokenizer
        self.tools = environment.tools() if environment is not None else {}
        self.schemas = tool_schemas(self.tools) if spec is not None and spec.render_tools else None
        self.max_turns = spec.max_turns if spec is not None else 1

    @classmethod
    def completions(cls, tokenizer) -> EpisodeRunner:
        """One-turn episodes, no environment: the turn's text is the answer, cut by its budget or not."""
        return cls(None, None, tokenizer)

    def start(self, messages: list[dict]) -> Episode:
        return Episode(render_prompt_ids(self.tokenizer, messages, self.schemas), [dict(m) for m in messages])

    def budget(self, episode: Episode, settings: SamplingSettings) -> int:
        """The next turn's token budget: the per-turn ``max_tokens``, within what the episode has left."""
        if self.spec is None:
            return settings.max_tokens
        return min(settings.max_tokens, self.spec.max_episode_tokens - len(episode.completion_ids))

    def run(self, engine, starts: list[list[dict]], settings: SamplingSettings,
            seed_offset: int = 0) -> list[list[Episode]]:
        """``settings.attempts`` episodes per start, grouped by start, ``max_tokens`` a turn; start i seeded
        ``settings.seed + seed_offset + i`` (first turn: one request for all attempts; later: one per episode)."""
        groups = []
        for messages in starts:
            first = self.start(messages)
            groups.append([first] + [Episode(list(first.prompt_ids), [dict(m) for m in messages])
                                     for _ in range(settings.attempts - 1)])
        if groups:
            budget = self.budget(groups[0][0], settings)
            drawn = engine.generate_ids([group[0].prompt_ids for group in groups],
                                         settings.model_copy(update={"max_tokens": budget}), seed_offset=seed_offset)
            for group, samples in zip(groups, drawn):
                for episode, sample in zip(group, samples):
                    self.take_turn(episode, sample, last_turn=self.max_turns == 1)
        episodes = [episode for group in groups for episode in group]
        turn_settings = settings.model_copy(update={"attempts": 1})
        for turn in range(1, self.max_turns):
            active = [i for i, episode in enumerate(episodes) if not episode.ended]
            if not active:
                break
            budgets = [self.budget(episodes[i], settings) for i in active]
            # one call per distinct budget: the engine takes one max_tokens per call
            for budget in sorted(set(budgets)):
                members = [i for i, b in zip(active, budgets) if b == budget]
                samples = engine.generate_ids(
                    [episodes[i].prompt_ids + episodes[i].completion_ids for i in members],
                    turn_settings.model_copy(update={"max_tokens": budget}),
                    seed_offset=seed_offset + turn * 1_000_003 + budget * 7919)
                for i, group in zip(members, samples):
                    self.take_turn(episodes[i], group[0], last_turn=turn == self.max_turns - 1)
        return groups

    def take_turn(self, episode: Episode, sample: Sample, last_turn: bool) -> None:
        """Append a sampled turn; end the episode, or execute its tool calls and append the observation."""
        episode.completion_ids += list(sample.token_ids)
        episode.weights_version = sample.weights_version
        episode.logprobs += list(sample.logprobs) or [0.0] * len(sample.token_ids)
        episode.sampler_logprobs = episode.sampler_logprobs and bool(sample.logprobs or not sample.token_ids)
        episode.env_mask += [1] * len(sample.token_ids)
        if self.environment is None:  # a completion: one turn, its text the answer
            episode.turns = 1
            episode.messages.append({"role": "assistant", "content": sample.text})
            episode.ended, episode.answer = ENDED_TOKENS if sample.truncated else ENDED_ANSWER, sample.text
            return
        text = self.tokenizer.decode(sample.token_ids, skip_special_tokens=True)
        tool_messages = advance(episode, text, sample.truncated, last_turn, self.tools, self.spec)
        if tool_messages is None:
            return
        observation = observation_ids(self.tokenizer, tool_messages)
        if len(episode.completion_ids) + len(observation) >= self.spec.max_episode_tokens:
            episode.ended = ENDED_TOKENS  # no room left to read the result and answer
            return
        episode.completion_ids += observation
        episode.logprobs += [0.0] * len(observation)
        episode.env_mask += [0] * len(observation)


def complete(engine, prompts: list[list[dict]], settings: SamplingSettings, seed_offset: int = 0) -> list[list[Sample]]:
    """``settings.attempts`` single completions of every prompt by ``engine``, as samples grouped by prompt."""
    groups = EpisodeRunner.completions(engine.tokenizer).run(engine, prompts, settings, seed_offset)
    return [[episode.as_sample() for episode in group] for group in groups]


def advance(episode: Episode, text: str, truncated: bool, last_turn: bool, tools: dict,
            spec: EnvironmentSpec) -> list[dict] | None:
    """Apply a model turn's text: it ends the episode, or its tool calls run and their ``tool`` messages return."""
    episode.turns += 1
    episode.messages.append({"role": "assistant", "content": text})
    calls = parse_tool_calls(text)
    if truncated:
        episode.ended = ENDED_TOKENS
    elif calls is None:
        episode.ended, episode.answer = ENDED_ANSWER, text
    elif last_turn:
        episode.ended = ENDED_TURNS
    if episode.ended:
        return None
    results = [execute_tool_call(call, tools, spec.tool_timeout_s, spec.max_observation_chars) for call in calls]
    episode.tool_calls += len(results)
    episode.tool_results += results
    episode.tool_errors += sum(r.error for r in results)
    tool_messages = [{"role": "tool", "name": r.name, "content": r.content} for r in results]
    episode.messages += tool_messages
    return tool_messages


def replay(environment: Environment, spec: EnvironmentSpec, messages: list[dict], turns: list[str]) -> Episode:
    """An episode from scripted turns (text): the tools run for real; a script unanswered at its end hits max_turns."""
    episode = Episode([], [dict(m) for m in messages])
    tools = environment.tools()
    for i, text in enumerate(turns[: spec.max_turns]):
        if advance(episode, text, False, i == spec.max_turns - 1, tools, spec) is None:
            break
    if not episode.ended:
        episode.ended = ENDED_TURNS
    return episode


def shortcut(episode: Episode, spec: EnvironmentSpec) -> bool:
    """An answer given without one successful tool call where the environment requires the tool."""
    return spec.require_tool and episode.ended == ENDED_ANSWER and not episode.used_tool


def environment_scorers(rewards: dict[str, RewardSpec], environment: Environment,
                        episodes: list[Episode]) -> dict:
    """Bound scorers for the rewards whose fn is ``environment``: the environment's own score of each of
    ``episodes`` (one that raises is a counted reward error; None is unparsed; both score 0)."""

    def scorer(completions, answer=None, task=None, **_):
        answers, tasks = answer or [None] * len(episodes), task or [None] * len(episodes)
        if len(completions) != len(episodes):
            raise RuntimeError(f"{len(completions)} completions for {len(episodes)} episodes")
        scores, parsed, errors = [], [], []
        for i, episode in enumerate(episodes):
            try:
                value = environment.score(episode, answers[i], tasks[i])
            except Exception as error:  # the environment's failure is the reward's: counted, never silent
                errors.append((i, f"{type(error).__name__}: {error}"))
                value = None
            scores.append(0.0 if value is None else float(value))
            parsed.append(value is not None)
        return RewardOutput(scores, parsed, errors)

    return {name: scorer for name, spec in rewards.items() if spec.fn == ENVIRONMENT_FN}


def zero_shortcuts(scored: ScoredBatch, episodes: list[Episode], spec: EnvironmentSpec) -> ScoredBatch:
    """``scored`` with every reward of a shortcut episode (``require_tool``) set to 0."""
    keep = [not shortcut(e, spec) for e in episodes]
    for component in scored.components:
        component.scores = [s if k else 0.0 for s, k in zip(component.scores, keep)]
    scored.total = [t if k else 0.0 for t, k in zip(scored.total, keep)]
    return scored


def episode_metrics(episodes: list[Episode], spec: EnvironmentSpec) -> dict[str, float]:
    """Turns and tool calls per episode, the tool error rate, and how episodes ended."""
    n = max(len(episodes), 1)
    calls = sum(e.tool_calls for e in episodes)
    return {
        "env/turns_mean": sum(e.turns for e in episodes) / n,
        "env/tool_calls_mean": calls / n,
        "env/tool_error_rate": sum(e.tool_errors for e in episodes) / calls if calls else 0.0,
        "env/budget_hit_rate": sum(e.budget_hit for e in episodes) / n,
        "env/turn_budget_hit_rate": sum(e.ended == ENDED_TURNS for e in episodes) / n,
        "env/token_budget_hit_rate": sum(e.ended == ENDED_TOKENS for e in episodes) / n,
        "env/shortcut_rate": sum(shortcut(e, spec) for e in episodes) / n,
        "env/model_tokens_mean": sum(sum(e.env_mask) for e in episodes) / n,
    }
