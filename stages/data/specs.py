"""The dataset declarations of a pipeline (`data:`): one pydantic model per source, and DataError. Apart from
``sources`` so that it and the generators it calls (``preferences``, ``reasoning_gym``) all import them."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import (
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)

from stages.spec_model import HUB_ID_PATTERN, HubRevision, SpecModel, applies_when

Role = Literal["train", "probe", "heldout"]
ROLE_HELP = (
    "What the dataset is for: 'train' feeds training stages, 'probe' is evaluated to collect "
    "failure cases, 'heldout' is only ever evaluated (the validator refuses it in training)."
)


def _operand_range_rule(spec: ArithmeticData | ArithmeticPreferenceData) -> None:
    """What both arithmetic generators refuse: an empty operand range."""
    if spec.min_operand > spec.max_operand:
        raise ValueError(f"min_operand ({spec.min_operand}) must be <= max_operand ({spec.max_operand})")


class ArithmeticData(SpecModel):
    """Generated arithmetic questions: 'What is a+b?' with the exact answer."""

    model_config = ConfigDict(extra="forbid")

    generator: Literal["arithmetic", "arithmetic_calculator", "arithmetic_chain"] = Field(
        description="Built-in generator of arithmetic questions: `arithmetic` demonstrates the answer alone; "
        "`arithmetic_calculator` demonstrates an agent's episode: a call of the `calculator` environment's tool, "
        "its result, then the answer (demo_error_rate then miscopies the result); `arithmetic_chain` asks for a "
        "chain of `terms` numbers computed step by step and demonstrates running results (\"12+5=17, 17+8=25\"), "
        "which the chain_steps process reward checks step by step (demo_error_rate then writes one step wrong: "
        "half the time the next step carries on from the right value, so the final answer is still right).")
    role: Role = Field(description=ROLE_HELP)
    n: int = Field(ge=1, le=1_000_000, description="Number of examples.")
    seed: int = Field(0, description="Seed of the generator; different seeds draw different samples.")
    min_operand: int = Field(0, ge=0, description="Smallest operand.")
    max_operand: int = Field(9, ge=0, le=10**9, description="Largest operand.")
    ops: list[Literal["+", "-", "*"]] = Field(["+"], min_length=1, description="Operators to draw from.")
    demo_error_rate: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="Share of demonstrations whose assistant answer is wrong (an imperfect "
        "demonstrator); the reference `answer` stays correct.",
    )
    terms: int = Field(3, ge=2, le=12, json_schema_extra=applies_when(
        {"generator": "arithmetic_chain"}, why="the other generators write one operation"), description="Numbers in each chain.")

    @model_validator(mode="after")
    def _operand_range(self):
        _operand_range_rule(self)
        return self


class FileData(SpecModel):
    """Local JSONL or parquet file with `messages` (chat turns) or `prompt` + `completion`/`answer`."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(description="JSONL or parquet file; relative paths are relative to the pipeline file.")
    role: Role = Field(description=ROLE_HELP)
    format: Literal["auto", "jsonl", "parquet"] = Field("auto", description="File format; auto uses the suffix.")
    limit: int | None = Field(None, ge=1, description="Use only the first `limit` records.")
    records: Literal["conversations", "preferences", "steps"] = Field(
        "conversations",
        description="What each record is: `conversations` (messages, or prompt + completion), `preferences` "
        "(prompt / chosen / rejected pairs, plain strings or chat messages) for reward_model and dpo stages, or "
        "`steps` (PRM800K's shape: `prompt`, the solution's `steps` as strings and their `ratings`, +1 right, 0 "
        "neutral, -1 wrong) for a reward_model stage at level step, which reads +1 as right and the rest as not.",
    )


class ArithmeticPreferenceData(SpecModel):
    """Generated preference pairs for the arithmetic world, labelled by the exact-answer verifier:
    a correct answer is preferred to a wrong one (a near miss, a far miss or a malformed reply)."""

    model_config = ConfigDict(extra="forbid")

    generator: Literal["arithmetic_preferences"] = Field(description="Built-in generator of preference pairs.")
    role: Role = Field(description=ROLE_HELP)
    n: int = Field(ge=1, le=1_000_000, description="Number of pairs.")
    seed: int = Field(0, description="Seed of the generator; different seeds draw different samples.")
    min_operand: int = Field(0, ge=0, description="Smallest operand.")
    max_operand: int = Field(9, ge=0, le=10**9, description="Largest operand.")
    ops: list[Literal["+", "-", "*"]] = Field(["+"], min_length=1, description="Operators to draw from.")
    near_miss_rate: float = Field(
        0.6, ge=0.0, le=1.0, description="Share of rejected answers that are off by 1 or 2 (the errors an "
        "imperfect policy makes)."
    )
    malformed_rate: float = Field(
        0.2, ge=0.0, le=1.0, description="Share of rejected replies that are not a bare number at all "
        "(the rest are numbers far from the answer)."
    )

    @model_validator(mode="after")
    def _rates_and_range(self):
        _operand_range_rule(self)
        if self.near_miss_rate + self.malformed_rate > 1.0:
            raise ValueError(f"near_miss_rate ({self.near_miss_rate}) + malformed_rate ({self.malformed_rate}) "
                             "must be <= 1")
        return self


AnswerFormat = Literal["answer_tags", "boxed", "whole"]


class ReasoningGymData(SpecModel):
    """A reasoning-gym task (https://github.com/open-thought/reasoning-gym), generated by the package itself;
    needs the optional extra `pip install reasoning-gym`."""

    model_config = ConfigDict(extra="forbid")

    reasoning_gym: str = Field(description="reasoning-gym task name, one of `reasoning_gym.factory.DATASETS` "
                               "(e.g. chain_sum, basic_arithmetic, leg_counting).")
    role: Role = Field(description=ROLE_HELP)
    n: int = Field(ge=1, le=1_000_000, description="Number of entries (reasoning-gym's `size`).")
    seed: int = Field(0, description="reasoning-gym's seed; entry i is drawn from seed + i, so datasets of one task "
                      "and config overlap unless their [seed, seed + n) ranges are disjoint.")
    config: dict[str, Any] = Field(default_factory=dict, description="The task's own configuration (keys of its "
                                   "reasoning-gym config class, e.g. min_terms / max_terms for chain_sum).")
    answer_format: AnswerFormat = Field(
        "answer_tags", description="How the model gives its answer, and how the reasoning_gym reward extracts it: "
        "`answer_tags` (<answer>...</answer>, reasoning-gym's convention), `boxed` (the last \\boxed{...}) or "
        "`whole` (the whole stripped reply).")
    instruction: str | None = Field(None, description="Appended to the question in the user turn; default a short "
                                    "instruction for `answer_format`; an empty string appends nothing.")
    system_prompt: str | None = Field(None, description="System message put before the question (none by default).")
    demo_error_rate: float = Field(
        0.0, ge=0.0, le=1.0, description="Share of demonstrations whose assistant answer is wrong (an imperfect "
        "demonstrator: a numeric answer off by 1 or 10, a slip in one digit; another entry's answer otherwise); the "
        "reference `answer` and the task the reward regenerates stay correct.")
    exclude: list[str] = Field(
        default_factory=list, description="Datasets (names under `data:`) whose prompts this one must not contain: "
        "entries whose normalised prompt text appears there are dropped, so the dataset may hold fewer than `n` "
        "(a train set that excludes the heldout set never shows the model a heldout question).")

    @field_validator("config")
    @classmethod
    def _seed_and_size_are_fields(cls, config: dict[str, Any]):
        misplaced = [key for key in ("seed", "size") if key in config]
        if misplaced:
            raise ValueError(f"config may not set {' or '.join(misplaced)}: they are the dataset's own `seed:` "
                             "and `n:`")
        return config


CANONICAL_COLUMNS = ("prompt", "completion", "answer", "messages", "system", "chosen", "rejected")


class HubData(SpecModel):
    """A Hugging Face dataset: `hub: ID` through `datasets`, read from the local Hugging Face cache and
    fetched from the hub only where it answers (stages/data/hub.py), or `folder: DIR`, a `save_to_disk`
    folder or a dataset repository's folder of parquet / JSONL / CSV files."""

    model_config = ConfigDict(extra="forbid")

    hub: str | None = Field(None, pattern=HUB_ID_PATTERN, max_length=96, description="Dataset id on the Hugging Face hub, e.g. `openai/gsm8k`.")
    folder: str | None = Field(None, description="Instead of `hub`: a local dataset folder (relative paths are "
                               "relative to the pipeline file); its files' content is its identity.")
    config: str | None = Field(None, description="The dataset's configuration (subset), e.g. `main` for GSM8K.")
    split: str = Field("train", description="The split to read.")
    revision: HubRevision | None = Field(None, json_schema_extra=applies_when(
        {"hub": {"set": True}}, why="a folder is identified by its files' content"), description="A commit, branch or tag; default the cached `main`. "
                                 "The resolved commit is part of the cache fingerprint and of the run's dataset "
                                 "record, so a new revision reruns what depends on it.")
    role: Role = Field(description=ROLE_HELP)
    n: int | None = Field(None, ge=1, le=1_000_000, description="Read only the first N records (streamed: a large "
                          "dataset is not read past them); default all.")
    columns: dict[str, str] = Field(
        default_factory=dict, description="Posttrain's record fields from the dataset's columns, e.g. "
        "{prompt: question, completion: answer, answer: answer} (GSM8K): `prompt`, `completion`, `answer`, "
        "`messages` (a chat column), `system`; for preferences `prompt`, `chosen`, `rejected`. A field not "
        "mapped is read from the column of its own name when there is one.")
    answer_from: Literal["gsm8k", "boxed"] | None = Field(
        None, description="How the reference `answer` is extracted from its column: `gsm8k` takes what follows "
        "`####` (commas dropped), `boxed` the content of the last \\boxed{}; default the column as it is.")
    records: Literal["conversations", "preferences"] = Field(
        "conversations", description="`conversations` (prompt + completion, or messages) or `preferences` "
        "(prompt / chosen / rejected as strings or message lists, UltraFeedback's shape; HH-RLHF's "
        "\\n\\nHuman: / \\n\\nAssistant: transcripts are split into the shared prompt and the two replies).")

    @model_validator(mode="after")
    def _one_source(self):
        if (self.hub is None) == (self.folder is None):
            raise ValueError("a Hugging Face dataset needs exactly one of `hub: ID` and `folder: DIR`")
        unknown = sorted(set(self.columns) - set(CANONICAL_COLUMNS))
        if unknown:
            raise ValueError(f"columns: {', '.join(unknown)} are not record fields; the fields are "
                             f"{', '.join(CANONICAL_COLUMNS)}")
        return self


class MixtureData(SpecModel):
    """A weighted mixture of other datasets: each of its `n` records is drawn from component c with
    probability weight_c / (sum of weights), then taken from that component's own shuffled order (a
    component drawn more often than it has records is reshuffled and drawn again)."""

    model_config = ConfigDict(extra="forbid")

    mixture: dict[str, float] = Field(
        min_length=1, description="Component datasets (names under `data:`, not mixtures themselves) and their "
        "sampling weights, e.g. {arith: 0.7, chat: 0.3}; weights are normalised to probabilities.")
    role: Role = Field(description=ROLE_HELP + " A train or probe mixture takes no heldout component; a heldout "
                       "mixture takes only heldout ones.")
    n: int = Field(ge=1, le=1_000_000, description="Number of records drawn.")
    seed: int = Field(0, description="Seed of the draw; the same seed and components draw the same records.")

    @field_validator("mixture")
    @classmethod
    def _positive_weights(cls, mixture: dict[str, float]):
        bad = {name: weight for name, weight in mixture.items() if not weight > 0 or weight == float("inf")}
        if bad:
            raise ValueError(f"weights must be positive and finite; got {bad}")
        return mixture

    def probabilities(self) -> dict[str, float]:
        total = sum(self.mixture.values())
        return {name: weight / total for name, weight in self.mixture.items()}


def _data_source(value) -> str | None:
    if isinstance(value, ArithmeticData):
        return "generator"
    if isinstance(value, ArithmeticPreferenceData):
        return "preference_generator"
    if isinstance(value, FileData):
        return "path"
    if isinstance(value, ReasoningGymData):
        return "reasoning_gym"
    if isinstance(value, MixtureData):
        return "mixture"
    if isinstance(value, HubData):
        return "hub"
    if isinstance(value, dict):
        if value.get("generator") == "arithmetic_preferences":
            return "preference_generator"
        for key in ("generator", "path", "reasoning_gym", "mixture"):
            if key in value:
                return key
        if "hub" in value or "folder" in value:
            return "hub"
    return None


DataSpec = Annotated[
    Union[
        Annotated[ArithmeticData, Tag("generator")],
        Annotated[ArithmeticPreferenceData, Tag("preference_generator")],
        Annotated[FileData, Tag("path")],
        Annotated[ReasoningGymData, Tag("reasoning_gym")],
        Annotated[MixtureData, Tag("mixture")],
        Annotated[HubData, Tag("hub")],
    ],
    Discriminator(
        _data_source,
        custom_error_type="data_source",
        custom_error_message="a dataset needs a source: `generator: arithmetic`, "
        "`generator: arithmetic_preferences`, `path: FILE`, `reasoning_gym: TASK`, `hub: ID`, `folder: DIR` or `mixture: {NAME: WEIGHT, ...}`",
    ),
]


def holds_preferences(spec, datasets: dict | None = None) -> bool:
    """Whether a dataset is preference pairs (for reward_model / dpo) rather than conversations; a
    mixture is what its components are (``datasets``: every declared dataset by name)."""
    if isinstance(spec, MixtureData):
        components = [(datasets or {}).get(name) for name in spec.mixture]
        return any(c is not None and not isinstance(c, MixtureData) and holds_preferences(c) for c in components)
    return isinstance(spec, ArithmeticPreferenceData) or (isinstance(spec, (FileData, HubData))
                                                          and spec.records == "preferences")


class DataError(ValueError):
    """A dataset file that cannot be read, with the file and line it went wrong at."""
