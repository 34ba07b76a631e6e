"""The pipeline language where users write it: `posttrain schema` (the JSON Schema editors read), the
generated reference page, and the shipped pipelines checked against the schema."""

import json
from pathlib import Path

import jsonschema
import pytest
import yaml
from conftest import ROOT, run_cli

from flows.spec.reference import REFERENCE_FILE, SCHEMA_FILE, SCHEMA_LINE, reference_markdown, schema_text

PIPELINES = sorted((ROOT / "pipelines").glob("*.yaml"))
REGENERATE = ("regenerate with: posttrain schema > docs/pipeline.schema.json && "
              "posttrain schema --reference > docs/pipeline-reference.md")


def test_the_committed_schema_and_reference_are_current():
    assert (ROOT / SCHEMA_FILE).read_text() == schema_text(), f"{SCHEMA_FILE} is stale: {REGENERATE}"
    assert (ROOT / REFERENCE_FILE).read_text() == reference_markdown(), f"{REFERENCE_FILE} is stale: {REGENERATE}"


def test_schema_command_prints_them(capsys):
    assert run_cli("schema") == 0
    assert json.loads(capsys.readouterr().out) == json.loads(schema_text())
    assert run_cli("schema", "--reference") == 0
    page = capsys.readouterr().out
    assert "| `rl` (algorithm: grpo) | [GRPOStageConfig](#grpostageconfig) |" in page
    assert "### SamplingSettings" in page and "`max_tokens`" in page


@pytest.mark.parametrize("pipeline", PIPELINES, ids=lambda p: p.name)
def test_every_shipped_pipeline_names_the_schema_and_validates_against_it(pipeline):
    text = pipeline.read_text()
    assert text.splitlines()[0] == SCHEMA_LINE  # the YAML language server reads the first line
    assert (pipeline.parent / SCHEMA_LINE.split("$schema=")[1]).resolve() == (ROOT / SCHEMA_FILE).resolve()
    jsonschema.Draft202012Validator(json.loads((ROOT / SCHEMA_FILE).read_text())).validate(yaml.safe_load(text))


@pytest.mark.parametrize("edit, fragment", [
    ("    kl_beta: 0.01\n", "    kl_beta: 0.01\n    klbeta: 0.01\n"),          # a typo'd key
    ("    max_steps: 250\n", "    max_steps: many\n"),                        # a wrong type
    ("    algorithm: grpo\n", "    algorithm: grpa\n"),                        # not an algorithm
    ("    sampling: {temperature: 1.0, max_tokens: 4", "    sampling: {temperature: -1.0, max_tokens: 4"),  # a bound
])
def test_the_schema_catches_what_an_editor_should_underline(edit, fragment):
    schema = json.loads((ROOT / SCHEMA_FILE).read_text())
    text = (ROOT / "pipelines" / "quickstart.yaml").read_text()
    assert edit in text
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(schema).validate(yaml.safe_load(text.replace(edit, fragment, 1)))
