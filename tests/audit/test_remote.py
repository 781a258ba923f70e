"""The black-box audit against a fake OpenAI-compatible server of known law (tests/audit/fake_openai.py),
in-process (httpx's ASGI transport: no sockets).

Every audit runs at an overall false-failure probability of 1e-3 (Bonferroni over its tests); the
fake's randomness is a function of each request, so every outcome here is deterministic.
"""

from __future__ import annotations

import math

import httpx
import pytest

from specdecode.audit.remote import RemoteConfig, Side, run_remote_audit
from specdecode.audit.remote.client import EndpointError, parse_answer
from specdecode.audit.remote.compare import greedy_check
from specdecode.audit.remote.client import Answer
from specdecode.audit.remote.plan import QUICK_PROMPTS, QUICK_SETTINGS, Prompt, Setting, load_prompts, parse_setting
from specdecode.cli.audit_server import QUICK_CONTROL, QUICK_SAMPLES
from tests.audit.fake_openai import fake_app

OFF = {"specdecode": {"speculative": False}}
QUICK = RemoteConfig(samples=QUICK_SAMPLES, greedy_tokens=8, boundary_tokens=0, control_factor=QUICK_CONTROL)


def audit(app, config: RemoteConfig = QUICK, prompts=QUICK_PROMPTS, settings=QUICK_SETTINGS, body=None,
          reference_body=OFF):
    return run_remote_audit(Side("endpoint", "http://fake/v1", body or {}), Side("reference", "http://fake/v1",
                                                                                 reference_body),
                            prompts, settings, config, transport=httpx.ASGITransport(app), progress=False)


def test_a_lossless_endpoint_passes_with_the_control_detected():
    report = audit(fake_app("exact"))
    assert report.verdict == "pass", report.to_dict()
    assert report.control_detected is True
    assert all(c.passed for c in report.comparisons) and report.greedy and all(g.passed for g in report.greedy)
    kinds = {c.test for c in report.comparisons}
    assert "logprobs" in kinds and "chi-square" in kinds  # the fake reports logprobs: both tests ran
    # Bonferroni over every test, the greedy checks (their tie probes) included
    assert report.tests == len(report.comparisons) + len(report.greedy)
    assert report.comparisons[0].level == pytest.approx(1e-3 / report.tests)
    assert report.detectable_tv is not None and 0 < report.detectable_tv < 1
    # the control ran on each prompt's group, so one prompt that hides a temperature change cannot hide it
    assert {c.group.split(" | ")[0].split("): ")[1] for c in report.controls} == {p.name for p in QUICK_PROMPTS}


@pytest.mark.parametrize("law,settings", [("accept-all", QUICK_SETTINGS), ("hot", QUICK_SETTINGS),
                                          ("raw-q", (Setting(1.0, top_k=5),))])
def test_a_lossy_endpoint_fails_at_the_quick_sample_size(law, settings):
    """Three bug classes that shipped: drafts accepted unchecked, a temperature off by 25%, q taken before
    top-k (only a truncating setting shows that one): each is caught by --quick's prompts and samples."""
    report = audit(fake_app(law), settings=settings)
    assert report.verdict == "fail", [(c.name, c.p_value) for c in report.comparisons]
    assert any(not c.passed for c in report.comparisons)


def test_the_same_lossy_endpoint_against_itself_passes():
    """The negative control of the test above: the audit fails a law change, not the fake's lossy mode as
    such (both sides speculating with the bug agree)."""
    report = audit(fake_app("hot"), reference_body={"specdecode": {"speculative": True}, "user": "reference"})
    assert not report.failed, [(c.name, c.p_value) for c in report.comparisons]


def test_too_few_samples_to_see_the_control_is_inconclusive():
    report = audit(fake_app("exact"), RemoteConfig(samples=20, greedy_tokens=0, boundary_tokens=0),
                   prompts=QUICK_PROMPTS[1:], settings=(Setting(1.0),))
    assert report.control_detected is False and report.verdict == "inconclusive"
    assert "raise --samples" in report.advice


def test_raw_logprobs_feed_the_one_sample_test_only_where_they_are_the_law():
    """A server that reports its raw law (before temperature and truncation) while sampling the processed
    one: the test against reported logprobs runs at temperature 1 untruncated only, where the two agree."""
    report = audit(fake_app("exact", logprobs="raw"), settings=(Setting(1.0), Setting(0.6, top_k=5)))
    one_sample = [c for c in report.comparisons if c.test == "logprobs"]
    assert one_sample and all("T 1 |" in c.group and c.tested for c in one_sample)
    assert not report.failed


def test_logprobs_that_are_not_the_sampled_law_are_caught_by_the_reference():
    """Raw logprobs at temperature 1 but a server that samples another law there (its own default top-k):
    the reference's answers contradict its logprobs, so the test does not run (no false failure)."""
    from specdecode.audit.remote.compare import against_law
    law = {"a": math.log(0.5), "b": math.log(0.3), "c": math.log(0.2)}
    sampled = ["a"] * 125 + ["b"] * 75  # top-k 2 of that law: c never comes
    check = against_law("g", sampled, sampled, law, 1e-3, 0.9)
    assert not check.tested and "do not follow its logprobs" in check.note
    assert against_law("g", sampled, ["a"] * 100 + ["b"] * 60 + ["c"] * 40, law, 1e-3, 0.9).p_value < 1e-6


def test_without_logprobs_the_whole_answers_are_tested():
    report = audit(fake_app("exact", logprobs=None))
    assert {c.statistic for c in report.comparisons} == {"first 3 tokens"}
    assert any("no logprobs" in n for n in report.notes) and not report.failed
    assert all(g.result == "identical" for g in report.greedy)


def test_a_refused_field_skips_its_settings_with_a_note():
    report = audit(fake_app("exact", refuse=frozenset({"top_k"})),
                   settings=(Setting(1.0), Setting(1.0, top_k=5)))
    assert any("top_k refused" in n for n in report.notes)
    assert all("top-k" not in c.group for c in report.comparisons) and report.verdict == "pass"


def test_every_setting_refused_is_an_error():
    with pytest.raises(EndpointError, match="every sampling setting needs a field"):
        audit(fake_app("exact", refuse=frozenset({"min_p"})), settings=(Setting(1.0, min_p=0.1),))


def test_the_boundary_group_tests_where_answers_end():
    report = audit(fake_app("exact"), RemoteConfig(samples=60, greedy_tokens=0, boundary_tokens=6),
                   prompts=(Prompt("c", text="go", stop=(" ba",)),), settings=(Setting(1.0),))
    ends = [c for c in report.comparisons if c.statistic.startswith("end")]
    assert len(ends) == 1 and ends[0].tested and ends[0].cells >= 2


def test_a_reference_left_to_the_audit_needs_our_server():
    with pytest.raises(EndpointError, match="not a specdecode server"):
        audit(fake_app("exact"), reference_body=None)


def test_answers_parse_in_each_servers_shape():
    legacy = {"choices": [{"text": " a b", "finish_reason": "length",
                           "logprobs": {"tokens": [" a", " b"], "token_logprobs": [-0.1, -0.2],
                                        "top_logprobs": [{" a": -0.1, " c": -2.0}, {" b": -0.2}]}}],
              "usage": {"completion_tokens": 2, "specdecode": {"drafted": 3, "accepted": 1}}}
    a = parse_answer(legacy, False, "u")
    assert a.tokens == (" a", " b") and a.top[0] == {" a": -0.1, " c": -2.0} and (a.drafted, a.accepted) == (3, 1)
    post = {"choices": [{"message": {"content": "hi"}, "finish_reason": "stop",
                         "logprobs": {"content": [{"token": "hi", "prob": 0.5,
                                                   "top_probs": [{"token": "hi", "prob": 0.5},
                                                                 {"token": "ho", "prob": 0.25},
                                                                 {"token": "ho", "prob": 0.25}]}]}}]}
    b = parse_answer(post, True, "u")  # llama-server's post-sampling probabilities; two ids print "ho"
    assert b.tokens == ("hi",) and b.top[0]["ho"] == pytest.approx(-0.6931, abs=1e-4)
    with pytest.raises(EndpointError, match="not a completion"):
        parse_answer({"object": "list"}, True, "u")


def answer(tokens, top=None):
    return Answer("".join(tokens), "length", len(tokens), tuple(tokens), top)


def test_greedy_divergences_are_told_apart_by_the_top_two_margin():
    tops = ({"a": -0.1}, {"b": -0.60, "c": -0.70}, {"x": -0.1})
    tie = greedy_check("p", answer(["a", "c", "x"]), answer(["a", "b", "x"], tops), 0.25)
    assert (tie.result, tie.position, tie.passed) == ("numerics", 1, True) and tie.margin == pytest.approx(0.1)
    tops = ({"a": -0.1}, {"b": -0.05, "c": -3.0}, {"x": -0.1})
    loss = greedy_check("p", answer(["a", "c", "x"]), answer(["a", "b", "x"], tops), 0.25)
    assert loss.result == "loss" and not loss.passed and loss.margin == pytest.approx(2.95)
    beyond = greedy_check("p", answer(["a", "z"]), answer(["a", "b"], ({"a": 0.0}, {"b": -0.01, "c": -4.0})), 0.25)
    assert beyond.result == "loss"  # z is not even among the reference's top tokens: at least 3.99 below
    blind = greedy_check("p", Answer("a c", "length", 2), Answer("a b", "length", 2), 0.25)
    assert (blind.result, blind.unit, blind.position) == ("unexplained", "character", 2)
    assert greedy_check("p", answer(["a"]), answer(["a"]), 0.25).result == "identical"


def test_prompts_and_settings_from_the_command_line(tmp_path):
    path = tmp_path / "p.json"
    path.write_text('["Once upon a time", {"messages": [{"role": "user", "content": "hi"}], "stop": "."}]')
    prompts = load_prompts(str(path))
    assert prompts[0].text == "Once upon a time" and prompts[1].chat and prompts[1].stop == (".",)
    for bad, words in [('{"a": 1}', "JSON list"), ('[{"prompt": ""}]', "non-empty"), ("[3]", "string or an object"),
                       ('[{"messages": [{"role": "user"}]}]', "messages")]:
        path.write_text(bad)
        with pytest.raises(ValueError, match=words):
            load_prompts(str(path))
    assert parse_setting("temperature=0.7,top-p=0.9,top_k=20") == Setting(0.7, top_p=0.9, top_k=20)
    for bad in ["top_p=0.9", "temperature=hot", "temp=1", "temperature=3"]:
        with pytest.raises(ValueError):
            parse_setting(bad)


def test_two_deployments_show_their_drafts_by_their_metrics():
    """A reference that is a second deployment: each side's /metrics counters say who drafted; a
    'speculating' endpoint that drafts nothing makes the audit inconclusive (it audited nothing)."""
    from tests.audit.fake_openai import Served

    config = RemoteConfig(samples=40, greedy_tokens=0, boundary_tokens=0, control_factor=2.0)
    with Served(fake_app("exact")) as on, Served(fake_app("exact", speculates=False, seed=8)) as off:
        report = run_remote_audit(Side("endpoint", on.url + "/v1"), Side("reference", off.url + "/v1"),
                                  QUICK_PROMPTS[:1], (Setting(1.0),), config, progress=False)
    assert report.drafts["endpoint"]["drafted"] > 0 and report.drafts["endpoint"]["source"] == "/metrics"
    assert report.drafts["reference"]["drafted"] == 0
    with Served(fake_app("exact", speculates=False)) as on, Served(fake_app("exact", speculates=False, seed=8)) as off:
        idle = run_remote_audit(Side("endpoint", on.url + "/v1"), Side("reference", off.url + "/v1"),
                                QUICK_PROMPTS[:1], (Setting(1.0),), config, progress=False)
    assert idle.verdict == "inconclusive" and "no drafts" in idle.advice
