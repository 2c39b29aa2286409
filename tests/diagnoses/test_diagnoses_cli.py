"""`gpuprof analyze` and `gpuprof compare` end to end: real runs, the real CLI, the documented schema."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
from processes import gpuprof_cli
from referencing import Registry, Resource

DOCS = Path(__file__).resolve().parents[2] / "docs" / "json-output.md"


@pytest.fixture(scope="module")
def schemas() -> dict:
    """The JSON Schemas exactly as docs/json-output.md documents them, keyed by $id."""
    blocks = re.findall(r"```json\n(.*?)```", DOCS.read_text(), flags=re.S)
    found = {schema["$id"]: schema for schema in map(json.loads, blocks)}
    assert set(found) == {"gpuprof.analyze", "gpuprof.compare"}
    return found


def validate(document: dict, schema_id: str, schemas: dict) -> None:
    """Validate against one documented schema; the compare schema refers to the analyze one by $id."""
    registry = Registry().with_resources((name, Resource.from_contents(schema)) for name, schema in schemas.items())
    jsonschema.Draft202012Validator(schemas[schema_id], registry=registry).validate(document)


def test_analyze_json_follows_the_documented_schema(recorded_runs, schemas):
    result = gpuprof_cli("analyze", recorded_runs.path("data_delay"), "--json")
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    validate(document, "gpuprof.analyze", schemas)
    assert "dataloader-bound" in [finding["rule"] for finding in document["findings"]]
    assert document["verdict"]["bound"] == "input" == document["findings"][0]["category"]
    assert document["summary"]["warmup"]["n_steps"] >= 1


def test_analyze_prints_summary_and_ranked_findings(recorded_runs):
    result = gpuprof_cli("analyze", recorded_runs.path("data_delay"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Verdict: Bound by input") and "warm-up excluded" in result.stdout
    findings = re.findall(r"^\s+\d+\. (CRITICAL|WARNING|INFO)\s+(\S+):", result.stdout, flags=re.M)
    assert "dataloader-bound" in [rule for _, rule in findings]
    order = ["CRITICAL", "WARNING", "INFO"]
    assert [order.index(severity) for severity, _ in findings] == sorted(order.index(s) for s, _ in findings)


def test_compare_json_and_text(recorded_runs, schemas):
    baseline, changed = recorded_runs.path("baseline"), recorded_runs.path("host_sync")
    result = gpuprof_cli("compare", baseline, changed, "--json")
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    validate(document, "gpuprof.compare", schemas)
    appeared = [finding["rule"] for finding in document["findings"]["appeared"]]
    disappeared = [finding["rule"] for finding in document["findings"]["disappeared"]]
    assert "host-device-sync" in appeared  # --host-sync, seen in its trace window
    assert "attention-not-fused" in disappeared  # --attention sdpa
    text = gpuprof_cli("compare", baseline, changed)
    assert text.returncode == 0 and "+1." in text.stdout and "-1." in text.stdout


@pytest.mark.parametrize("command", ["analyze", "analyze --json", "compare MISSING MISSING --json"])
def test_bad_run_path_is_one_line_and_exit_2(tmp_path, command):
    missing = tmp_path / "no-such-run"
    args = [missing if word == "MISSING" else word for word in command.split()]
    result = gpuprof_cli(*args) if "MISSING" in command else gpuprof_cli(*args, missing)
    assert result.returncode == 2
    assert result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1 and "error" in result.stderr


def test_not_a_run_directory_is_one_line_and_exit_2(tmp_path):
    result = gpuprof_cli("analyze", tmp_path)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
