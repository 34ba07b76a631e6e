"""The agent loop: environments, episodes built from ids, observations never trained on, agent evaluation."""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path

import pytest
import torch

from stages.data.sources import ArithmeticData, materialize
from stages.rollout.environments import Environment, EnvironmentSpec, build_environment, execute_tool_call, parse_tool_calls
from stages.rollout.episodes import EpisodeRunner, episode_metrics, observation_ids, replay
from stages.engines.hf_generate import HFEngine
from stages.engines.interface import Sample
from stages.sampling import SamplingSettings
from stages.rewards.spec import RewardSpec
from stages.context import StageInputs

CALL = '<tool_call>calculator("47*86")</tool_call>'
QUESTION = [{"role": "user", "content": "What is 47*86?"}]


HUNG = threading.Event()  # set by the test once it is done: the hung tool's abandoned thread then returns
HUNG_THREADS: list[threading.Thread] = []


class UnrulyEnvironment(Environment):
    """Tools that raise, hang and flood: the episode must go on with a recorded error each time."""

    def tools(self):
        def boom(x: int) -> str:
            raise RuntimeError("tool exploded")

        def hang(x: int) -> str:
            HUNG_THREADS.append(threading.current_thread())
            HUNG.wait(timeout=60)
            return "never"

        def flood(x: int) -> str:
            return "9" * 1_000_000

        return {"boom": boom, "hang": hang, "flood": flood}


def scripted(tokenizer, text: str) -> Sample:
    """A turn as an engine returns it: the text's ids and the end-of-turn token (log-probs made up: -0.5)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return Sample(text=text, token_ids=ids, logprobs=[-0.5] * len(ids), truncated=False)


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    from stages.models.loading import load_model_and_tokenizer

    return load_model_and_tokenizer(tiny_checkpoint, for_generation=True)


def test_episode_ids_are_the_sampled_ids_then_the_rendered_observation_masked_out(tiny):
    _, tokenizer = tiny
    spec = EnvironmentSpec(fn="calculator", max_turns=3, max_episode_tokens=200)
    runner = EpisodeRunner(build_environment(spec), spec, tokenizer)
    episode = runner.start(QUESTION)
    first, second = scripted(tokenizer, CALL), scripted(tokenizer, "4042")
    runner.take_turn(episode, first, last_turn=False)
    runner.take_turn(episode, second, last_turn=False)

    observation = observation_ids(tokenizer, [{"role": "tool", "name": "calculator", "content": "4042"}])
    assert tokenizer.decode(observation) == "<|tool|>4042<|end|><|assistant|>"  # the template's rendering
    assert episode.completion_ids == first.token_ids + observation + second.token_ids
    assert episode.env_mask == [1] * len(first.token_ids) + [0] * len(observation) + [1] * len(second.token_ids)
    assert episode.logprobs == first.logprobs + [0.0] * len(observation) + second.logprobs
    assert (episode.ended, episode.answer, episode.turns, episode.tool_calls, episode.tool_errors) == \
        ("answer", "4042", 2, 1, 0)
    # the tools were rendered through the chat template into the prompt
    assert tokenizer.decode(episode.prompt_ids).startswith("<|system|>tools: calculator<|end|><|user|>What is")
    # and the appended ids are what rendering the whole transcript gives (a char-level tokenizer splits alike)
    whole = tokenizer.apply_chat_template(episode.messages, tools=runner.schemas, tokenize=False)
    assert tokenizer.decode(episode.prompt_ids + episode.completion_ids) == whole


def test_token_budget_and_turn_budget_end_episodes(tiny):
    model, tokenizer = tiny
    spec = EnvironmentSpec(fn="calculator", max_turns=2, max_episode_tokens=12)
    runner = EpisodeRunner(build_environment(spec), spec, tokenizer)
    backend = HFEngine(model, tokenizer, keep_logprobs=True)
    [episodes] = runner.run(backend, [QUESTION], SamplingSettings(max_tokens=8, attempts=3, seed=0))
    for e in episodes:  # the untrained model never stops inside 8 tokens: the per-turn budget ends it
        assert e.ended == "token_budget" and e.budget_hit and e.answer is None
        assert len(e.completion_ids) == len(e.logprobs) == len(e.env_mask) == 8 and all(e.env_mask)
        assert all(lp <= 0 for lp in e.logprobs)
    two_calls = replay(build_environment(spec), spec, QUESTION, [CALL, CALL])
    assert (two_calls.ended, two_calls.tool_calls) == ("max_turns", 1)  # the last allowed turn is not executed
    # an observation that does not fit the episode's budget ends it on the token budget
    episode = runner.start(QUESTION)
    runner.take_turn(episode, scripted(tokenizer, '<tool_call>calculator("1")</tool_call>'), last_turn=False)
    assert episode.ended == "token_budget" and 0 not in episode.env_mask


def test_a_single_completion_is_a_one_turn_episode_drawn_as_the_engine_draws_it(tiny):
    """``complete`` (one-turn episodes of ``EpisodeRunner.completions``) gives exactly the samples the engine gives
    for the same prompts and seed: sampled, cut at a stop string, greedy; an episode's answer is its text, cut by
    its budget or not."""
    from stages.rollout.episodes import complete

    model, tokenizer = tiny
    prompts = [QUESTION, [{"role": "user", "content": "What is 3+4?"}]]
    backend = HFEngine(model, tokenizer, keep_logprobs=True)
    for settings in (SamplingSettings(max_tokens=8, attempts=3, seed=5),
                     SamplingSettings(max_tokens=12, attempts=2, seed=1, stop=["1"]),
                     SamplingSettings(max_tokens=6, attempts=2, temperature=0.0)):
        assert complete(backend, prompts, settings) == backend.generate(prompts, settings)
    [group] = EpisodeRunner.completions(tokenizer).run(backend, [QUESTION], SamplingSettings(max_tokens=4, attempts=2))
    assert all(e.turns == 1 and e.ended == "token_budget" and e.answer == e.messages[-1]["content"] for e in group)
    assert [e.as_sample().text for e in group] == [e.answer for e in group] and all(e.as_sample().truncated for e in group)


def test_an_environments_first_turn_is_one_request_per_start_for_all_its_attempts(tiny):
    """The attempts of one start share their first turn's request (one prefill, the engine's n), seeded as a
    single completion of that start is; later turns go one request per episode."""
    model, tokenizer = tiny
    spec = EnvironmentSpec(fn="calculator", max_turns=2, max_episode_tokens=40)
    runner = EpisodeRunner(build_environment(spec), spec, tokenizer)
    backend = HFEngine(model, tokenizer, keep_logprobs=True)
    settings = SamplingSettings(max_tokens=8, attempts=3, seed=3)
    starts = [QUESTION, [{"role": "user", "content": "What is 12*12?"}]]
    groups = runner.run(backend, starts, settings, seed_offset=7)
    first_turns = backend.generate_ids([runner.start(m).prompt_ids for m in starts], settings, seed_offset=7)
    assert [len(group) for group in groups] == [3, 3]
    for group, samples in zip(groups, first_turns):
        assert [e.completion_ids[: len(s.token_ids)] for e, s in zip(group, samples)] == [s.token_ids for s in samples]
        assert all(e.prompt_ids == group[0].prompt_ids for e in group)


def test_unruly_tools_are_contained_and_the_episode_goes_on():
    spec = EnvironmentSpec(fn="test_agent:UnrulyEnvironment", max_turns=6, tool_timeout_s=0.5,
                           max_observation_chars=100)
    turns = ["<tool_call>boom(1)</tool_call>", "<tool_call>hang(1)</tool_call>", "<tool_call>flood(1)</tool_call>",
             '<tool_call>{"name": "boom", "arguments": {"x": "one"}}</tool_call>', "<tool_call>boom(</tool_call>",
             "done"]
    started = time.perf_counter()
    HUNG.clear()
    HUNG_THREADS.clear()
    try:
        episode = replay(build_environment(spec), spec, QUESTION, turns)
    finally:  # the abandoned call ends with the test, not 60 s later
        HUNG.set()
        for thread in HUNG_THREADS:
            thread.join(timeout=10)
    assert len(HUNG_THREADS) == 1 and not HUNG_THREADS[0].is_alive(), HUNG_THREADS
    assert time.perf_counter() - started < 5
    results = [m["content"] for m in episode.messages if m["role"] == "tool"]
    assert "tool exploded" in results[0] and "ran past 0.5 s" in results[1]
    assert len(results[2]) == 100 and results[2].endswith("chars]")  # 1 MB cut to the observation limit
    assert "x must be int" in results[3] and "unparsable tool call" in results[4]
    assert (episode.ended, episode.answer, episode.tool_calls, episode.tool_errors) == ("answer", "done", 5, 4)


@pytest.mark.needs_bwrap
def test_python_tool_runs_in_the_sandbox_with_its_limits():
    # the loop meets a 1 s limit; the other calls one that start-up on a loaded machine cannot reach
    environments = [build_environment(EnvironmentSpec(fn="python", kwargs={"timeout_s": limit}, max_turns=4))
                    for limit in (30.0, 1.0, 30.0)]
    for environment in environments:
        environment.check()
    calls = parse_tool_calls('<tool_call>python("print(47*86)")</tool_call>'
                             '<tool_call>python("while True: pass")</tool_call>'
                             '<tool_call>python("import os; print(os.listdir(\'/work\'))")</tool_call>')
    ok, looping, escaping = [execute_tool_call(call, environment.tools(), timeout_s=60, max_chars=500)
                             for call, environment in zip(calls, environments)]
    assert (ok.content, ok.error) == ("4042", False)
    assert looping.error and "time" in looping.content.lower()  # killed by the sandbox's wall clock
    assert escaping.error and "FileNotFoundError" in escaping.content  # the host's files are not there


def test_known_episodes_are_scored_before_training():
    from stages.rollout.environments import EpisodeCase
    from stages.rollout.episode_checks import check_episode_cases

    spec = EnvironmentSpec(fn="calculator", max_turns=3, require_tool=True)
    cases = [EpisodeCase(case="success", prompt="What is 47*86?", answer="4042", turns=[CALL, "4042"], min=1.0),
             EpisodeCase(case="shortcut", prompt="What is 47*86?", answer="4042", turns=["4042"], max=0.0),
             EpisodeCase(case="malformed", prompt="What is 47*86?", answer="4042", tool_errors=1, max=0.0,
                         turns=['<tool_call>calculator("What is 47*86?")</tool_call>', "4042"])]
    results = check_episode_cases(spec, {"correct": RewardSpec(fn="exact_answer")}, cases)
    assert [r.score for r in results] == [1.0, 0.0, 0.0] and not any(r.violations for r in results)
    lenient = spec.model_copy(update={"require_tool": False})  # a reward that pays the shortcut is caught
    assert check_episode_cases(lenient, {"correct": RewardSpec(fn="exact_answer")}, cases)[1].violations


def test_episode_metrics_counted_by_hand():
    spec = EnvironmentSpec(fn="calculator", max_turns=3, require_tool=True)
    env = build_environment(spec)
    episodes = [replay(env, spec, QUESTION, [CALL, "4042"]),                            # 2 turns, 1 call
                replay(env, spec, QUESTION, ['<tool_call>calculator(</tool_call>', "7"]),  # 2 turns, 1 error
                replay(env, spec, QUESTION, [CALL, CALL, CALL]),                        # 3 turns, 2 calls, budget
                replay(env, spec, QUESTION, ["4042"])]                                  # 1 turn, shortcut
    metrics = episode_metrics(episodes, spec)
    assert metrics["env/turns_mean"] == (2 + 2 + 3 + 1) / 4
    assert metrics["env/tool_calls_mean"] == (1 + 1 + 2 + 0) / 4
    assert metrics["env/tool_error_rate"] == 1 / 4
    assert metrics["env/budget_hit_rate"] == metrics["env/turn_budget_hit_rate"] == 1 / 4
    assert metrics["env/shortcut_rate"] == 2 / 4  # answered with no successful call: the 2nd and the 4th


def test_loss_kl_and_ratio_ignore_observation_tokens(tiny_checkpoint):
    """An episode built by hand through TRL's loss: the observation's log-probs (behaviour and reference)
    changed to anything leave the loss and its gradient as they were; counted as model tokens, they do not."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from stages.models.loading import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(tiny_checkpoint)
    args = GRPOConfig(output_dir="/tmp/unused-agent-loss", per_device_train_batch_size=2, num_generations=2,
                      beta=0.1, loss_type="grpo", report_to="none", use_cpu=True, max_completion_length=8)
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                          train_dataset=Dataset.from_list([{"prompt": "x"}] * 2), processing_class=tokenizer)
    ids = tokenizer("<|user|>6*7?<|end|><|assistant|>", add_special_tokens=False)["input_ids"]
    turn, obs, answer = (tokenizer(t, add_special_tokens=False)["input_ids"] for t in ('calc("6*7")', "<|tool|>42", "42"))
    completion = turn + obs + answer
    mask_T = torch.tensor([[1] * len(turn) + [0] * len(obs) + [1] * len(answer)] * 2)
    T = len(completion)

    def loss_and_grad(old_T, ref_T, tool_mask):
        inputs = {"prompt_ids": torch.tensor([ids] * 2), "prompt_mask": torch.ones(2, len(ids), dtype=torch.long),
                  "completion_ids": torch.tensor([completion] * 2), "completion_mask": torch.ones(2, T, dtype=torch.long),
                  "advantages": torch.tensor([1.0, -0.5]), "old_per_token_logps": old_T, "ref_per_token_logps": ref_T,
                  "num_items_in_batch": tool_mask.sum(), "tool_mask": tool_mask}
        model.zero_grad()
        loss = trainer._compute_loss(model, inputs)
        loss.backward()
        return loss.item(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    old_T, ref_T = torch.full((2, T), -3.0), torch.full((2, T), -2.5)
    garbage_old, garbage_ref = old_T.clone(), ref_T.clone()
    garbage_old[mask_T == 0], garbage_ref[mask_T == 0] = -40.0, 5.0
    loss, grad = loss_and_grad(old_T, ref_T, mask_T)
    loss_garbage, grad_garbage = loss_and_grad(garbage_old, garbage_ref, mask_T)
    assert loss == loss_garbage and torch.equal(grad, grad_garbage)
    unmasked, _ = loss_and_grad(garbage_old, garbage_ref, torch.ones_like(mask_T))
    assert unmasked != pytest.approx(loss)

    # the same loss by hand over the model tokens only (GRPO: per-sequence mean, clipped ratio, k3 KL times
    # the ratio: TRL's use_bias_correction_kl, on by default)
    with torch.no_grad():
        logits = model(torch.tensor([ids + completion] * 2)).logits[:, len(ids) - 1 : -1]
        logp_T = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor([completion] * 2)[..., None])[..., 0]
    advantages = torch.tensor([[1.0], [-0.5]])
    ratio = torch.exp(logp_T - old_T)
    policy = -torch.min(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages)
    kl = (torch.exp(ref_T - logp_T) - (ref_T - logp_T) - 1) * ratio
    per_token = (policy + 0.1 * kl) * mask_T
    expected = (per_token.sum(-1) / mask_T.sum(-1)).mean()
    assert loss == pytest.approx(expected.item(), rel=1e-3)


def test_eval_stage_runs_episodes_hashes_their_settings_and_keeps_transcripts(tiny_checkpoint, ctx_factory, home):
    from stages.eval import EvalConfig, run, settings_hash

    data = materialize(ArithmeticData(generator="arithmetic_calculator", n=3, role="heldout", ops=["*"],
                                      min_operand=10, max_operand=99), Path("."), home / "data")
    fields = dict(kind="eval", model="base", data="heldout", rewards=["correct", "environment"],
                  environment={"fn": "calculator", "max_turns": 2, "max_episode_tokens": 16},
                  sampling={"max_tokens": 6, "attempts": 2, "seed": 0, "temperature": 1.0})
    config = EvalConfig(**fields)
    rewards = {"correct": RewardSpec(fn="exact_answer"), "environment": RewardSpec(fn="environment")}
    inputs = StageInputs(model=tiny_checkpoint, datasets={"data": data}, rewards=rewards)
    out = run(config, inputs, ctx_factory("eval-agent"))
    metrics = out["metrics"]
    cases = [json.loads(line) for line in Path(out["failures"]).read_text().splitlines()]
    assert len(cases) == 3  # the untrained model answers nothing right: every prompt is a failure case
    # counted by hand from the transcripts the failure cases keep
    transcripts = [t for case in cases for t in case["transcripts"]]
    ended = [e for case in cases for e in case["ended"]]
    assert all(t[0]["content"].startswith("What is") and t[1]["role"] == "assistant" for t in transcripts)
    answered = [t[-1]["content"] for t, e in zip(transcripts, ended) if e == "answer"]
    assert metrics["env/budget_hit_rate"] == metrics["truncated_rate"] == pytest.approx(sum(e != "answer" for e in ended) / 6)
    assert metrics["format_error_rate"] == pytest.approx(sum(not a.strip().lstrip("-").isdigit() for a in answered) / 6)
    assert metrics["env/turns_mean"] == sum(m["role"] == "assistant" for t in transcripts for m in t) / 6
    assert metrics["env/tool_calls_mean"] == sum(m["role"] == "tool" for t in transcripts for m in t) / 6
    assert metrics["reward/environment/mean"] == 0.0 and metrics["reward/environment/errors"] == 0.0  # scored, not raised
    hashes = {settings_hash(EvalConfig(**{**fields, "environment": {**fields["environment"], **change}}), data, rewards)
              for change in ({}, {"max_turns": 3}, {"max_episode_tokens": 17})}
    hashes.add(settings_hash(EvalConfig(**{**fields, "environment": None}), data, rewards))
    assert len(hashes) == 4


def test_environment_is_refused_with_a_difficulty_filter():
    from pydantic import ValidationError

    from stages.rl_common import rl_stage_config

    base = dict(kind="rl", policy="base", data="train", rewards=["correct"], environment={"fn": "calculator"})
    assert rl_stage_config(algorithm="ppo", **base).environment.fn == "calculator"
    with pytest.raises(ValidationError, match="difficulty_filter samples single completions"):
        rl_stage_config(algorithm="grpo", difficulty_filter={"sampling": {"attempts": 2}}, **base)


def test_ppo_loss_kl_and_gae_ignore_observation_tokens(tiny_checkpoint):
    """Two episodes built by hand (a call, the calculator's observation, an answer) through posttrain's PPO:
    its targets and losses equal a computation over the model tokens alone, each episode run unpadded through
    the networks and its observation positions then dropped; anything put at observation positions leaves the
    losses as they were, and counting observations as actions changes them."""
    from stages.rollout.episodes import Episode
    from stages.models.loading import load_model_and_tokenizer
    from stages.models.critic import ValueModel
    from stages.models.loading import load_frozen_reference
    from stages.ppo import build_episode_rollout, compute_targets, minibatch_losses
    from stages.rl_common import rl_stage_config

    torch.manual_seed(0)
    policy, tokenizer = load_model_and_tokenizer(tiny_checkpoint)
    reference = load_frozen_reference(tiny_checkpoint)
    critic = ValueModel.from_policy_checkpoint(tiny_checkpoint)
    with torch.no_grad():
        for p in reference.parameters():  # a reference the policy has moved away from: the KL is not 0
            p.add_(0.05 * torch.randn_like(p))
        torch.nn.init.normal_(critic.head.weight, std=0.5)
    policy.eval(), critic.eval()
    config = rl_stage_config(kind="rl", algorithm="ppo", policy="base", data="train", rewards=["correct"], kl_beta=0.3,
                           gamma=0.9, lam=0.8, clip_epsilon=0.1, environment={"fn": "calculator"})

    def ids(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    prompt, eos = ids("<|user|>6*7?<|end|><|assistant|>"), [tokenizer.eos_token_id]
    episodes = []
    for call, answer in (('calculator("6*7")', "42"), ('calculator("6*70")', "4200")):
        turn, obs, final = ids(call) + eos, ids("<|tool|>42<|end|><|assistant|>"), ids(answer) + eos
        episodes.append(Episode(prompt, [], turn + obs + final, [-1.0] * (len(turn) + len(obs) + len(final)),
                                [1] * len(turn) + [0] * len(obs) + [1] * len(final)))
    rollout = build_episode_rollout(episodes, [0, 0], tokenizer)
    assert rollout.mask_B_T.tolist()[0] == episodes[0].env_mask + [0] * (rollout.mask_B_T.shape[1] - len(episodes[0].env_mask))
    scores = torch.tensor([1.0, -0.5])
    targets = compute_targets(policy, reference, critic, rollout, scores, 0.3, config)
    with torch.no_grad():  # the policy moves on: ratios off 1, some clipped
        for p in policy.parameters():
            p.add_(0.02 * torch.randn_like(p))
    rows = torch.arange(2)
    policy_loss, value_loss, _, ratio_mean, _ = minibatch_losses(policy, critic, rollout, targets, rows, config)

    # by hand: each episode alone (no padding), then only its model tokens kept
    old_policy = load_frozen_reference(tiny_checkpoint)
    hand = {k: [] for k in ("old", "ref", "new", "value", "old_value", "advantage", "return")}
    for episode, score in zip(episodes, scores.tolist()):
        full = torch.tensor([episode.prompt_ids + episode.completion_ids])
        keep = [len(prompt) - 1 + t for t, m in enumerate(episode.env_mask) if m]  # positions predicting model tokens
        kept_ids = torch.tensor([episode.completion_ids[t] for t, m in enumerate(episode.env_mask) if m])
        with torch.no_grad():
            logps = {name: torch.log_softmax(net(full).logits[0, keep].float(), -1)[torch.arange(len(keep)), kept_ids]
                     for name, net in (("old", old_policy), ("ref", reference))}
            old_values = critic(full, torch.ones_like(full), torch.arange(full.shape[1])[None])[0, keep]
        logps["new"] = torch.log_softmax(policy(full).logits[0, keep].float(), -1)[torch.arange(len(keep)), kept_ids]
        values = critic(full, torch.ones_like(full), torch.arange(full.shape[1])[None])[0, keep]
        rewards = -0.3 * (logps["old"] - logps["ref"])
        rewards[-1] += score
        advantages, running, next_value = [0.0] * len(keep), 0.0, 0.0
        for t in reversed(range(len(keep))):  # GAE over the model tokens, as if the observation were not there
            running = rewards[t].item() + 0.9 * next_value - old_values[t].item() + 0.9 * 0.8 * running
            advantages[t], next_value = running, old_values[t].item()
        for key, value in (("old", logps["old"]), ("ref", logps["ref"]), ("new", logps["new"]), ("value", values),
                           ("old_value", old_values), ("advantage", torch.tensor(advantages)),
                           ("return", torch.tensor(advantages) + old_values)):
            hand[key].append(value)
    cat = {k: torch.cat(v) for k, v in hand.items()}
    whitened = (cat["advantage"] - cat["advantage"].mean()) / torch.sqrt(cat["advantage"].var(unbiased=False) + 1e-8)
    ratio = torch.exp(cat["new"] - cat["old"])
    expected_policy = torch.maximum(-whitened * ratio, -whitened * ratio.clamp(0.9, 1.1)).mean()
    clipped_values = cat["old_value"] + (cat["value"] - cat["old_value"]).clamp(-0.2, 0.2)
    expected_value = 0.5 * torch.maximum((cat["value"] - cat["return"]) ** 2, (clipped_values - cat["return"]) ** 2).mean()

    actions = rollout.mask_B_T.bool()
    assert torch.allclose(targets.k1[actions], cat["old"] - cat["ref"], atol=1e-5)  # the KL penalty's terms
    assert torch.allclose(targets.advantages[actions], whitened, atol=1e-4)
    assert torch.allclose(targets.returns[actions], cat["return"], atol=1e-5)
    for name in ("old_logprobs", "advantages", "returns", "k1", "k3", "entropy"):
        assert not getattr(targets, name)[~actions].any(), name  # observations: no log-prob, reward or advantage
    assert policy_loss.item() == pytest.approx(expected_policy.item(), rel=1e-4, abs=1e-6)
    assert value_loss.item() == pytest.approx(expected_value.item(), rel=1e-4, abs=1e-6)
    assert ratio_mean.item() == pytest.approx(ratio.mean().item(), rel=1e-5)

    # garbage at observation positions changes nothing; observations counted as actions change the losses
    import dataclasses

    observations = (rollout.attention_mask_B_L[:, -rollout.mask_B_T.shape[1]:].bool() & ~actions)
    garbage = dataclasses.replace(targets, **{name: getattr(targets, name).masked_fill(observations, 7.0) for name in
                                              ("old_logprobs", "old_values", "advantages", "returns")})
    again = minibatch_losses(policy, critic, rollout, garbage, rows, config)
    assert (again[0].item(), again[1].item()) == (policy_loss.item(), value_loss.item())
    rollout.mask_B_T = rollout.attention_mask_B_L[:, -rollout.mask_B_T.shape[1]:].float()
    counted = minibatch_losses(policy, critic, rollout, garbage, rows, config)
    assert counted[0].item() != pytest.approx(policy_loss.item()) and counted[1].item() != pytest.approx(value_loss.item())


def test_grpo_trains_in_the_environment(tiny_checkpoint, ctx_factory, home):
    from stages import rl
    from stages.rl_common import rl_stage_config

    data = materialize(ArithmeticData(generator="arithmetic_calculator", n=20, role="train", ops=["*"],
                                      min_operand=10, max_operand=99), Path("."), home / "data")
    config = rl_stage_config(kind="rl", algorithm="grpo", policy="base", data="train",
                           rewards=["correct", "environment"], prompts_per_step=2, max_steps=2, backend="hf",
                           sampling={"attempts": 2, "max_tokens": 6},
                           environment={"fn": "calculator", "max_turns": 2, "max_episode_tokens": 12})
    rewards = {"correct": RewardSpec(fn="exact_answer"), "environment": RewardSpec(fn="environment", weight=0.5)}
    ctx = ctx_factory("grpo-agent")
    outputs = rl.run(config, StageInputs(policy=tiny_checkpoint, datasets={"data": data}, rewards=rewards), ctx)
    assert outputs["metrics"]["steps"] == 2.0
    assert Path(outputs["checkpoint"]).is_dir()
    # the environment's own score was a reward of every step (scored on the episodes TRL handed the reward)
    history = ctx.metric_history("reward/environment/unparsed_frac")  # flushes the buffered metrics first
    assert len(history) == 2


def test_ppo_trains_in_the_environment_on_its_own_score(tiny_checkpoint, ctx_factory, home):
    from stages import rl
    from stages.rl_common import rl_stage_config

    data = materialize(ArithmeticData(generator="arithmetic_calculator", n=20, role="train", ops=["*"],
                                      min_operand=10, max_operand=99), Path("."), home / "data")
    config = rl_stage_config(kind="rl", algorithm="ppo", policy="base", data="train", rewards=["environment", "correct"],
                           prompts_per_step=2, max_steps=2, backend="hf", minibatch_size=2, ppo_epochs=1,
                           sampling={"attempts": 2, "max_tokens": 6},
                           environment={"fn": "calculator", "max_turns": 2, "max_episode_tokens": 12})
    rewards = {"environment": RewardSpec(fn="environment"), "correct": RewardSpec(fn="exact_answer")}
    outputs = rl.run(config, StageInputs(policy=tiny_checkpoint, datasets={"data": data}, rewards=rewards),
                     ctx_factory("ppo-agent"))
    metrics = outputs["metrics"]
    assert metrics["steps"] == 2.0 and Path(outputs["checkpoint"]).is_dir()
    # 4 episodes a step, each capped at 12 tokens after its prompt: model tokens are at most that
    assert 0 < metrics["completion/mean_tokens"] <= 12 and metrics["env/turns_mean"] >= 1
    assert metrics["reward/environment/mean"] == 0.0 and math.isfinite(metrics["policy_loss"])


def test_calculator_scores_its_own_episodes():
    from stages.rollout.environments import EpisodeCase
    from stages.rollout.episode_checks import check_episode_cases

    spec = EnvironmentSpec(fn="calculator", max_turns=3)
    case = dict(prompt="What is 47*86?", answer="4042")
    cases = [EpisodeCase(case="success", turns=[CALL, "4042"], min=1.0, **case),
             EpisodeCase(case="failure", turns=[CALL, "4043"], max=0.0, **case),                  # miscopied
             EpisodeCase(case="shortcut", turns=["4042"], max=0.0, **case),                       # from memory
             EpisodeCase(case="shortcut", turns=['<tool_call>calculator("2*2000")</tool_call>', "4042"], max=0.0,
                         **case),                                                                   # not read off it
             EpisodeCase(case="malformed", turns=['<tool_call>calculator(</tool_call>', "4042"], max=0.0, **case),
             EpisodeCase(case="failure", turns=[CALL, "it is 4042"], max=0.0, **case)]             # no integer answer
    own = {"environment": RewardSpec(fn="environment")}
    results = check_episode_cases(spec, own, cases)
    assert [r.score for r in results] == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0] and not any(r.violations for r in results)
    # exact_answer pays the answer from memory and the one computed on other numbers alike; the own score does not
    exact = check_episode_cases(spec, {"correct": RewardSpec(fn="exact_answer")}, cases)
    assert [r.score for r in exact] == [1.0, 0.0, 1.0, 1.0, 1.0, 0.0]
    # unparsed (no integer answer) is apart from wrong, and an episode scored without a reference answer is an error
    from stages.rollout.episodes import environment_scorers

    env = build_environment(spec)
    episodes = [r.episode for r in results]
    output = environment_scorers(own, env, episodes)["environment"]([""] * 6, answer=["4042"] * 5 + [None])
    assert output.parsed == [True] * 5 + [False] and [i for i, _ in output.errors] == [5]
    assert "reference answer" in output.errors[0][1]


def test_environment_reward_is_validated(tmp_path):
    from flows.spec.loading import SpecError, load_pipeline

    spec = tmp_path / "agent.yaml"
    spec.write_text("""
name: env-reward
model: {init: tiny}
data:
  train: {generator: arithmetic_calculator, n: 4, min_operand: 10, max_operand: 99, ops: ["*"], role: train}
rewards:
  own: {fn: environment, weight: 2.0}
stages:
  ppo: {kind: rl, algorithm: ppo, policy: base, data: train, rewards: [own, environment], environment: {fn: calculator}}
  no_env: {kind: rl, algorithm: grpo, policy: base, data: train, rewards: [environment]}
  no_score: {kind: rl, algorithm: grpo, policy: base, data: train, rewards: [own], environment: {fn: python}}
""")
    with pytest.raises(SpecError) as caught:
        load_pipeline(spec)
    problems = sorted(issue.render("agent.yaml") for issue in caught.value.issues)
    assert len(problems) == 2, problems
    assert "stages.no_env.rewards.0" in problems[0] and "declares no `environment:`" in problems[0]
    assert "stages.no_score.rewards.0" in problems[1] and "defines no score of its own" in problems[1]
