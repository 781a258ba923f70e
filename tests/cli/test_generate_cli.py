"""`specdecode generate` on tiny models saved as transformers directories."""

import json

import pytest

from specdecode.cli import main
from tests.tiny import save_pair



@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return save_pair(tmp_path_factory.mktemp("models"), seed=11, scale=0.4, noise=0.05, max_len=256)


def gen(capsys, model_dirs, *extra):
    draft = [] if "--no-spec" in extra else ["--draft", model_dirs[1]]  # plain decoding refuses a draft model
    argv = ["generate", "def f(x):", "--target", model_dirs[0], *draft, "--dtype", "float32",
            "--max-new-tokens", "24", *extra]
    try:
        rc = main(list(argv))
    except SystemExit as exc:  # argparse's usage errors
        rc = exc.code
    out = capsys.readouterr()
    return rc, out


def test_json_spec_and_baseline_agree(capsys, model_dirs):
    rc, out = gen(capsys, model_dirs, "--json", "--compare", "--k", "4", "--drafter", "model")
    assert rc == 0
    doc = json.loads(out.out.strip().splitlines()[-1])
    assert doc["speculative"]
    assert doc["stats"]["new_tokens"] == 24 or doc["stats"]["finish_reason"] == "stop"
    assert doc["stats"]["new_tokens"] == doc["baseline"]["stats"]["new_tokens"]
    assert doc["baseline"]["same_text"] is True
    assert doc["stats"]["rounds"] < doc["baseline"]["stats"]["rounds"]
    assert set(doc["stats"]) >= {"alpha", "c", "mean_acceptance_length", "accepted_per_position",
                                 "predicted_speedup", "t_draft", "t_verify", "tokens_per_second"}


def test_streams_text_and_prints_statistics(capsys, model_dirs):
    rc, out = gen(capsys, model_dirs, "--show-drafts", "--temperature", "0.8", "--top-p", "0.9", "--seed", "3")
    assert rc == 0
    assert "alpha" in out.err and "mean acceptance length" in out.err
    assert len(out.out.strip()) > 0


def test_adaptive_k_declines_a_draft_as_slow_as_the_target(capsys, model_dirs):
    """Here the draft has the target's size (c ~ 1): speculation cannot pay, so K = 0 nearly always."""
    rc, out = gen(capsys, model_dirs, "--json", "--drafter", "model", "--max-new-tokens", "40")
    doc = json.loads(out.out.strip().splitlines()[-1])
    ks = doc["stats"]["k_per_round"]
    assert rc == 0 and ks.count(0) >= len(ks) - 3  # only occasional exploration rounds


def test_lookup_drafter_loads_no_draft_model(capsys, model_dirs):
    """No --draft: the embedded draft is not loaded either (it would not match this tiny target)."""
    rc = main(["generate", "def f(x):", "--target", model_dirs[0], "--dtype", "float32", "--max-new-tokens", "24",
               "--json", "--drafter", "lookup"])
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and set(doc["stats"]["drafter_per_round"]) <= {"lookup", "none"}


def test_confidence_stop_flag(capsys, model_dirs):
    rc, out = gen(capsys, model_dirs, "--json", "--drafter", "model", "--k", "6", "--draft-confidence", "0.9")
    doc = json.loads(out.out.strip().splitlines()[-1])
    assert rc == 0 and max(doc["stats"]["k_per_round"]) <= 6


def test_no_spec(capsys, model_dirs):
    rc, out = gen(capsys, model_dirs, "--no-spec", "--json")
    doc = json.loads(out.out.strip().splitlines()[-1])
    assert rc == 0 and doc["speculative"] is False and doc["stats"]["drafted"] == 0


@pytest.mark.parametrize("extra, message", [
    (["--k", "0"], "k must be an integer >= 1"),
    (["--temperature", "-1"], "temperature must be"),
    (["--top-p", "0"], "top_p must be in (0, 1]"),
    (["--draft", "/no/such/dir"], "does not exist"),
    (["--dtype", "int3"], "unknown dtype"),
    (["--draft-confidence", "1.5"], "argument --draft-confidence: must be a number in [0, 1)"),
])
def test_bad_input_is_one_clear_line(capsys, model_dirs, extra, message):
    rc, out = gen(capsys, model_dirs, *extra)
    assert rc == 2 and message in out.err and "Traceback" not in out.err


def test_text_is_printed_exactly_as_generated(capsys):
    """rich's print expanded tabs, dropped \\r and bells, and turned ":x:" into an emoji."""
    from specdecode.cli.output import write_text
    text = "a\tb\r\n:x: \x07[bold]z[/] \u00e9"
    write_text(text)
    write_text(text, "green")  # not a terminal: no colour codes either
    assert capsys.readouterr().out == text + text


def test_show_drafts_prints_the_text_a_stop_string_cut(capsys, model_dirs):
    """--show-drafts printed the text of the chunk's tokens, the one that holds a stop string's start
    included, so the stop string's first characters appeared."""
    rc, out = gen(capsys, model_dirs, "--json")
    full = json.loads(out.out.strip().splitlines()[-1])["text"]
    i = next(i for i in range(3, len(full) - 3) if full.find(full[i:i + 3]) == i)
    for flags in ([], ["--show-drafts"]):
        rc, out = gen(capsys, model_dirs, "--stop", full[i:i + 3], *flags)
        assert rc == 0 and out.out == full[:i] + "\n", (flags, out.out, full[:i])


# `specdecode` whose generation yields each chunk 0.5 s late, so a signal lands while it generates
SLOW_CLI = """import sys, time
import specdecode.engine.decoder as decoder
real = decoder.SpeculativeDecoder.stream_ids
def slow(*a, **kw):
    for chunk in real(*a, **kw):
        yield chunk
        time.sleep(0.5)
decoder.SpeculativeDecoder.stream_ids = slow
from specdecode.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _cli(*argv, slow: bool = False):
    import signal
    import subprocess
    import sys
    # SIGINT as a terminal leaves it: a job started in the background of a non-interactive shell (as a
    # CI runner may start the tests) inherits SIGINT ignored, and Python then keeps it ignored
    return subprocess.Popen([sys.executable, *(["-c", SLOW_CLI] if slow else ["-m", "specdecode"]), *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


@pytest.mark.parametrize("when", ["importing", "generating"])
def test_ctrl_c_is_one_line_not_a_traceback(model_dirs, when):
    import signal
    import time
    proc = _cli("generate", "def f(x):", "--target", model_dirs[0], "--draft", model_dirs[1], "--dtype", "float32",
                "--max-new-tokens", "200", "--k", "2", slow=when == "generating")
    if when == "generating":
        proc.stdout.read(1)  # the first text is out: the model is loaded and generating
    else:
        time.sleep(0.3)  # importing torch and transformers takes seconds
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err.strip().splitlines()[-1] == "interrupted" and "Traceback" not in err, err


def test_ctrl_c_in_bench_stops_its_workers_without_tracebacks(model_dirs, tmp_path):
    import signal
    import time
    proc = _cli("bench", "--target", model_dirs[0], "--draft", model_dirs[1], "--dtype", "float32", "--sets",
                "codegen", "--prompts-per-set", "6", "--modes", "greedy", "--k-sweep", "2", "--reps", "3",
                "--max-new-tokens", "32", "--no-hf", "--out", str(tmp_path / "b"))
    time.sleep(8)  # the method worker (a child process) is loading or measuring
    proc.send_signal(signal.SIGINT)  # as a terminal's Ctrl-C, to the parent (the child ignores it)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert not (tmp_path / "b" / "results.json").exists()


def test_closed_or_broken_stdout_is_no_traceback(model_dirs):
    import subprocess
    import sys
    base = [sys.executable, "-m", "specdecode", "generate", "def f(x):", "--target", model_dirs[0], "--draft",
            model_dirs[1], "--dtype", "float32", "--max-new-tokens", "24"]
    closed = subprocess.run(["bash", "-c", " ".join(map(repr, base)) + " --json >&-"], capture_output=True, text=True,
                            timeout=120)  # it was an AttributeError traceback
    assert closed.returncode == 1 and "standard output is closed" in closed.stderr, closed.stderr
    assert "Traceback" not in closed.stderr
    piped = subprocess.run(["bash", "-c", " ".join(map(repr, base)) + " | head -c 1"], capture_output=True,
                           text=True, timeout=120)
    assert "Traceback" not in piped.stderr and "Error" not in piped.stderr, piped.stderr


@pytest.mark.parametrize("command", [["theory"], ["rand7", "--n", "10"], ["simulate", "--rounds", "10"]])
def test_a_closed_stdout_is_named_in_text_mode_too(command):
    """Text output into a closed stdout was lost without a word (exit 0; audit ran to the end first)."""
    import subprocess
    import sys
    closed = subprocess.run(["bash", "-c", " ".join(map(repr, [sys.executable, "-m", "specdecode", *command]))
                             + " >&-"], capture_output=True, text=True, timeout=120)
    assert closed.returncode == 1 and "standard output is closed" in closed.stderr, closed.stderr



def test_ctrl_c_during_the_imports_waits_for_them_to_finish():
    """Libraries swallow a Ctrl-C that lands in their imports (a bare `except:`), leaving half-imported
    modules that fail later (transformers then raised ModuleNotFoundError: a traceback; or generation went
    on as if no key was pressed: both seen on a loaded 2-core CPU). So the imports run with Ctrl-C held
    back, and it counts once they are done; here a swallowing `except` does not lose it."""
    import os
    import signal

    from specdecode.interrupts import ctrl_c_after

    def swallowing_import():
        try:
            os.kill(os.getpid(), signal.SIGINT)  # the key, pressed in the middle of an import
            sum(range(10 ** 5))  # the interpreter runs handlers between bytecodes: here, if at all
        except:  # noqa: E722  (what some libraries do)
            pass
        return "imported"

    done = []
    with pytest.raises(KeyboardInterrupt):
        with ctrl_c_after():
            done.append(swallowing_import())
    assert done == ["imported"]  # the work finished, then the key counted
    with ctrl_c_after():  # control: no key, nothing raised
        done.append("no key")
    assert done == ["imported", "no key"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored


def test_a_generation_the_context_cut_short_says_so(capsys, tmp_path):
    """Finish "length" alone reads as --max-new-tokens reached; when the context ran out first, a note says so."""
    model_dirs = save_pair(tmp_path, seed=13, scale=0.4, noise=0.05, max_len=32)  # greedy: no EOS in 32
    rc, out = gen(capsys, model_dirs, "--no-spec", "--max-new-tokens", "400")
    assert rc == 0 and "the model's context of 32 tokens is full" in out.err, out.err
    rc, out = gen(capsys, model_dirs, "--no-spec", "--max-new-tokens", "400", "--json")
    doc = json.loads(out.out.strip().splitlines()[-1])
    assert doc["context_full"] is True and doc["stats"]["new_tokens"] < 400
    rc, out = gen(capsys, model_dirs, "--no-spec", "--json")  # control: 24 tokens fit
    doc = json.loads(out.out.strip().splitlines()[-1])
    assert doc["context_full"] is False and doc["stats"]["new_tokens"] == 24
