"""Bad input, as a user would give it, gets one line naming the problem and the fix, and a
non-zero exit (2 for usage errors) -- never a traceback."""

import argparse
import errno
import os
import pathlib
import shutil

import pytest

from specdecode.cli import main
from tests.tiny import save_pair


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return save_pair(tmp_path_factory.mktemp("models"), seed=5, scale=0.4, noise=0.05, max_len=256)


def run(capsys, *argv):
    """(exit status, stderr) of `specdecode <argv>`; argparse's SystemExit counts as a status."""
    try:
        rc = main(list(argv))
    except SystemExit as exc:
        rc = exc.code
    return rc, capsys.readouterr().err


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


def _bad_json(d):
    (d / "config.json").write_text('{"model_type": "qwen2", ')


def _no_weights(d):
    (d / "model.safetensors").unlink()


def _truncated_header(d):
    w = d / "model.safetensors"
    w.write_bytes(w.read_bytes()[:1000])


def _truncated_data(d):
    w = d / "model.safetensors"
    data = w.read_bytes()
    w.write_bytes(data[: len(data) // 2])


def _no_tokenizer(d):
    for f in d.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("vocab.json", "merges.txt", "special_tokens_map.json"):
            f.unlink()


def _no_model_type(d):
    (d / "config.json").write_text('{"hidden_size": 32}')


@pytest.mark.parametrize("role", ["target", "draft"])
@pytest.mark.parametrize("breakage, message", [
    (_bad_json, "config.json' is not valid JSON"),
    (_no_weights, "has a config.json but no weights (model.safetensors or pytorch_model.bin); copy the weight"),
    (_truncated_header, "may be truncated or corrupt; copy them again"),
    (_truncated_data, "may be truncated or corrupt; copy them again"),
    (_no_tokenizer, "has no tokenizer files; copy the tokenizer files"),
    (_no_model_type, "is not a usable transformers config"),
])
def test_broken_model_directory_is_one_line(capsys, tmp_path, model_dirs, role, breakage, message):
    broken = tmp_path / "broken"
    shutil.copytree(model_dirs[0 if role == "target" else 1], broken)
    breakage(broken)
    dirs = {"target": model_dirs[0], "draft": model_dirs[1], role: str(broken)}
    rc, err = run(capsys, "generate", "x", "--target", dirs["target"], "--draft", dirs["draft"],
                  "--drafter", "model", "--dtype", "float32", "--max-new-tokens", "2")
    assert rc == 2 and message in one_line(err) and str(broken) in err


@pytest.mark.parametrize("device, message", [
    ("tpu", "unknown device 'tpu'; use auto, cpu, cuda or cuda:N"),
    ("cuda:99", "cuda:99"),
])
def test_bad_device_is_one_line(capsys, model_dirs, device, message):
    rc, err = run(capsys, "generate", "x", "--target", model_dirs[0], "--draft", model_dirs[1], "--device", device)
    assert rc == 2 and message in one_line(err)


@pytest.mark.parametrize("argv, message", [
    (["generate", "x", "--draft-vocab", "-1"], "argument --draft-vocab: must be an integer >= 0, got '-1'"),
    (["generate", "x", "--draft-vocab", "many"], "argument --draft-vocab: must be an integer >= 0"),
    (["generate"], "the following arguments are required: prompt"),
    (["generat", "x"], "invalid choice: 'generat'"),
    (["bench", "--reps", "0"], "argument --reps: must be an integer >= 1, got '0'"),
    (["bench", "--prompts-per-set", "-1"], "argument --prompts-per-set: must be an integer >= 1"),
    (["bench", "--max-new-tokens", "0"], "argument --max-new-tokens: must be an integer >= 1"),
    (["bench", "--k-sweep", "2", "0"], "argument --k-sweep: must be an integer >= 1"),
    (["audit", "--samples", "0"], "argument --samples: must be an integer from 1 to 100,000"),
    (["audit", "--greedy-tokens", "-3"], "argument --greedy-tokens: must be an integer >= 0"),
    (["audit", "--k", "0"], "argument --k: must be an integer >= 1, got '0'"),
    (["generate", "x", "--threads", "-2"], "argument --threads: must be an integer from 0 to 512"),
    # llama.cpp aborted the process (std::bad_alloc) for 100000 threads
    (["serve", "--threads", "100000"], "argument --threads: must be an integer from 0 to 512"),
    (["generate", "x", "--n-ctx", "-5"], "argument --n-ctx: must be an integer >= 0"),
    (["generate", "x", "--draft-confidence", "nan"], "argument --draft-confidence: must be a number in [0, 1)"),
    # torch keeps 63 bits of a seed: s and s + 2**63 would sample alike, so one range without aliases
    (["generate", "x", "--seed", str(2 ** 63)], "argument --seed: must be an integer from 0 to 2**63 - 1"),
    (["generate", "x", "--seed", "-1"], "argument --seed: must be an integer from 0 to 2**63 - 1"),
    (["audit", "--seed", "99999999999999999999"], "argument --seed: must be an integer from 0 to 2**63 - 1"),
    (["simulate", "--seed", "-5"], "argument --seed: must be an integer from 0 to 2**63 - 1"),
    (["rand7", "--seed", "-5"], "argument --seed: must be an integer from 0 to 2**63 - 1"),
    (["theory", "--c", "inf"], "argument --c: must be a finite number > 0, got 'inf'"),
    (["serve", "--drain-seconds", "-1"], "argument --drain-seconds: must be a finite number of seconds >= 0"),
    (["serve", "--max-batch", "-1"], "argument --max-batch: must be an integer from 0 (auto) to 256"),
    # above llama.cpp's 256 sequences; on transformers 100,000 slots were built for a minute and a half
    (["serve", "--max-batch", "100000"], "argument --max-batch: must be an integer from 0 (auto) to 256"),
    (["serve", "--model-id", ""], "argument --model-id: must be a non-empty name"),  # '' served as 'target'
    (["serve", "--model-id", " m "], "argument --model-id: must be a non-empty name without surrounding spaces"),
])
def test_usage_errors_are_one_line_and_exit_2(capsys, argv, message):
    rc, err = run(capsys, *argv)
    line = one_line(err)
    assert rc == 2 and message in line and "--help" in line


def test_port_validator():
    """For `serve --port` (cli/serve.py: `type=port_number`)."""
    from specdecode.cli.generate import non_negative_int, port_number
    from specdecode.cli.main import Parser

    assert port_number("8000") == 8000 and port_number("65535") == 65535
    for bad in ["70000", "0", "-1", "http"]:
        with pytest.raises(argparse.ArgumentTypeError, match="must be a port number from 1 to 65535"):
            port_number(bad)
    parser = Parser(prog="specdecode serve")
    parser.add_argument("--port", type=port_number)
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--port", "70000"])
    assert exc.value.code == 2
    assert non_negative_int("0") == 0


def test_cache_that_is_a_file_names_the_variable(capsys, tmp_path, monkeypatch):
    (tmp_path / "cache").write_text("not a directory")
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    rc, err = run(capsys, "generate", "x")  # the embedded pair lives in the cache
    line = one_line(err)
    assert rc == 2 and "SPECDECODE_CACHE is" in line and "which is a file, not a directory" in line
    assert "set SPECDECODE_CACHE to a writable directory" in line


def test_read_only_cache_names_the_variable(capsys, tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    monkeypatch.setenv("SPECDECODE_CACHE", str(ro / "cache"))
    if os.access(ro, os.W_OK):  # root writes anyway: have the file system refuse, as a read-only mount does
        mkdir = pathlib.Path.mkdir

        def refuse(self, *args, **kwargs):
            if self == ro or ro in self.parents:
                raise PermissionError(errno.EROFS, os.strerror(errno.EROFS), str(self))
            return mkdir(self, *args, **kwargs)

        monkeypatch.setattr(pathlib.Path, "mkdir", refuse)
    try:
        rc, err = run(capsys, "generate", "x")
    finally:
        ro.chmod(0o755)
    line = one_line(err)
    assert rc == 1 and str(ro) in line and "SPECDECODE_CACHE is" in line
    assert "set SPECDECODE_CACHE to a writable directory" in line


@pytest.mark.parametrize("argv, message", [
    (["serve", "--port", "70000"], "argument --port: must be a port number from 1 to 65535"),
    (["serve", "--queue-size", "-1"], "argument --queue-size: must be an integer >= 1"),
    (["serve", "--prefill-chunk", "0"], "argument --prefill-chunk: must be an integer >= 1"),
])
def test_serve_flags_are_checked_before_loading(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and message in err and len(err.splitlines()) <= 2


@pytest.mark.parametrize("argv, message", [
    (["--no-spec", "--compare"], "--compare has no effect with --no-spec"),
    (["--no-spec", "--k", "3"], "--k has no effect with --no-spec"),
    (["--no-spec", "--show-drafts"], "--show-drafts has no effect with --no-spec"),
    (["--no-spec", "--verify", "block"], "--verify block has no effect with --no-spec"),
    (["--drafter", "lookup", "--draft", "/nonexistent"],
     "--draft is a draft model, which --drafter lookup does not use"),
    (["--drafter", "suffix", "--draft-confidence", "0.5"], "--draft-confidence ends a draft model's drafts"),
    # each of these once ran, reading nothing of the option
    (["--no-spec", "--draft-confidence", "0.5"], "--draft-confidence has no effect with --no-spec"),
    (["--no-spec", "--drafter", "lookup"], "--drafter lookup has no effect with --no-spec"),
    (["--no-spec", "--draft", "/nonexistent.gguf"], "--draft has no effect with --no-spec"),
    (["--no-spec", "--draft-vocab", "5"], "--draft-vocab has no effect with --no-spec"),
    (["--backend", "transformers", "--drafter", "lookup", "--draft-vocab", "5"],
     "--draft-int8/--draft-vocab shape a draft model"),
    (["--backend", "transformers", "--drafter", "suffix", "--draft-int8"],
     "--draft-int8/--draft-vocab shape a draft model"),
    (["--backend", "transformers", "--drafter", "lookup", "--no-draft-int8"],
     "--draft-int8/--draft-vocab shape a draft model"),
    (["--drafter", "lookup", "--no-draft-int8"], "--draft-int8/--draft-vocab apply to a transformers draft"),
    (["--json", "--show-drafts"], "--show-drafts colours the printed text, which --json does not print"),
    (["--top-k", "5"], "--top-k only applies when sampling, and --temperature 0 (the default) is greedy"),
    (["--top-p", "0.5", "--temperature", "0"], "--top-p only applies when sampling"),
    (["--min-p", "0.1"], "--min-p only applies when sampling"),
    (["--reproducible"], "--reproducible only applies when sampling"),
    (["--no-spec", "--recalibrate"], "--recalibrate has no effect with --no-spec"),
    (["--stop", "ok", "--stop", "\udcff"], "stop string 1 is not valid UTF-8"),  # $'\xff' in a shell's argv
])
def test_options_that_would_be_ignored_are_refused(capsys, argv, message):
    """Refused before any model loads (no --target here: loading would take the embedded pair)."""
    rc, err = run(capsys, "generate", "x", *argv)
    assert rc == 2 and message in one_line(err)


def test_theory_takes_alpha_from_one_place(capsys):
    rc, err = run(capsys, "theory", "--p", "0.7,0.3", "--q", "0.5,0.5", "--alpha", "0.3")
    assert rc == 2 and "--alpha and --p/--q both set alpha" in one_line(err)


def test_serve_checks_its_address_before_loading(capsys):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        rc, err = run(capsys, "serve", "--port", str(port), "--target", "/nonexistent")  # loading would fail later
    assert rc == 2 and f"cannot listen on 127.0.0.1 port {port}" in one_line(err) and "--port" in err
    rc, err = run(capsys, "serve", "--host", "no-such-host.invalid", "--target", "/nonexistent")
    assert rc == 2 and "--host no-such-host.invalid: cannot resolve it" in one_line(err)


def test_bench_checks_its_method_names_before_loading(capsys, tmp_path):
    """A --methods prefix no method can start with is refused at once (the target does not even exist);
    "auto" and "llama.cpp p" pass this check (and "--target /nonexistent" fails next, the control)."""
    rc, err = run(capsys, "bench", "--out", str(tmp_path / "r"), "--target", "/nonexistent", "--methods", "auto",
                  "atuo")
    assert rc == 2 and one_line(err).endswith("--methods: no method starts with 'atuo'; method names start with "
                                              "plain, model, auto, lookup, suffix, hf, llama.cpp")
    assert not (tmp_path / "r").exists()  # refused before the output directory was made
    rc, err = run(capsys, "bench", "--out", str(tmp_path / "r"), "--target", "/nonexistent", "--methods", "Auto",
                  "llama.cpp p", "model K=2")
    assert rc == 2 and "--methods" not in one_line(err) and "'/nonexistent' does not exist" in one_line(err)


def test_bench_checks_its_output_directory_before_loading(capsys, tmp_path):
    a_file = tmp_path / "results"
    a_file.write_text("")
    rc, err = run(capsys, "bench", "--out", str(a_file), "--target", "/nonexistent")
    assert rc == 2 and f"--out {str(a_file)!r} is a file: give a directory" in one_line(err)


@pytest.mark.parametrize("flag, says", [(["--verify", "token", "block"], "--verify block adds methods"),
                                        (["--tree", "2"], "--tree 2 adds methods")])
def test_bench_refuses_a_flag_whose_methods_it_would_not_run(capsys, tmp_path, model_dirs, flag, says):
    """--verify block / --tree N only add methods: with --methods plain they were silently ignored (the
    whole plain benchmark ran)."""
    rc, err = run(capsys, "bench", "--out", str(tmp_path / "r"), "--target", model_dirs[0], "--draft", model_dirs[1],
                  "--no-hf", "--methods", "plain", *flag)
    assert rc == 2 and says in one_line(err)


@pytest.mark.parametrize("argv, message", [
    (["--drafter", "lookup"], "--drafter has no effect on bench"),
    (["--draft-confidence", "0.3"], "--draft-confidence has no effect on bench"),
    (["--draft-vocab", "9"], "--draft-vocab has no effect on bench"),
    (["--recalibrate"], "--recalibrate has no effect on bench"),
])
def test_bench_refuses_draft_options_it_would_not_read(capsys, tmp_path, argv, message):
    rc, err = run(capsys, "bench", "--out", str(tmp_path / "r"), "--target", "/nonexistent", *argv)
    assert rc == 2 and message in one_line(err)


def test_bench_refuses_an_empty_out_and_switched_off_methods(capsys, tmp_path, model_dirs, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, err = run(capsys, "bench", "--out", "", "--target", "/nonexistent")  # it wrote into the current directory
    assert rc == 2 and "--out is empty" in one_line(err) and not list(tmp_path.iterdir())
    rc, err = run(capsys, "bench", "--out", "r", "--target", model_dirs[0], "--draft", model_dirs[1], "--no-hf",
                  "--methods", "hf")  # it loaded the models first, then said no method starts with 'hf'
    assert rc == 2 and "--methods hf: these methods are off in this run; add --hf" in one_line(err)


def test_an_invalid_utf8_prompt_is_one_line(capsys, model_dirs):
    """argv holds invalid UTF-8 as lone surrogates (surrogateescape): the tokenizer raised a TypeError."""
    rc, err = run(capsys, "generate", "a\udcffb", "--target", model_dirs[0], "--draft", model_dirs[1],
                  "--dtype", "float32", "--max-new-tokens", "4")
    assert rc == 2 and "the prompt is not valid UTF-8" in one_line(err)


def test_draft_vocab_ignores_special_ids_past_the_models_logits(capsys, model_dirs):
    """The tiny tokenizer's special ids are 0, 1 and 86, and its models have 86 logits: --draft-vocab
    failed with "keep must hold token ids in [0, 86)", whatever N."""
    rc, err = run(capsys, "generate", "hello", "--target", model_dirs[0], "--draft", model_dirs[1], "--dtype",
                  "float32", "--draft-vocab", "50", "--max-new-tokens", "6", "--json")
    assert rc == 0, err


def test_an_unknown_option_is_named_by_its_command(capsys):
    """argparse reported it from the top, pointing at `specdecode --help` for a theory option."""
    rc, err = run(capsys, "theory", "--alpha", "0.5", "--bogus")
    assert rc == 2 and one_line(err).endswith("specdecode theory: unrecognized arguments: --bogus "
                                              "(see `specdecode theory --help`)")


def test_a_prompt_that_starts_with_a_dash_is_told_to_follow_dashes(capsys):
    """argparse reads the prompt "-x" as an option and says only that the prompt is missing."""
    rc, err = run(capsys, "generate", "-x", "--max-new-tokens", "3")
    line = one_line(err)
    assert rc == 2 and "specdecode generate [options] -- -x " in line, line
    rc, err = run(capsys, "generate", "--max-new-tokens", "3")  # control: no dashed word, no such advice
    line = one_line(err)
    assert rc == 2 and "required: prompt" in line and " -- " not in line, line


def test_bad_input_met_in_a_bench_worker_is_one_line(capsys, tmp_path):
    """The bench loads models in worker processes; a ValueError there (here the calibration text does not fit
    a 32-token context) came back as a RuntimeError with two tracebacks, exit 1."""
    small = save_pair(tmp_path / "models", seed=5, scale=0.4, noise=0.05, max_len=32)
    capsys.readouterr()  # the save's progress bars
    rc, err = run(capsys, "bench", "--quick", "--out", str(tmp_path / "r"), "--target", small[0], "--draft", small[1],
                  "--dtype", "float32", "--methods", "plain")
    assert rc == 2 and "tokens exceed the context of 32" in one_line(err)
