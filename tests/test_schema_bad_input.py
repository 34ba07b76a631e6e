"""Bad input drawn from the pipeline's own JSON Schema: every field of every stage kind and block refuses it.

``posttrain schema`` (flows/spec/reference.py) says what each field takes: its JSON types, bounds, enums,
patterns, lengths and item types. This test walks that schema and, for **every** field of every model in it
(the pipeline's own keys, every stage kind's config, and every block: generation, correction, lm_eval, the data
sources, rewards and their kwargs, engine, sampling, lora, placement, resources, alerts, environments, models,
iterate ...), draws values the schema refuses, with Hypothesis, one kind at a time:

- a wrong JSON type (one pydantic's lax mode would not turn into the right one: no ``"3"`` for an integer);
- a number outside the schema's minimum / maximum (exclusive bounds included), or outside SpecModel's finite
  range where the schema sets none; NaN and ±infinity;
- an unknown key in every object, and a wrong value inside a free-form mapping;
- an empty list where ``minItems`` >= 1 (an empty mapping where ``minProperties`` >= 1), a wrong or empty item;
- a string off its enum or pattern, or past its ``maxLength``.

Each value goes into one field of a pipeline that validates (a shipped one holding that block, else the two
built here), and ``posttrain validate`` must refuse it (exit 2) with an error at that field's YAML path and at no
other (an error elsewhere is a later check reading the field that failed), no traceback, and nothing written:
neither beside the file nor in POSTTRAIN_HOME nor in the Hugging Face cache. In-process it is ``load_pipeline``
(what the command runs: a SpecError is exit 2, any other exception a crash); a few bad fields go through the
real ``posttrain validate`` in a process of its own. Fields are enumerated from the schema (each model in every
place a base uses it), so every field is covered every run, not by chance; Hypothesis draws the values,
``EXAMPLES`` per kind of bad value and field, each field seeded with its own name (the same values every run,
different ones per field). The test asserts how many fields and values it covered and prints both.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import subprocess
import sys
import time
import traceback
import zlib
from collections import Counter
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from conftest import ROOT
from test_fuzz_input import ISSUE_LINE, YAML_PATH, environment
from test_hub_data import PIPELINE as HUB_PIPELINE
from test_hub_data import gsm8k_cache, hf_cache  # noqa: F401 (a fixture)
from test_model_sources import make_hub_cache

EXAMPLES = int(os.environ.get("POSTTRAIN_SCHEMA_EXAMPLES", "1"))  # per field and kind of bad value (CI: 1)
SKIPPED_PIPELINES = {"gsm8k": "it reads its model and dataset from the hub, offline here; its blocks (hub data and "
                              "model, benchmark, lm_eval, resources) are covered by the `hub` base built in this "
                              "file over a Hugging Face cache it lays out"}
HUB_MODEL = "posttrain-tests/tiny-chat"
# Blocks no shipped pipeline (that validates offline) holds: a GRPO stage with every optional block, KTO, data
# from a file, a model from a path; the hub's dataset and model, a benchmark stage and resources over a cache.
EXTRAS = """\
name: extras
model: {path: CHECKPOINT}
sweep: {seeds: [0, 1], grid: {stages.sft.max_steps: [2, 3]}}
data:
  train: {path: d.jsonl, role: train}
  prefs: {generator: arithmetic_preferences, n: 20, role: train}
rewards:
  correct: {fn: exact_answer}
stages:
  sft: {kind: sft, data: train, max_steps: 2}
  grpo: {kind: rl, algorithm: grpo, policy: sft, data: train, rewards: [correct], kl_beta: 0.1,
         alerts: {after_steps: 5}, placement: {reference: cpu}, difficulty_filter: {sampling: {attempts: 2}},
         generation: {mode: colocated}}
  grpo_vllm: {kind: rl, algorithm: grpo, policy: sft, data: train, rewards: [correct], backend: vllm,
              correction: {kind: token_tis}, resources: {pool: gpu}}
  kto: {kind: kto, model: sft, data: prefs, placement: {reference: cpu}}
"""
HUB = HUB_PIPELINE.replace("model: {init: tiny, hidden_size: 32, num_layers: 1, num_heads: 2, intermediate_size: 64}",
                           f"model: {{hub: {HUB_MODEL}}}\nresources: {{pool: gpu, gpus: 1}}") + \
    "  bench: {kind: benchmark, model: sft, lm_eval: {tasks: [gsm8k], limit: 5}}\n"
DATA_FILE = "".join(f'{{"prompt": "What is {a}+{b}?", "completion": "{a + b}", "answer": "{a + b}"}}\n'
                    for a, b in [(1, 1), (2, 3), (4, 4), (7, 1)])

MAX_INT = 2**31 - 1  # stages/spec_model.py: numbers within ±MAX_INT / ±MAX_FLOAT where a field sets no bound
MAX_FLOAT = 1e9
LAX_BOOLEANS = {"0", "1", "true", "false", "yes", "no", "on", "off", "t", "f", "y", "n"}  # pydantic's lax bool
DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
# A mapping of named entries replaced by one with other names (`data: {k: ...}`): the stages naming the old entries
# are rightly refused too. Every other bad value is refused at its field alone: an error elsewhere is a later check
# reading the field that failed (as its default, or as declaring nothing).
ENTRIES_REPLACED = {"entry", "entry_nonfinite", "empty"}


# ---------------------------------------------------------------- the schema: its models and where each one lives


def schema() -> dict:
    from flows.spec.reference import pipeline_schema

    return pipeline_schema()  # what `posttrain schema` prints (docs/pipeline.schema.json, kept current elsewhere)


def _ref(node: dict) -> str | None:
    return node["$ref"].rsplit("/", 1)[-1] if "$ref" in node else None


def _holds(model: dict, doc) -> bool:
    """Whether a loaded YAML mapping is an instance of the schema's ``model`` (keys, required keys, constants)."""
    if not isinstance(doc, dict):
        return False
    props = model.get("properties", {})
    if any(key not in props for key in doc) or any(key not in doc for key in model.get("required", [])):
        return False
    for key, value in doc.items():
        fixed = props[key].get("enum", [props[key]["const"]] if "const" in props[key] else None)
        if fixed is not None and len(fixed) == 1 and fixed[0] != value:
            return False
    return True


def locate_models(doc: dict, top: dict, found: dict, path=(), node=None, within="") -> None:
    """The YAML path of the first instance of each schema model (``$defs`` entry) in ``doc`` in each place it
    is used (``within``: the model and field holding it, e.g. sampling in an eval stage and in a judge reward), into
    ``found`` keyed by (model, within)."""
    defs = top["$defs"]
    if node is None:
        for key, value in doc.items():
            if key in top["properties"]:
                locate_models(value, top, found, (key,), top["properties"][key], f"Pipeline.{key}")
        return
    if (name := _ref(node)) is not None:
        if _holds(defs[name], doc):
            found.setdefault((name, within), path)
            for key, value in doc.items():
                locate_models(value, top, found, path + (key,), defs[name]["properties"][key], f"{name}.{key}")
        return
    for key in ("anyOf", "oneOf"):
        for member in node.get(key, []):
            locate_models(doc, top, found, path, member, within)
    if isinstance(doc, dict) and isinstance(node.get("additionalProperties"), dict):
        for key, value in doc.items():
            locate_models(value, top, found, path + (key,), node["additionalProperties"], within)
    if isinstance(doc, list) and isinstance(node.get("items"), dict):
        for i, value in enumerate(doc):
            locate_models(value, top, found, path + (i,), node["items"], within)


# ---------------------------------------------------------------- bad values from a field's schema


def _members(node: dict, defs: dict) -> list[dict]:
    """A field's alternatives (anyOf / oneOf flattened), a model reference kept as itself."""
    for key in ("anyOf", "oneOf"):
        if key in node:
            return [m for member in node[key] for m in _members(member, defs)]
    return [node]


def _types(member: dict) -> set[str]:
    if "$ref" in member:
        return {"object"}
    if "const" in member or "enum" in member:
        values = member.get("enum", [member.get("const")])
        return {{str: "string", bool: "boolean", int: "integer", float: "number", type(None): "null"}[type(v)]
                for v in values}
    kind = member.get("type")
    if kind is None:
        return {"string", "integer", "number", "boolean", "array", "object", "null"}  # anything
    kinds = set(kind) if isinstance(kind, list) else {kind}
    return kinds | ({"integer"} if "number" in kinds else set())


def _not_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return text.strip().lower() not in LAX_BOOLEANS
    return False


words = st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=0x2FF, blacklist_categories=("Cs",)),
                min_size=1, max_size=30).filter(_not_number)
WRONG_TYPE = {  # a value of each JSON type that pydantic's lax mode turns into no other type
    "string": words,
    "integer": st.integers(-10**6, 10**6).filter(lambda n: n not in (0, 1)),
    "number": st.floats(-1e6, 1e6, allow_nan=False).filter(lambda x: not x.is_integer()),
    "boolean": st.booleans(),
    "array": st.lists(st.integers(2, 9), max_size=3),
    "object": st.dictionaries(st.sampled_from(["a", "xyz"]), st.integers(2, 9), min_size=1, max_size=2),
    "null": st.none(),
}


def _key_not_in(props) -> st.SearchStrategy:
    return st.from_regex(r"[a-z][a-z_]{2,14}", fullmatch=True).filter(lambda k: k not in props)


def bad_values(node: dict, defs: dict) -> list[tuple[str, st.SearchStrategy, tuple]]:
    """(kind of bad value, its strategy, the path below the field where the error may be named) for one field."""
    members = _members(node, defs)
    accepted = set().union(*(_types(m) for m in members))
    found = [(f"type:{kind}", strategy, ()) for kind, strategy in WRONG_TYPE.items() if kind not in accepted]
    numeric = [m for m in members if m.get("type") in ("integer", "number")]
    for m in numeric:
        whole = m["type"] == "integer"
        low = m.get("minimum", m.get("exclusiveMinimum"))
        high = m.get("maximum", m.get("exclusiveMaximum"))
        if low is not None:
            below = (st.integers(int(math.ceil(low)) - 10**6, int(math.ceil(low)) - 1) if whole
                     else st.floats(low - 1e6, low, allow_nan=False, exclude_max=True))
            found.append(("range:below", below | st.just(low) if "exclusiveMinimum" in m else below, ()))
        else:
            found.append(("range:below", st.integers(-(2**70), -(2**32)) if whole else st.floats(-1e300, -2e9), ()))
        if high is not None:
            above = (st.integers(int(math.floor(high)) + 1, int(math.floor(high)) + 10**6) if whole
                     else st.floats(high, high + 1e6, allow_nan=False, exclude_min=True))
            found.append(("range:above", above | st.just(high) if "exclusiveMaximum" in m else above, ()))
        else:
            found.append(("range:above", st.integers(2**32, 2**70) if whole else st.floats(2e9, 1e300), ()))
    if numeric or accepted & {"number"}:
        found.append(("nonfinite", st.sampled_from([math.nan, math.inf, -math.inf]), ()))
    for m in members:
        if m.get("type") == "string" or "enum" in m:
            if "enum" in m:
                found.append(("enum", words.filter(lambda s, e=m["enum"]: s not in e), ()))
            if "pattern" in m:
                found.append(("pattern", st.text(max_size=80).filter(
                    lambda s, p=m["pattern"]: not re.search(p, s)), ()))
            if "maxLength" in m:
                found.append(("too_long", st.text(alphabet="abc", min_size=m["maxLength"] + 1,
                                                  max_size=m["maxLength"] + 40), ()))
            if m.get("minLength", 0) >= 1:
                found.append(("too_short", st.just(""), ()))
        if m.get("type") == "array":
            if m.get("minItems", 0) >= 1:
                found.append(("empty", st.just([]), ()))
            items = m.get("items")
            if isinstance(items, dict) and items:
                item_types = set().union(*(_types(i) for i in _members(items, defs)))
                wrong = [WRONG_TYPE[k] for k in WRONG_TYPE if k not in item_types]
                if wrong:
                    found.append(("item", st.lists(st.one_of(*wrong), min_size=1, max_size=3), ()))
                if item_types == {"string"}:
                    found.append(("empty_item", st.just([""]), ()))
        if m.get("type") == "object" and "$ref" not in m:
            if m.get("minProperties", 0) >= 1:
                found.append(("empty", st.just({}), ()))
            values = m.get("additionalProperties")
            if isinstance(values, dict) and values:
                value_types = set().union(*(_types(v) for v in _members(values, defs)))
                wrong = [WRONG_TYPE[k] for k in WRONG_TYPE if k not in value_types]
                if wrong:
                    found.append(("entry", st.dictionaries(st.just("k"), st.one_of(*wrong), min_size=1), ("k",)))
            free = values is True or values == {}  # kwargs: any value, but SpecModel's rules hold inside
            if free or (isinstance(values, dict) and values and "number" in value_types):
                found.append(("entry_nonfinite", st.fixed_dictionaries(  # named as `kwargs: k: ...`
                    {"k": st.sampled_from([math.nan, math.inf, -math.inf])}), ()))
    return found


# ---------------------------------------------------------------- the pipelines bad values go into


def base_pipelines(work: Path, checkpoint: Path) -> dict[str, dict]:
    """Every shipped pipeline that validates here, and the two built here, by name (loaded documents)."""
    bases = {}
    for path in sorted((ROOT / "pipelines").glob("*.yaml"), key=lambda p: p.stem == "judge"):  # judge's is slowest
        if path.stem not in SKIPPED_PIPELINES:
            bases[path.stem] = doc = unshared(yaml.safe_load(path.read_text()))
            for spec in doc["data"].values():  # a few examples are enough to validate: generating 4000 is not
                if isinstance(spec.get("n"), int) and "generator" in spec:
                    spec["n"] = min(spec["n"], 40)
    bases["extras"] = yaml.safe_load(EXTRAS.replace("CHECKPOINT", str(checkpoint)))
    bases["hub"] = yaml.safe_load(HUB)
    (work / "d.jsonl").write_text(DATA_FILE)
    return bases


def unshared(doc):
    """The document with each YAML alias a copy of its own (a bad value goes into one field, not every alias)."""
    return json.loads(json.dumps(doc))


def field_cases(top: dict, bases: dict[str, dict]) -> list[tuple[str, str, tuple, str, dict, bool]]:
    """(field id, base pipeline, YAML path of the field's model, field name, its schema, whether the model was met
    in another place first) for every field of every model in the schema, in every place a base uses the model (the
    pipeline's own keys first); a model no base holds fails the test."""
    where: dict[tuple, tuple[str, tuple]] = {}
    for name, doc in bases.items():
        found: dict[tuple, tuple] = {}
        locate_models(doc, top, found)
        for place, path in found.items():
            where.setdefault(place, (name, path))
    missing = sorted(set(top["$defs"]) - {model for model, _ in where})
    assert not missing, f"no base pipeline holds these blocks: add one that does: {missing}"
    cases = [(f"Pipeline.{field}", "quickstart", (), field, node, False) for field, node in top["properties"].items()]
    seen = set()
    for (model, within), (base, path) in sorted(where.items()):
        for field, node in top["$defs"][model]["properties"].items():
            cases.append((f"{model}.{field}" + (f" (in {within})" if model in seen else ""), base, path, field, node,
                          model in seen))
        seen.add(model)
    return cases


def _at(doc, path):
    for part in path:
        doc = doc[part]
    return doc


def dotted(path: tuple) -> str:
    from flows.spec.schema import dotted as spec_dotted

    return spec_dotted(path)


def _issue_paths(err: str) -> list[str]:
    paths = []
    for line in err.splitlines():
        if (match := ISSUE_LINE.match(line)) and (path := YAML_PATH.match(match["rest"])):
            paths.append(path.group(0)[:-2])
    return paths


def _state(root: Path) -> set:
    """What exists under ``root`` (each path with its size and modification time): whatever posttrain writes shows."""
    return {(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


class Validator:
    """``posttrain validate`` in-process on a document, in a work dir beside a POSTTRAIN_HOME that must never be
    made; each outcome the test refuses is kept (all of them are reported at once)."""

    def __init__(self, root: Path):
        self.root, self.work = root, root / "work"
        self.counts: Counter = Counter()
        self.failures: list[str] = []

    def outcome(self, doc: dict) -> tuple[int | None, str, list[str]]:
        """(exit status `validate` gives, or None for a crash; what it prints; the YAML paths its errors name)."""
        from flows.spec.loading import SpecError, load_pipeline

        path = self.work / "case.yaml"
        path.write_text(yaml.dump(doc, Dumper=DUMPER, sort_keys=False, allow_unicode=True))
        before = _state(self.root)
        try:
            load_pipeline(path)  # what `posttrain validate` runs (flows/cli.py), without building its parser each time
            status, text, paths = 0, "valid", []
        except SpecError as error:
            status, text, paths = 2, str(error), [issue.path for issue in error.issues]
        except Exception:  # noqa: BLE001 - a crash is what this test looks for
            return None, traceback.format_exc(), []
        after = _state(self.root)
        if after != before:
            return None, f"posttrain wrote: {sorted(after - before)}\n{text}", paths
        return status, text, paths

    def check(self, case_id: str, doc: dict, path: tuple, kind: str, value, discriminator: bool = False) -> None:
        """One bad value: refused at ``path`` (a discriminator, ``kind:`` or ``algorithm:``, at its entry's path
        with the key named: which model the entry is depends on it)."""
        status, text, paths = self.outcome(doc)
        self.counts["values"] += 1
        self.counts[kind.split(":")[0]] += 1
        want = dotted(path)
        problem = None
        if status is None or "Traceback" in text:
            problem = "crashed"
        elif status == 0:
            problem = "accepted (exit 0)"
        elif status != 2:
            problem = f"exit {status}"
        elif not any(p == want or p.startswith(want + ".") for p in paths) and not (
                discriminator and f"{dotted(path[:-1])}: " in text and f"`{path[-1]}:`" in text):
            problem = f"no error at {want}"
        elif kind not in ENTRIES_REPLACED and (unrelated := [
                p for p in paths if not (p == want or p.startswith(want + ".") or want.startswith(p + "."))]):
            problem = f"errors elsewhere too, a later check reading the failed field: {unrelated}"
        if problem:
            self.failures.append(f"{case_id} [{kind}] = {value!r}: {problem}\n    " +
                                 "\n    ".join(text.strip().splitlines()[-6:]))


@pytest.fixture()
def checked(tmp_path, tiny_checkpoint, hf_cache, monkeypatch):  # noqa: F811 (hf_cache is the imported fixture)
    """The bases, laid out in a work dir with the files they name, a HF cache holding the hub's model and dataset,
    and a validator with POSTTRAIN_HOME (never created) beside them."""
    gsm8k_cache(hf_cache)
    make_hub_cache(hf_cache, HUB_MODEL, tiny_checkpoint)
    work = tmp_path / "work"
    work.mkdir()
    bases = base_pipelines(work, tiny_checkpoint)
    for extra in (ROOT / "pipelines").iterdir():  # what shipped pipelines name beside them
        if extra.suffix != ".yaml":
            (work / extra.name).symlink_to(extra)
    validator = Validator(tmp_path)
    with environment(tmp_path / "home", work):
        yield validator, bases


def test_every_field_of_every_block_refuses_what_its_schema_refuses(checked, record_property):
    """For each field the schema lists (every model, every property), Hypothesis draws values of each kind the
    schema refuses; `validate` must exit 2 with an error at that field's path, no traceback, nothing written.
    An unknown key is tried in every model. All failures are listed together."""
    validator, bases = checked
    for name, doc in bases.items():  # each base validates as it is: a refusal below is the bad value's
        status, text, _ = validator.outcome(copy.deepcopy(doc))
        assert status == 0, f"base {name}: exit {status}\n{text}"
    top = schema()
    cases = field_cases(top, bases)
    started, cpu = time.perf_counter(), time.process_time()
    fields, elsewhere, models = 0, 0, set()

    def draw_each(case_id: str, base: str, path: tuple, node: dict, kinds: list, pick_one: bool = False) -> None:
        @seed(zlib.crc32(case_id.encode()))  # fixed, and its own per field: fields are not all given one value
        @settings(max_examples=EXAMPLES, database=None, deadline=None, suppress_health_check=list(HealthCheck))
        @given(st.data())
        def one(data):
            for kind, strategy, below in [data.draw(st.sampled_from(kinds))] if pick_one else kinds:
                value = data.draw(strategy, label=kind)
                doc = copy.deepcopy(bases[base])
                parent, key = _at(doc, path[:-1]), path[-1]
                parent[key] = value
                validator.check(case_id, doc, path + below, kind, value, discriminator="const" in node)
        one()

    for case_id, base, path, field, node, again in cases:
        kinds = bad_values(node, top["$defs"])
        assert kinds, f"{case_id}: no bad value drawn from its schema {node}"
        if again:  # the model's fields had every kind of bad value in its first place: here one, of any kind
            draw_each(case_id, base, path + (field,), node, kinds, pick_one=True)
            elsewhere += 1
            continue
        draw_each(case_id, base, path + (field,), node, kinds)
        fields += 1
        model = case_id.split(".")[0]
        if model not in models:  # an unknown key in each model, once
            models.add(model)
            props = top["properties"] if model == "Pipeline" else top["$defs"][model]["properties"]
            draw_unknown_key(validator, case_id, bases[base], path, props)

    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    counts = validator.counts
    print(f"\nschema-driven bad input: {fields} fields of {len(models)} models, and {elsewhere} again where a model "
          f"is used in another place; {counts['values']} values ({dict(counts)}), {elapsed:.1f} s ({cpu:.1f} s of CPU)")
    record_property("fields", fields)
    record_property("values", counts["values"])
    assert not validator.failures, f"{len(validator.failures)} bad values not refused cleanly:\n" + \
        "\n".join(validator.failures)
    expected = len(top["properties"]) + sum(len(m.get("properties", {})) for m in top["$defs"].values())
    assert fields == expected > 300 and len(models) == len(top["$defs"]) + 1, (fields, expected, len(models))
    assert elsewhere > 0, "no model met in a second place (sampling in an eval stage and in a judge reward ...)"
    assert counts["values"] >= fields * EXAMPLES and counts["unknown_key"] >= len(models) * EXAMPLES, counts
    for kind in ("type", "range", "nonfinite", "enum", "pattern", "too_long", "empty", "item", "entry"):
        assert counts[kind] > 0, (kind, counts)


def draw_unknown_key(validator: Validator, case_id: str, base_doc: dict, path: tuple, props: dict) -> None:
    model = case_id.split(".")[0]

    @seed(zlib.crc32(model.encode()))
    @settings(max_examples=EXAMPLES, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(_key_not_in(props))
    def one(key):
        doc = copy.deepcopy(base_doc)
        _at(doc, path)[key] = 1
        validator.check(f"{model}.<unknown key>", doc, path + (key,), "unknown_key", key)
    one()


@pytest.mark.parametrize("name", sorted(SKIPPED_PIPELINES))
def test_a_shipped_pipeline_left_out_of_the_bases_says_why(name):
    assert (ROOT / "pipelines" / f"{name}.yaml").is_file(), f"{name} is no longer shipped: drop it from SKIPPED_PIPELINES"
    pytest.skip(f"pipelines/{name}.yaml is no base here: {SKIPPED_PIPELINES[name]}")


# ---------------------------------------------------------------- the real command, in its own process

PROCESS_CASES = [  # (pipeline, its YAML path, bad value, the path every error names)
    ("quickstart.yaml", ("stages", "sft", "lr"), math.nan, "stages.sft.lr"),
    ("quickstart.yaml", ("stages", "grpo", "sampling", "attempts"), "four", "stages.grpo.sampling.attempts"),
    ("quickstart.yaml", ("data",), "train", "data"),
    ("agent-ppo.yaml", ("stages", "ppo", "environment"), {"fn": 7}, "stages.ppo.environment"),
    ("dpo.yaml", ("stages", "dpo", "beta"), -1, "stages.dpo.beta"),
    ("process.yaml", ("stages", "ppo_outcome", "sampling", "max_tokns"), 8, "stages.ppo_outcome.sampling.max_tokns"),
    ("quickstart.yaml", ("stages", "sft", "max_steps"), True, "stages.sft.max_steps"),
    ("judge.yaml", ("rewards", "judge", "model", "gguf", "file"), 7, "rewards.judge.model.gguf"),
]


@pytest.mark.parametrize("pipeline, path, value, named", PROCESS_CASES, ids=[c[3] for c in PROCESS_CASES])
def test_posttrain_validate_in_its_own_process_refuses_a_bad_field(pipeline, path, value, named, tmp_path):
    doc = yaml.safe_load((ROOT / "pipelines" / pipeline).read_text())
    _at(doc, path[:-1])[path[-1]] = value
    work = tmp_path / "work"
    work.mkdir()
    (work / pipeline).write_text(yaml.dump(doc, Dumper=DUMPER, sort_keys=False))
    env = {**os.environ, "POSTTRAIN_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1"}
    env.pop("MLFLOW_TRACKING_URI", None)
    done = subprocess.run([str(Path(sys.executable).parent / "posttrain"), "validate", pipeline], cwd=work, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    named_paths = _issue_paths(done.stderr)  # at the field alone: no later check read the field that failed
    assert named_paths and all(p == named or p.startswith(named + ".") for p in named_paths), done.stderr
    assert sorted(p.name for p in tmp_path.rglob("*")) == [pipeline, "work"]  # no home, nothing beside the file
