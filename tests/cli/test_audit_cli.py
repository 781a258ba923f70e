"""`specdecode audit` on tiny models saved to disk."""

import json

import pytest

from specdecode.cli import main
from tests.tiny import save_pair



@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return save_pair(tmp_path_factory.mktemp("audit-models"), seed=31, scale=0.2, noise=0.1, max_len=256)


def test_audit_json(capsys, model_dirs):
    rc = main(["audit", "--target", model_dirs[0], "--draft", model_dirs[1], "--dtype", "float32", "--quick",
               "--prompt", "abcab", "--k", "3", "--json"])
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and doc["passed"] is True and doc["verdict"] == "pass"
    assert {c["name"] for c in doc["law_checks"]} == {"prompt 1: next-token law", "prompt 1: two-token law"}
    assert doc["control"]["detected"] is True
    assert all(c["samples"] == 200 for c in doc["law_checks"])


def test_audit_tables(capsys, model_dirs):
    rc = main(["audit", "--target", model_dirs[0], "--draft", model_dirs[1], "--dtype", "float32", "--quick",
               "--prompt", "xyxy", "--samples", "100", "--greedy-tokens", "8"])
    out = capsys.readouterr().out
    assert rc == 0 and "PASS" in out and "negative control" in out and "TV bound" in out


def test_audit_rejects_greedy(capsys, model_dirs):
    rc = main(["audit", "--target", model_dirs[0], "--draft", model_dirs[1], "--temperature", "0", "--quick"])
    assert rc == 2 and "temperature > 0" in capsys.readouterr().err


def test_an_audit_that_cannot_see_its_control_is_inconclusive_not_a_pass(capsys, model_dirs):
    """With 20 samples the broken always-accept rule goes unseen: the audit has no power, so it may not
    report a pass (it did, exit 0). 200 samples see it (test_audit_json), the control of this test."""
    rc = main(["audit", "--target", model_dirs[0], "--draft", model_dirs[1], "--dtype", "float32", "--quick",
               "--prompt", "abcab", "--k", "3", "--samples", "20", "--greedy-tokens", "8", "--json"])
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert doc["control"]["detected"] is False and doc["failed"] is False and doc["passed"] is False
    assert rc == 3 and doc["verdict"] == "inconclusive" and "raise --samples" in doc["advice"]
