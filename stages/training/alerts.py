"""Silent failures named: an RL or online DPO stage that learns nothing says why, while it runs (docs/algorithms.md)."""

from __future__ import annotations

from pydantic import ConfigDict, Field

from stages.context import ALERT_TAG
from stages.spec_model import SpecModel


class AlertSettings(SpecModel):
    """When a sampling stage says it is learning nothing (``posttrain.alert``); never part of the fingerprint."""

    model_config = ConfigDict(extra="forbid")

    after_steps: int = Field(5, ge=1, le=100000, description="Steps in a row a condition must hold before the "
                             "stage alerts (each cause once).")
    unparsed_frac: float = Field(0.9, gt=0.0, le=1.0, description="Alert when a reward could not parse at least "
                                 "this share of the completions (the model does not write the format it reads).")
    truncated_frac: float = Field(0.9, gt=0.0, le=1.0, description="Alert when at least this share of the "
                                  "completions hit the token budget (`sampling.max_tokens`).")
    hacking_window: int = Field(5, ge=1, le=100000, description="Steps averaged into one window by the reward "
                                "hacking watch (a learned reward trained on beside a verifiable check of the same "
                                "samples).")
    hacking_windows: int = Field(2, ge=1, le=1000, description="Alert of reward hacking when the learned reward's "
                                 "window mean rose while the check's fell this many windows in a row (the alert "
                                 "comes at step hacking_window x (hacking_windows + 1) at the earliest).")


def _percent(share: float) -> str:
    return f"{100 * share:.0f}%"


LEARNED_FNS = ("reward_model", "judge")  # reward fns that score with a model, not a check


def hacking_pairs(rewards: dict[str, tuple[str, float]]) -> list[tuple[str, str]]:
    """(learned, check) pairs to watch: every learned reward with weight not 0, with every verifiable one."""
    learned = [name for name, (fn, weight) in rewards.items() if fn in LEARNED_FNS and weight != 0]
    checks = [name for name, (fn, _) in rewards.items() if fn not in LEARNED_FNS]
    return [(a, b) for a in learned for b in checks]


class RewardHackingWatch:
    """Window means of each learned reward and its check: did the learned one rise as the check fell, in a row?"""

    def __init__(self, settings: AlertSettings, pairs: list[tuple[str, str]]):
        self.settings, self.pairs = settings, pairs
        self.current: dict[str, list[float]] = {}  # reward -> this window's step means so far
        self.windows: dict[str, list[float]] = {}  # reward -> each finished window's mean
        self.streaks: dict[str, int] = {}  # "learned|check" -> windows in a row the learned rose, the check fell

    def observe(self, metrics: dict[str, float]) -> dict[str, str]:
        """cause -> message for every pair whose streak reached ``hacking_windows`` at this step."""
        learned = {name for name, _ in self.pairs}
        names = sorted(learned | {check for _, check in self.pairs})
        for name in names:  # the learned side: what a process reward pays under PPO's step credit, else its mean
            value = metrics.get(f"reward/{name}/mean")
            if name in learned:
                value = metrics.get(f"reward/{name}/credited", value)
            if value is not None:
                self.current.setdefault(name, []).append(value)
        if not names or len(self.current.get(names[0], [])) < self.settings.hacking_window:
            return {}
        for name in names:
            values = self.current.pop(name, [])
            if values:
                self.windows.setdefault(name, []).append(sum(values) / len(values))
        found, n = {}, self.settings.hacking_windows
        for learned, check in self.pairs:
            a, b = self.windows.get(learned, []), self.windows.get(check, [])
            if len(a) < 2 or len(b) < 2:
                continue
            key = f"{learned}|{check}"
            self.streaks[key] = self.streaks.get(key, 0) + 1 if a[-1] > a[-2] and b[-1] < b[-2] else 0
            if self.streaks[key] >= n:
                found[f"hacking:{key}"] = (
                    f"reward hacking? the learned reward {learned!r} rose ({a[-n - 1]:.3f} -> {a[-1]:.3f}) while the "
                    f"check {check!r} fell ({b[-n - 1]:.3f} -> {b[-1]:.3f}), {n} windows of "
                    f"{self.settings.hacking_window} steps in a row: the policy is paid for something the check does "
                    "not reward. Look at the samples/ tables for what the learned reward pays (length, more steps, a "
                    "phrase); with a process reward try step_credit min; retrain or constrain the learned reward, or "
                    "raise kl_beta")
        return found

    def state(self) -> dict:
        return {"current": self.current, "windows": self.windows, "streaks": self.streaks}

    def restore(self, saved: dict) -> None:
        self.current = {k: list(v) for k, v in saved.get("current", {}).items()}
        self.windows = {k: list(v) for k, v in saved.get("windows", {}).items()}
        self.streaks = dict(saved.get("streaks", {}))


class SilentFailureWatch:
    """Each step's conditions that teach nothing, and reward hacking (``hacking_pairs``); an alert when one persists."""

    def __init__(self, settings: AlertSettings, max_tokens: int, hacking: list[tuple[str, str]] = ()):
        self.settings, self.max_tokens = settings, max_tokens
        self.hacking = RewardHackingWatch(settings, list(hacking))
        self.streaks: dict[str, int] = {}
        self.raised: list[str] = []  # causes already reported
        self.messages: list[str] = []

    def conditions(self, metrics: dict[str, float]) -> dict[str, str]:
        """cause -> message for every condition this step's metrics meet, most likely cause first."""
        s, found = self.settings, {}
        truncated = metrics.get("completion/truncated_frac")
        if truncated is not None and truncated >= s.truncated_frac:
            found["token_budget"] = (
                f"{_percent(truncated)} of completions hit the token budget (sampling.max_tokens {self.max_tokens}) "
                f"for {s.after_steps} steps in a row: raise max_tokens, or check that the model ends its replies")
        for key, value in sorted(metrics.items()):
            if key.startswith("reward/") and key.endswith("/unparsed_frac") and value >= s.unparsed_frac:
                name = key[len("reward/"):-len("/unparsed_frac")]
                found[f"parsing:{name}"] = (
                    f"reward {name!r} could not parse {_percent(value)} of completions for {s.after_steps} steps in "
                    "a row: the model does not write the format it reads; look at the samples/ tables, check the "
                    "reward's output parsing, state the format in the prompt, and add a format reward beside it (it "
                    "pays only once some replies match: ask for a format the samples show the model writing)")
        no_signal = metrics.get("reward/zero_variance_group_frac", metrics.get("pairs/tie_frac"))
        if metrics.get("reward/mean") == 0.0 and no_signal == 1.0:
            found["zero_reward"] = (
                f"every reward was 0 for {s.after_steps} steps in a row, so no completion was better than another: "
                "check the verifier on known successes (`posttrain check-reward`), the output parsing and the "
                "token budget")
        return found

    def observe(self, metrics: dict[str, float], step: int) -> list[str]:
        """This step's new alerts ("step N: ...", each cause once, after ``after_steps`` steps in a row)."""
        found = self.conditions(metrics)
        self.streaks = {cause: self.streaks.get(cause, 0) + 1 for cause in found}
        due = [cause for cause in found if self.streaks[cause] >= self.settings.after_steps and cause not in self.raised]
        hacking = {cause: message for cause, message in self.hacking.observe(metrics).items() if cause not in self.raised}
        found.update(hacking)
        due += list(hacking)
        self.raised += due
        new = [f"step {step}: {found[cause]}" for cause in due]
        self.messages += new
        return new

    def state(self) -> dict:
        return {"streaks": self.streaks, "raised": self.raised, "messages": self.messages,
                "hacking": self.hacking.state()}

    def restore(self, saved: dict) -> None:
        self.streaks, self.raised, self.messages = dict(saved["streaks"]), list(saved["raised"]), list(saved["messages"])
        self.hacking.restore(saved.get("hacking", {}))

    def report(self, ctx, step: int, metrics: dict[str, float]) -> None:
        """``observe``, and tell ``ctx`` of new alerts (the ``posttrain.alert`` tag: every alert so far)."""
        new = self.observe(metrics, step)
        if new:
            ctx.set_tags({ALERT_TAG: "\n".join(self.messages)})
            print(*(f"posttrain alert: {message}" for message in new), sep="\n", flush=True)  # the stage's log
