"""Silent failures named: an RL or online DPO stage that learns nothing says why, while it runs.

Seed 000's advice when every reward is zero: check the verifier, the output parsing and the
token budget first. A stage that samples and scores (``rl``, ``online_dpo``) feeds each
step's logged metrics to a ``SilentFailureWatch``; when one of these holds for
``alerts.after_steps`` steps in a row, the stage is told once, with the likely cause:

- the token budget: ``completion/truncated_frac`` >= ``alerts.truncated_frac`` (checked
  first: a reply cut short is also one the verifier cannot parse);
- the output parsing: a reward's ``reward/<name>/unparsed_frac`` >= ``alerts.unparsed_frac``
  (the model does not write the format the reward reads);
- the verifier: every reward equal to 0 (``reward/mean`` 0 and no group whose rewards differ),
  so there is no signal to learn from.

An alert is the stage run's MLflow tag ``posttrain.alert`` (every alert so far, one per
line), a warning line above the stage's live line, and a line under ``posttrain run``'s
summary. It never stops the stage: the user decides.
"""

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


def _percent(share: float) -> str:
    return f"{100 * share:.0f}%"


class SilentFailureWatch:
    """Per step, the conditions that make a step teach nothing; an alert when one persists."""

    def __init__(self, settings: AlertSettings, max_tokens: int):
        self.settings, self.max_tokens = settings, max_tokens
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
        """This step's metrics; the alerts it raises ("step N: ...", each cause once, when it has held
        ``after_steps`` steps in a row)."""
        found = self.conditions(metrics)
        self.streaks = {cause: self.streaks.get(cause, 0) + 1 for cause in found}
        due = [cause for cause in found if self.streaks[cause] >= self.settings.after_steps and cause not in self.raised]
        self.raised += due
        new = [f"step {step}: {found[cause]}" for cause in due]
        self.messages += new
        return new

    def state(self) -> dict:
        """What a resumed stage needs to keep watching where it stopped (stages/training/resume.py)."""
        return {"streaks": self.streaks, "raised": self.raised, "messages": self.messages}

    def restore(self, saved: dict) -> None:
        self.streaks, self.raised, self.messages = dict(saved["streaks"]), list(saved["raised"]), list(saved["messages"])

    def report(self, ctx, step: int, metrics: dict[str, float]) -> None:
        """``observe``, and tell ``ctx`` of new alerts: the run's ``posttrain.alert`` tag holds every alert so
        far, one per line (the orchestrator shows it on the stage's line and in the summary)."""
        new = self.observe(metrics, step)
        if new:
            ctx.set_tags({ALERT_TAG: "\n".join(self.messages)})
            print(*(f"posttrain alert: {message}" for message in new), sep="\n", flush=True)  # the stage's log
