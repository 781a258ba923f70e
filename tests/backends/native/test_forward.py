"""The native forward pass on a tiny Qwen2 GGUF: against a plain numpy oracle (tests/backends/native/
tiny.py), on every kernel path; and the cache's contract: a K-token pass equals K one-token passes,
a batch equals its rows alone, rollback and trees and snapshots, bit for bit."""

import numpy as np
import pytest
import torch

from specdecode.backends.native import NativeModel, NativeSettings, NativeWeights, library
from specdecode.backends.protocol import Model, Row, Snapshot, forward_batch
from tests.backends.native import tiny

PATHS = library.cpu_paths()  # the fast paths this CPU runs, then "reference"


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    return tiny.build(tmp_path_factory.mktemp("native") / "tiny.gguf")


@pytest.fixture(scope="module")
def weights(gguf):
    return NativeWeights(gguf.path, NativeSettings(), "tiny")


def tokens(seed, n):
    return [int(t) for t in np.random.default_rng(seed).integers(0, tiny.VOCAB, n)]


def close_to(ours: np.ndarray, expected: np.ndarray) -> bool:
    """The native pass computes in float32, the oracle in float64, and both quantise every activation
    row to int8: where a value sits within float32 rounding of a .5 boundary the two round it apart,
    and a random tiny model carries such flips into every later row (~2 per pass here). Seen over 5
    prompts: at most 1.2% of the logits' range, 0.2% on average, argmax agreeing on >= 97.5% of rows.
    A real slip is far larger (negative controls below)."""
    scale = np.abs(expected).max()
    diff = np.abs(ours - expected)
    return bool(diff.max() <= 0.02 * scale and diff.mean() <= 0.005 * scale
                and (ours.argmax(-1) == expected.argmax(-1)).mean() >= 0.9)


@pytest.mark.parametrize("kernel", PATHS)
def test_logits_match_the_numpy_oracle(gguf, kernel):
    model = NativeModel(NativeWeights(gguf.path, NativeSettings(kernel=kernel), "tiny"))
    for seed in range(3):
        ids = tokens(seed, 40)
        ours = model.forward(ids, len(ids)).numpy()
        model.truncate(0)
        expected = tiny.forward(gguf, ids)
        assert np.abs(expected).max() > 5  # the model is not degenerate
        assert close_to(ours, expected), seed


@pytest.mark.parametrize("slip", ["rope positions doubled", "interleaved rope pairs", "no causal mask", "bias dropped"])
def test_the_oracle_comparison_catches_a_slip(gguf, monkeypatch, slip):
    """Negative controls: the oracle with one deliberate error must fail `close_to` (positions shifted
    all by one would not be an error: attention sees only their differences)."""
    if slip == "rope positions doubled":
        rope = tiny._rope
        monkeypatch.setattr(tiny, "_rope", lambda v, pos: rope(v, 2 * pos))
    elif slip == "interleaved rope pairs":
        rope = tiny._rope
        def interleaved(v, pos):
            order = np.r_[0:tiny.HEAD_DIM:2, 1:tiny.HEAD_DIM:2]
            return rope(v[..., order], pos)[..., np.argsort(order)]
        monkeypatch.setattr(tiny, "_rope", interleaved)
    elif slip == "no causal mask":
        monkeypatch.setattr(np, "triu_indices", lambda n, k: (np.array([], int), np.array([], int)))
    else:
        floats = dict(gguf.floats)
        floats["blk.0.attn_k.bias"] = np.zeros_like(floats["blk.0.attn_k.bias"])
        gguf = tiny.Tiny(gguf.path, gguf.quants, floats, gguf.tied)
    model = NativeModel(NativeWeights(gguf.path, NativeSettings(), "tiny"))
    ids = tokens(0, 40)
    assert not close_to(model.forward(ids, len(ids)).numpy(), tiny.forward(gguf, ids))


def test_tied_output_head(tmp_path):
    tied = tiny.build(tmp_path / "tied.gguf", seed=3, tied=True)
    model = NativeModel(NativeWeights(tied.path, NativeSettings(), "tied"))
    ids = tokens(2, 12)
    assert close_to(model.forward(ids, len(ids)).numpy(), tiny.forward(tied, ids))


def test_fast_paths_equal_the_reference_gemms(gguf):
    """The GEMMs of every path are the reference's bit for bit, so the whole pass is too (the float
    work outside them is the same code)."""
    ids = tokens(4, 25)
    fast = NativeModel(NativeWeights(gguf.path, NativeSettings(kernel=PATHS[0]), "tiny")).forward(ids, 25)
    reference = NativeModel(NativeWeights(gguf.path, NativeSettings(kernel="reference"), "tiny")).forward(ids, 25)
    assert torch.equal(fast, reference)


def test_a_k_token_pass_equals_k_one_token_passes(weights):
    ids = tokens(5, 30)
    whole = NativeModel(weights).forward(ids, len(ids))
    single = NativeModel(weights)
    singles = torch.cat([single.forward([t], 1) for t in ids])
    assert torch.equal(whole, singles)
    chunked = NativeModel(weights)
    parts = torch.cat([chunked.forward(ids[i:i + 7], len(ids[i:i + 7])) for i in range(0, 30, 7)])
    assert torch.equal(whole, parts)


def test_rollback_then_forward_again_is_bit_identical(weights):
    model = NativeModel(weights)
    ids = tokens(6, 20)
    model.forward(ids[:12], 1)
    first = model.forward(ids[12:], 8)
    model.truncate(12)
    assert model.length == 12
    model.forward([7, 8, 9], 3)  # something else in the rolled-back cells
    model.truncate(12)
    assert torch.equal(model.forward(ids[12:], 8), first)
    with pytest.raises(ValueError, match="cannot truncate"):
        model.truncate(100)


def test_a_batch_equals_its_rows_alone(weights):
    first = NativeModel(weights)
    models = [first] + [first.sibling() for _ in range(3)]
    prompts = [tokens(10 + i, 5 + 3 * i) for i in range(4)]
    alone = []
    for p in prompts:
        solo = NativeModel(weights)
        solo.forward(p, 1)
        alone.append(solo.forward([p[0], p[-1], 3], 2))
    for m, p in zip(models, prompts):
        m.forward(p, 1)
    together = forward_batch([Row(m, [p[0], p[-1], 3], 2) for m, p in zip(models, prompts)])
    for a, b in zip(alone, together):
        assert torch.equal(a, b)
    assert [m.length for m in models] == [len(p) + 3 for p in prompts]


def test_long_rows_go_in_pieces_with_the_same_logits(gguf):
    small = NativeWeights(gguf.path, NativeSettings(n_batch=8), "tiny")
    ids = tokens(7, 27)
    pieces = NativeModel(small).forward(ids, 12)  # 27 tokens in passes of 8; logits from the last two
    whole = NativeModel(NativeWeights(gguf.path, NativeSettings(), "tiny")).forward(ids, 12)
    assert torch.equal(pieces, whole)


def test_a_tree_pass_equals_its_paths_run_as_chains(weights):
    prompt = tokens(8, 10)
    tree_tokens = [5, 11, 12, 13, 21, 22]
    parents = [-1, 0, 1, 1, 0, 4]  # root 5 -> 11 -> (12 | 13), 5 -> 21 -> 22
    model = NativeModel(weights)
    model.forward(prompt, 1)
    logits = model.forward_tree(tree_tokens, parents)
    assert model.length == len(prompt) + 1  # the root joined the cache
    for node in range(len(tree_tokens)):
        path, j = [], node
        while j >= 0:
            path.append(j)
            j = parents[j]
        chain = NativeModel(weights)
        chain.forward(prompt, 1)
        expected = chain.forward([tree_tokens[i] for i in reversed(path)], len(path))[-1]
        assert torch.equal(logits[node], expected), node
    model.accept_path([0, 4, 5])
    assert model.length == len(prompt) + 3
    after = model.forward([9], 1)
    chain = NativeModel(weights)
    chain.forward(prompt + [5, 21, 22], 1)
    assert torch.equal(after, chain.forward([9], 1))
    with pytest.raises(ValueError, match="without a tree pass"):
        model.accept_path([0])
    model.forward_tree([1, 2], [-1, 0])
    with pytest.raises(ValueError, match="not a root-to-node path"):
        model.accept_path([0, 0])


def test_snapshot_restores_into_a_sibling(weights):
    model = NativeModel(weights)
    ids = tokens(9, 16)
    model.forward(ids, 1)
    snap = model.snapshot()
    assert snap.length == 16 and snap.nbytes > 0
    other = model.sibling()
    other.restore(snap)
    assert other.length == 16
    assert torch.equal(other.forward([4, 5], 2), model.forward([4, 5], 2))


def test_restore_refuses_what_is_not_a_copy_of_a_cache(weights):
    # a forged length or a short buffer once read past the copy (or crashed): refused before any byte is read
    model = NativeModel(weights)
    model.forward(tokens(3, 5), 1)
    snap = model.snapshot()
    other = model.sibling()
    data = snap.data[1]
    for forged in (Snapshot(-5, snap.data, snap.nbytes), Snapshot(4000, snap.data, snap.nbytes),
                   Snapshot(snap.length, (weights, data[:-1]), snap.nbytes - 1),
                   Snapshot(snap.length + 1, snap.data, snap.nbytes), "x"):
        with pytest.raises(ValueError, match="not a (snapshot|copy)"):
            other.restore(forged)
        assert other.length == 0
    other.restore(snap)
    assert other.length == 5


def test_a_cut_head_keeps_its_tokens_and_gives_the_rest_minus_infinity(gguf):
    keep = [0, 1, 2, 50, 299]
    cut = NativeModel(NativeWeights(gguf.path, NativeSettings(), "tiny", keep_tokens=keep))
    full = NativeModel(NativeWeights(gguf.path, NativeSettings(), "tiny"))
    ids = tokens(12, 9)
    a, b = cut.forward(ids, 3), full.forward(ids, 3)
    assert torch.equal(a[:, keep], b[:, keep])
    rest = np.setdiff1d(np.arange(tiny.VOCAB), keep)
    assert torch.isneginf(a[:, rest]).all()


def test_the_model_protocol(weights):
    model = NativeModel(weights)
    assert isinstance(model, Model)
    assert model.vocab_size == tiny.VOCAB and model.max_length == 512
    assert model.logit_tolerance == 0.0
    assert "native" in model.signature


def test_bad_input_is_refused_in_one_line(weights, gguf, tmp_path):
    model = NativeModel(weights)
    with pytest.raises(ValueError, match="not an integer in the vocabulary"):
        model.forward([tiny.VOCAB], 1)
    with pytest.raises(ValueError, match="not an integer in the vocabulary"):
        model.forward([1.7], 1)  # once run as token 1
    with pytest.raises(ValueError, match="n_logits"):
        model.forward([1, 2], 3)
    with pytest.raises(ValueError, match="exceed the context of 512"):
        model.forward([1] * 513, 1)
    with pytest.raises(ValueError, match="every other parent is an earlier token"):
        model.forward_tree([1, 2, 3], [-1, 2, 0])
    with pytest.raises(ValueError, match="at most once"):
        forward_batch([Row(model, [1], 1), Row(model, [2], 1)])
    with pytest.raises(ValueError, match="n_ctx must be 0"):
        NativeWeights(gguf.path, NativeSettings(n_ctx=10**6), "tiny")
    with pytest.raises(ValueError, match="n_threads must be"):
        NativeWeights(gguf.path, NativeSettings(n_threads=-1), "tiny")
    with pytest.raises(ValueError, match="unknown kernel"):
        NativeWeights(gguf.path, NativeSettings(kernel="mmx"), "tiny")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(gguf.path.read_bytes()[:-1000])
    with pytest.raises(ValueError, match="cut short|not a complete GGUF"):
        NativeWeights(cut, NativeSettings(), "cut")
    assert model.length == 0  # nothing half-written
