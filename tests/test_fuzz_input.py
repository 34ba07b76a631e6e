"""Property-based fuzzing of everything a user hands posttrain: the pipeline file, its data
files, the command line and POSTTRAIN_HOME (hypothesis, seeded and bounded for CI).

Each example takes a valid pipeline (test_spec's, the same with JSONL data files, or one of
pipelines/: quickstart, iterate, rlhf, ppo, dpo) and breaks it in one to
three ways: a value replaced by a hostile one (NaN, 2**64, '', a 300-character name, a list,
a mapping...), a key renamed, dropped or added (non-string keys included), the structure
reshaped, the YAML text itself mutated (alias bombs, recursive aliases, tags, duplicate keys,
tabs, truncation, bad bytes, a BOM, deep nesting, several documents, merge keys, a file past
1 MB), a data file corrupted, a flag added (``--set``, ``--only``, ``--from``, ``--force``) or
the home made unusable. It then runs ``posttrain validate`` (or ``posttrain run``, with the
run itself replaced by a stub: only acceptance is under test) in-process through
``flows.cli.main`` and requires, for every example:

- exit status 2, or a successful validation (0);
- no traceback: no exception escapes, and none is printed;
- on 2, every error line names its file and where in it: a YAML path, a flag, POSTTRAIN_HOME,
  or (for errors of the document as a whole) what is wrong with the document;
- the home untouched, and nothing written beside it.

Seed and budget are fixed (``derandomize=True``, ``MAX_EXAMPLES``); README (Faults) gives the
count and the time it takes.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import os
import re
import tempfile
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import ROOT
from test_spec import VALID

PIPELINES = ROOT / "pipelines"
MAX_EXAMPLES = int(os.environ.get("POSTTRAIN_FUZZ_EXAMPLES", "3000"))  # CI runs the default

GOOD = [{"prompt": f"What is {a}+{b}?", "completion": str(a + b), "answer": str(a + b)} for a, b in
        [(1, 1), (2, 3), (4, 4), (7, 1)]]
HELD = [{"prompt": f"What is {a}+{b}?", "answer": str(a + b)} for a, b in [(5, 6), (9, 2)]]
FILES_PIPELINE = VALID.replace("{generator: arithmetic, n: 20, role: train}", "{path: d.jsonl, role: train}").replace(
    "{generator: arithmetic, n: 10, seed: 9, role: heldout}", "{path: h.jsonl, role: heldout}")
BASES = {"inline": VALID, "files": FILES_PIPELINE,
         **{name: (PIPELINES / f"{name}.yaml").read_text() for name in ("quickstart", "iterate", "rlhf", "ppo", "dpo")}}
BASE_DOCS = {name: yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)) for name, text in BASES.items()}
DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)  # libyaml: the pure-Python dumper took a tenth of the test
BASE_FILES = {"d.jsonl": "".join(json.dumps(r) + "\n" for r in GOOD).encode(),
              "h.jsonl": "".join(json.dumps(r) + "\n" for r in HELD).encode()}

# Values that have broken validation before, or could: types, ranges, names, structure.
HOSTILE_VALUES = [
    None, True, False, 0, -1, 1, 3, 2**31, 2**32, 2**64, -(2**63), 10**30, 0.5, -0.0, 1e-320, 1e308,
    math.nan, math.inf, -math.inf, "", " ", "~", "nan", "inf", "-1e999", "1e999", "0x10", "two", "sft", "base",
    "train", "heldout", "correct", "eval_sft", "x" * 300, "ok!", "ok?", "a/b", "../../etc", "a.b", "é", "\u202e",
    "!!python/object", "[1", "{a: 1}", "*a", "&a", "%", "#x", "@", "sft@2", [], [""], ["sft"], [None], [1, 2],
    [[[]]], {}, {"a": 1}, {"kind": "sft"}, {"init": "tiny"}, {"": ""}, {"seed": 2**40}, b"bytes",
]
NAMES = ["", " ", "x", "seeed", "max_step", "kind", "model", "data", "n", "seed", "weight", "kwargs", "a" * 70,
         "ok!", "ok?", "b@d", "~", "null", "1", "true", "é", "x y", "role"]
DOCUMENT_PROBLEMS = ("YAML syntax error", "YAML tag refused", "YAML value refused", "the file is empty",
                     "the file is larger than", "a pipeline is a mapping", "not utf-8", "nests deeper than",
                     "holds more than", "a YAML alias refers to", "cannot read the file", "not a file")
ISSUE_LINE = re.compile(r"^  (?P<source>\S.*?\.yaml)(?::(?P<line>\d+))?: (?P<rest>.+)$")
_SEGMENT = r'(?:"(?:[^"\\]|\\.)*"|[^\s.:"]+)'
YAML_PATH = re.compile(rf"^{_SEGMENT}(?:\.{_SEGMENT})*: ")  # stages.sft.max_steps: ...
STATS: Counter = Counter()


# ---------------------------------------------------------------- mutations of the parsed document


def paths(node, prefix=()):
    """Every path into a loaded YAML document (mappings and lists), the root excluded."""
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            found.append(prefix + (key,))
            found += paths(value, prefix + (key,))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found.append(prefix + (i,))
            found += paths(value, prefix + (i,))
    return found


def parent_of(doc, path):
    node = doc
    for part in path[:-1]:
        node = node[part]
    return node


values = st.one_of(
    st.sampled_from(HOSTILE_VALUES),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters=".:"), max_size=80),
)
keys = st.one_of(st.sampled_from(NAMES), st.integers(-3, 300), st.none(), st.booleans(),
                 st.text(alphabet="abcxyz_-!?#/ 019", min_size=0, max_size=70))


def mutate_document(draw, doc) -> str:
    """One change to the loaded document; returns what kind (for the statistics)."""
    where = paths(doc)
    kind = draw(st.sampled_from(["value", "value", "value", "rename", "delete", "add", "wrap", "unwrap", "dup"]))
    if not where:
        kind = "add"
    path = draw(st.sampled_from(where)) if where else ()
    parent = parent_of(doc, path) if path else doc
    if kind == "value":
        parent[path[-1]] = draw(values)
    elif kind == "rename" and isinstance(parent, dict):
        value = parent.pop(path[-1])
        parent[draw(keys)] = value
    elif kind == "delete":
        del parent[path[-1]]
    elif kind == "add":
        target = draw(st.sampled_from([n for n in [doc, *[parent_of(doc, p + ("",)) for p in where]]
                                       if isinstance(n, dict)]))
        target[draw(keys)] = draw(values)
    elif kind == "wrap":
        parent[path[-1]] = [parent[path[-1]]]
    elif kind == "unwrap" and isinstance(parent[path[-1]], (dict, list)) and parent[path[-1]]:
        inner = parent[path[-1]]
        parent[path[-1]] = next(iter(inner.values())) if isinstance(inner, dict) else inner[0]
    elif kind == "dup" and isinstance(parent, dict):
        parent[f"{path[-1]}2"] = json.loads(json.dumps(parent[path[-1]], default=str))
    return kind


# ---------------------------------------------------------------- mutations of the YAML text

TEXT_MUTATIONS = {
    "alias_bomb": lambda t, d: t + "b0: &b0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\n" + "".join(
        f"b{i}: &b{i} [{', '.join([f'*b{i - 1}'] * 10)}]\n" for i in range(1, 9)),
    "recursive_alias": lambda t, d: t + "loop: &loop {self: *loop}\n",
    "python_tag": lambda t, d: t.replace("seed: ", "seed: !!python/object/apply:os.system ['true'] #", 1),
    "other_tags": lambda t, d: t.replace("seed: ", d.draw(st.sampled_from(
        ["seed: !!binary aGk= #", "seed: !!set {a, b} #", "seed: !!timestamp 2024-13-45 #", "seed: !!float nan #",
         "seed: 2024-02-30 #", "seed: !custom 3 #", "seed: !!str #"])), 1),
    "duplicate_line": lambda t, d: (lambda lines, i: "".join(lines[: i + 1] + [lines[i]] + lines[i + 1:]))(
        t.splitlines(True), d.draw(st.integers(0, max(0, len(t.splitlines()) - 1)))),
    "tab": lambda t, d: t.replace("\n  ", "\n\t", 1),
    "truncate": lambda t, d: t[: d.draw(st.integers(0, len(t)))],
    "bom": lambda t, d: "\ufeff" + t,
    "deep": lambda t, d: t + "deep: " + "[" * d.draw(st.sampled_from([63, 65, 300, 1200])) + "]" * 1200 + "\n",
    "documents": lambda t, d: t + "---\nname: other\n",
    "merge": lambda t, d: t + "base_args: &args {max_steps: 3}\nmerged: {<<: *args, lr: 0.1}\nbad_merge: {<<: 3}\n",
    "flow_noise": lambda t, d: t.replace("{", "{" + d.draw(st.sampled_from(["? ", "[a]: 1, ", "*x, ", "&x "])), 1),
    "oversized": lambda t, d: t + "# padding\n" * 120_000,
}
BYTE_MUTATIONS = {
    "latin1_byte": lambda b, d: b.replace(b"t\n", b"t\xe9\n", 1),
    "nul": lambda b, d: b.replace(b"\n", b"\x00\n", 1),
    "random_bytes": lambda b, d: b[: d.draw(st.integers(0, len(b)))] + d.draw(st.binary(max_size=40)),
}


# ---------------------------------------------------------------- data files, flags, environments

json_values = st.recursive(st.none() | st.booleans() | st.integers(-10, 10) | st.floats(allow_nan=False)
                           | st.text(max_size=20), lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.sampled_from(["prompt", "completion", "answer", "messages", "role",
                                                             "content", "x"]), inner, max_size=4), max_leaves=8)


def mutate_data_file(draw, files: dict[str, bytes]) -> str:
    name = draw(st.sampled_from(sorted(files)))
    kind = draw(st.sampled_from(["json_values", "bytes", "latin1", "empty", "bom", "copy", "no_answer",
                                 "word_answer", "no_assistant", "bad_messages", "deep_json", "missing"]))
    other = "h.jsonl" if name == "d.jsonl" else "d.jsonl"
    if kind == "json_values":
        files[name] = "".join(json.dumps(v) + "\n" for v in draw(st.lists(json_values, max_size=4))).encode()
    elif kind == "bytes":
        files[name] = draw(st.binary(max_size=120))
    elif kind == "latin1":
        files[name] += '{"prompt": "caf\xe9?", "completion": "1", "answer": "1"}\n'.encode("latin-1")
    elif kind == "empty":
        files[name] = b""
    elif kind == "bom":
        files[name] = b"\xef\xbb\xbf" + files[name]
    elif kind == "copy":  # the other file's content (none where an earlier mutation deleted it)
        files[name] = files.get(other, b"")
    elif kind == "no_answer":
        files[name] = b'{"prompt": "What is 8+8?", "completion": "16"}\n'
    elif kind == "word_answer":
        files[name] = b'{"prompt": "What is 8+8?", "completion": "16", "answer": "sixteen"}\n'
    elif kind == "no_assistant":
        files[name] = b'{"prompt": "What is 8+8?", "answer": "16"}\n'
    elif kind == "bad_messages":
        files[name] = b'{"messages": [{"role": "assistant"}], "answer": "1"}\n{"messages": []}\n'
    elif kind == "deep_json":
        files[name] = b"[" * 100_000 + b"]" * 100_000 + b"\n"
    elif kind == "missing":
        del files[name]
    return f"data:{kind}"


flag_values = st.sampled_from(["", " ", "sft", "eval_sft", "nosuch", "evl_sft", "x" * 300, "base", "sft@2"])


def draw_flags(draw, doc) -> tuple[str, list[str]]:
    kind = draw(st.sampled_from(["set", "set", "only", "from", "force", "two_picks", "no_cache"]))
    if kind == "set":
        where = paths(doc)
        path = draw(st.sampled_from([".".join(map(str, p)) for p in where] + ["", "stages..sft", "nope.deeper",
                                                                             "seed.x", "=", "stages.sft.max_steps"]))
        value = draw(st.one_of(st.sampled_from(["nan", "-1", "[1", "{", "*a", "!!python/name:os.system", "1e999",
                                                "", "~", "[&a [1,1,1,1,1,1,1,1,1,1], &b [*a,*a,*a,*a,*a,*a,*a,*a,*a,"
                                                "*a], &c [*b,*b,*b,*b,*b,*b,*b,*b,*b,*b], &d [*c,*c,*c,*c,*c,*c,*c,"
                                                "*c,*c,*c], &e [*d,*d,*d,*d,*d,*d,*d,*d,*d,*d]]"]),
                               st.text(alphabet="abc019.-[]{}:,=\"' ", max_size=20)))
        return "validate", ["--set", f"{path}={value}" if path != "=" else value]
    if kind == "two_picks":
        return "run", ["--only", draw(flag_values), "--from", draw(flag_values)]
    if kind == "no_cache":
        return "run", ["--no-cache", "--force", draw(flag_values)]
    return "run", [f"--{kind}", draw(flag_values)]


def make_home(kind: str, root: Path) -> Path:
    if kind == "file":
        home = root / "home"
        home.write_text("a file, not a directory\n")
    elif kind == "under_file":
        (root / "blocker").write_text("a file\n")
        home = root / "blocker" / "home"
    elif kind == "uri_characters":
        home = root / "we?ird#home %"
    else:
        home = root / "home"
    return home


def snapshot(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


@contextlib.contextmanager
def environment(home: Path, cwd: Path):
    """POSTTRAIN_HOME and the working dir for one example; what configure_environment sets is undone."""
    keys = ("POSTTRAIN_HOME", "MLFLOW_TRACKING_URI", "PREFECT_HOME", "PREFECT_SERVER_DATABASE_CONNECTION_URL",
            "HF_HUB_OFFLINE", "PATH")
    saved = {key: os.environ.get(key) for key in keys}
    before = os.getcwd()
    os.environ["POSTTRAIN_HOME"] = str(home)
    os.environ["HF_HUB_OFFLINE"] = "1"
    for key in ("MLFLOW_TRACKING_URI", "PREFECT_SERVER_DATABASE_CONNECTION_URL"):
        os.environ.pop(key, None)
    os.chdir(cwd)
    try:
        yield
    finally:
        os.chdir(before)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def invoke(argv: list[str]) -> tuple[int, str, str]:
    """``posttrain ARGV`` in-process; (status, stdout, stderr). argparse's own exit (2) is a status too."""
    from flows.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(argv)
        except SystemExit as exit_:
            status = exit_.code
    return status, out.getvalue(), err.getvalue()


def check_messages(err: str) -> None:
    """Every issue line names its file and where: a YAML path, a flag, POSTTRAIN_HOME, or the document."""
    lines = [line for line in err.splitlines() if line.startswith("  ")]
    assert lines, f"no issue listed:\n{err}"
    for line in lines:
        match = ISSUE_LINE.match(line)
        assert match, f"an issue that names no file: {line!r}"
        rest = match["rest"]
        named = (YAML_PATH.match(rest) or rest.startswith(("--", "POSTTRAIN_HOME"))
                 or any(problem in rest for problem in DOCUMENT_PROBLEMS))
        assert named, f"an issue that names no place: {line!r}"


# ---------------------------------------------------------------- the property


@settings(max_examples=MAX_EXAMPLES, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
@given(st.data())
def fuzz_one(data):
    base = data.draw(st.sampled_from(sorted(BASES)))
    doc = copy.deepcopy(BASE_DOCS[base])  # parsed once: parsing each example's took a quarter of the test
    files = dict(BASE_FILES) if base == "files" else {}
    command, argv, home_kind = "validate", [], "fresh"
    kinds = []
    for _ in range(data.draw(st.integers(1, 3))):
        area = data.draw(st.sampled_from(["document", "document", "document", "text", "bytes", "data", "flags",
                                          "home"]))
        if area == "document":
            kinds.append(f"document:{mutate_document(data.draw, doc)}")
        elif area == "data" and files:
            kinds.append(mutate_data_file(data.draw, files))
        elif area == "flags":
            command, argv = draw_flags(data.draw, doc)
            kinds.append(f"flag:{argv[0]}")
        elif area == "home":
            home_kind = data.draw(st.sampled_from(["file", "under_file", "uri_characters"]))
            kinds.append(f"home:{home_kind}")
        else:
            kinds.append(area)
    text = yaml.dump(doc, Dumper=DUMPER, sort_keys=False, allow_unicode=True)
    if "text" in kinds:
        name = data.draw(st.sampled_from(sorted(TEXT_MUTATIONS)))
        text = TEXT_MUTATIONS[name](text, SimpleNamespace(draw=data.draw))
        kinds.append(f"text:{name}")
    payload = text.encode("utf-8")
    if "bytes" in kinds:
        name = data.draw(st.sampled_from(sorted(BYTE_MUTATIONS)))
        payload = BYTE_MUTATIONS[name](payload, SimpleNamespace(draw=data.draw))
        kinds.append(f"bytes:{name}")

    with tempfile.TemporaryDirectory(prefix="posttrain-fuzz-") as scratch:
        root = Path(scratch)
        work = root / "work"
        work.mkdir()
        (work / "p.yaml").write_bytes(payload)
        for name, content in files.items():
            (work / name).write_bytes(content)
        home = make_home(home_kind, root)
        before = snapshot(root)
        with environment(home, work):
            status, out, err = invoke([command, "p.yaml", *argv])
        assert "Traceback" not in out + err, err
        assert status in (0, 2), f"exit {status}:\n{err}"
        if status == 2 and "error: argument" in err:  # argparse refused the command line itself
            STATS["refused: argparse"] += 1
        elif status == 2:
            assert "nothing was run" in err, err
            check_messages(err)
            STATS["refused"] += 1
        elif command == "validate":
            assert "valid pipeline" in out, out
            STATS["valid"] += 1
        else:
            STATS["accepted by run"] += 1
        assert snapshot(root) == before, "posttrain wrote to the home or beside it"
        for kind in kinds:
            STATS[kind.split(":")[0]] += 1


def test_fuzzed_input_is_refused_cleanly_or_accepted():
    """Every example: exit 2 with what and where, or valid; no traceback; nothing written."""
    from flows import cli
    from flows.execution import pipeline

    STATS.clear()
    accepted = SimpleNamespace(failed=[], unrecorded=[])
    with mock.patch.object(cli, "run_from_cli", lambda loaded, options, console: accepted), \
            mock.patch.object(pipeline, "print_summary", lambda report, console: None):
        fuzz_one()
    # the fuzzer reached both outcomes and every kind of breakage (else it proves little)
    assert STATS["refused"] > MAX_EXAMPLES // 3 and STATS["valid"] + STATS["accepted by run"] > MAX_EXAMPLES // 50, STATS
    for area in ("document", "text", "bytes", "data", "flag", "home"):
        assert STATS[area] > 10, (area, STATS)
