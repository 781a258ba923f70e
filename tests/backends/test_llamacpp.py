"""The llama.cpp backend on the embedded GGUF target (slow: loads the real 1.5B model, seconds).

Batched and one-token kernels round differently in llama.cpp, so a K-token pass is
compared with K one-token passes within a tolerance, and greedy speculative output is
checked against plain output on this backend up to numerical ties (each divergence
must sit where the target's top two logits are within a small margin). Token identity
itself is proved on the transformers backend in float32/float64.
"""

import numpy as np
import pytest
import torch

from specdecode.backends.llamacpp import LlamaCppModel, LlamaSettings, LlamaWeights
from specdecode.backends.weights import TARGET, ensure_gguf, gguf_tokenizer
from specdecode.bench.harness import PROMPT_SETS, load_prompts
from specdecode.core.probs import GREEDY
from specdecode.drafters.lookup import LookupDrafter
from specdecode.engine.config import GenerationConfig
from specdecode.engine.decoder import SpeculativeDecoder
from specdecode.engine.engine import generate_tokens

pytestmark = pytest.mark.slow

CODE = "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n    pivot = arr[len(arr) // 2]\n"


@pytest.fixture(scope="module")
def weights():
    return LlamaWeights(ensure_gguf(TARGET, progress=False), "target")


@pytest.fixture(scope="module")
def tokenizer():
    return gguf_tokenizer(ensure_gguf(TARGET, progress=False))


@pytest.fixture(scope="module")
def model(weights):
    return LlamaCppModel(weights, LlamaSettings(n_ctx=1024))


def test_tokenizer_agrees_with_llamacpp_on_every_prompt(weights, tokenizer):
    """One tokenizer for both engines: ids and detokenised text agree on all prompt sets."""
    texts = [CODE, "héllo wörld 你好 🙂\n\t  x"]
    for name in PROMPT_SETS:
        for item in load_prompts(name):
            texts.append(item["prompt"])
            messages = [{"role": "user", "content": item["prompt"]}]
            texts.append(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    for text in texts:
        ids = tokenizer.encode(text)
        assert weights.tokenize(text) == ids, text[:60]
        assert weights.detokenize(ids) == tokenizer.decode(ids) == text


def test_k_token_pass_matches_one_token_passes(model, tokenizer):
    ids = tokenizer.encode(CODE)
    model.truncate(0)
    model.forward(ids[:-6], n_logits=1)
    start = model.length
    batched = model.forward(ids[-6:], n_logits=6)
    model.truncate(start)
    single = torch.cat([model.forward([t], n_logits=1) for t in ids[-6:]])
    assert batched.shape == single.shape == (6, model.vocab_size)
    diff = (batched - single).abs().max().item()
    # rounding of batched vs one-token kernels: llama.cpp quantises activations per pass, up to
    # ~0.6 (LlamaCppModel.logit_tolerance; 0.502 measured on one build of 0.3.36); a wrong position
    # or cache would move logits by whole units
    assert diff < 0.75, f"max |logit difference| {diff}"
    assert (batched.argmax(-1) == single.argmax(-1)).all()


def test_rollback_then_reforward_equals_fresh(model, tokenizer):
    ids = tokenizer.encode(CODE)
    model.truncate(0)
    model.forward(ids[:-4], n_logits=1)
    fresh = model.forward(ids[-4:], n_logits=4)
    model.truncate(len(ids) - 4)  # reject all four
    model.forward([1, 2, 3], n_logits=3)  # something else in their place
    model.truncate(len(ids) - 4)
    again = model.forward(ids[-4:], n_logits=4)
    assert torch.equal(fresh, again)
    assert model.length == len(ids)


def test_errors_are_clear(model):
    with pytest.raises(ValueError, match="exceed the context"):
        model.truncate(0)
        model.forward([1] * (model.max_length + 1))
    with pytest.raises(ValueError, match="cannot truncate"):
        model.truncate(model.length + 1)
    with pytest.raises(ValueError, match="does not exist"):
        LlamaWeights("/nonexistent/model.gguf")
    # llama.cpp would abort the process (an output slot per sequence id) instead of raising
    with pytest.raises(ValueError, match="n_batch=8 is below the context's 9 sequence ids"):
        LlamaCppModel(model.weights, LlamaSettings(n_ctx=256, n_batch=8, tree_leaves=8))
    # a prompt longer than --n-ctx allows said "shorten the prompt", even for a 1-token prompt in --n-ctx 1
    # (and a context of n_ctx=1 alone aborted the process in llama.cpp: a pool smaller than its sequence ids)
    with pytest.raises(ValueError, match=r"context of 1 \(the prompt and one new token.*or raise n_ctx$"):
        generate_tokens(LlamaCppModel(model.weights, LlamaSettings(n_ctx=1)), [], [1], GenerationConfig(), frozenset())
    # beyond the trained context llama.cpp aborted (2^32 + 7 wrapped into a 32-bit field), or ran out of memory
    trained = model.weights.n_ctx_train
    with pytest.raises(ValueError, match=f"n_ctx must be 0 .* trained context of {trained} tokens"):
        LlamaCppModel(model.weights, LlamaSettings(n_ctx=2 ** 32 + 7))
    with pytest.raises(ValueError, match="trained context"):
        LlamaCppModel(model.weights, LlamaSettings(n_ctx=trained + 1))


@pytest.fixture(scope="module")
def decoder():
    return SpeculativeDecoder.load(backend="llama.cpp", n_ctx=2048, progress=False)


def _margin(decoder, context: list[int]) -> float:
    """Top-1 minus top-2 logit of the target's next token after `context` (one-token passes)."""
    target = decoder.target
    target.truncate(0)
    logits = target.forward(context, n_logits=1)[0]
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


@pytest.mark.parametrize("item", load_prompts("codegen")[:2] + load_prompts("codeedit")[:1], ids=lambda i: i["id"])
def test_greedy_speculative_equals_plain_up_to_ties(decoder, item):
    config = GenerationConfig(max_new_tokens=48, sampling=GREEDY, k=4)
    ids = decoder.encode(item["prompt"], item["chat"])
    plain = decoder.generate_ids(ids, config, speculative=False)
    spec = decoder.generate_ids(ids, config)
    at = next((i for i, (a, b) in enumerate(zip(plain, spec)) if a != b), None)
    if at is not None:  # only a near-tie of the target may part them
        assert _margin(decoder, ids + plain[:at]) < 0.25, f"diverged at token {at} without a tie"
    else:
        assert plain == spec


def test_drafting_is_exercised_and_auto_uses_lookup(decoder):
    """The default decoder on llama.cpp drafts with lookup when the output copies the prompt."""
    assert [d.name for d in decoder.drafters] == ["lookup", "model"]
    item = load_prompts("codeedit")[0]
    result = decoder.generate(item["prompt"], GenerationConfig(max_new_tokens=64, sampling=GREEDY, k=4),
                              chat=item["chat"])
    assert result.stats.drafted > 0 and result.stats.accepted > 0
    assert any(r.drafter == "lookup" and r.drafted >= 2 for r in result.stats.rounds)


def test_lookup_only_decoder_loads_no_draft(decoder):
    lookup = SpeculativeDecoder(decoder.target, decoder.tokenizer, [LookupDrafter()])
    out = lookup.generate(CODE, GenerationConfig(max_new_tokens=8, sampling=GREEDY, k=3))
    assert len(out.tokens) == 8 and np.isfinite(out.stats.alpha or 0.0)


def test_sequences_of_one_context_share_a_pass(weights, tokenizer):
    """Rows of three sequences (ragged: 1, 4 and 6 tokens) in one llama_decode give each row the
    logits it gets alone (up to batched-kernel rounding), and roll back on their own."""
    first = LlamaCppModel(weights, LlamaSettings(n_ctx=512, n_seq_max=3))
    views = [first, first.sibling(), first.sibling()]
    with pytest.raises(ValueError, match="all 3 sequences"):
        first.sibling()
    prompts = [tokenizer.encode(t) for t in (CODE, "import os\nimport sys\n\ndef main():\n", "# a comment about sorting\nx = [3, 1, 2]\n")]
    sizes = [1, 4, 6]
    alone = []
    for view, ids, n in zip(views, prompts, sizes):
        view.forward(ids[:-n], n_logits=1)
        alone.append(view.forward(ids[-n:], n_logits=n))
        view.truncate(len(ids) - n)
    batched = views[0].forward_batch([(v, ids[-n:], n) for v, ids, n in zip(views, prompts, sizes)])
    for a, b in zip(alone, batched):
        # llama.cpp quantises activations per pass: rounding moves logits (scale ~20) by up to ~0.6
        assert a.shape == b.shape and (a - b).abs().max().item() < 1.0
        # the batched top token is the solo top token, or a near-tie of it
        gap = a.max(-1).values - a.gather(-1, b.argmax(-1, keepdim=True)).squeeze(-1)
        assert (gap < 0.25).all() and (a.argmax(-1) == b.argmax(-1)).sum() >= len(a) - 1
    assert [v.length for v in views] == [len(ids) for ids in prompts]
    views[1].truncate(2)  # one sequence rolls back; the others keep their caches
    assert [v.length for v in views] == [len(prompts[0]), 2, len(prompts[2])]
    again = views[0].forward_batch([(views[0], [11], 1), (views[2], [11], 1)])
    views[0].truncate(len(prompts[0]))
    views[2].truncate(len(prompts[2]))
    assert torch.allclose(again[0], views[0].forward([11], 1), atol=1.0)


def test_a_snapshot_restores_a_sequence_into_itself_or_a_sibling(weights, tokenizer):
    """snapshot/restore (the prompt cache): the restored sequence holds the same positions and gives
    the logits a prefill gives (up to the rounding that the cells' place in the cache brings, as
    with batching), also after the original sequence has moved on."""
    first = LlamaCppModel(weights, LlamaSettings(n_ctx=512, n_seq_max=2))
    second = first.sibling()
    ids = tokenizer.encode(CODE)
    first.forward(ids[:-1], n_logits=1)
    snap = first.snapshot()
    assert snap.length == len(ids) - 1 and snap.nbytes > 1000 * snap.length  # ~28 KB a token
    fresh = first.forward([ids[-1]], n_logits=1)
    first.forward([11, 12, 13], n_logits=1)  # the original moves on
    for view in (second, first):
        view.restore(snap)
        assert view.length == len(ids) - 1
        again = view.forward([ids[-1]], n_logits=1)
        assert again.argmax() == fresh.argmax() and (again - fresh).abs().max().item() < 1.0
    assert second.forward([5], 1).shape == (1, weights.n_vocab)  # the two sequences stay apart
    with pytest.raises(ValueError, match="not a snapshot"):
        first.restore(snap._replace(data=b"junk"))


@pytest.fixture(scope="module")
def batch_decoder():
    return SpeculativeDecoder.load(backend="llama.cpp", drafter="lookup", n_ctx=1024, max_batch=3, progress=False)


def test_batched_greedy_equals_solo_up_to_ties(batch_decoder):
    """Four prompts through three slots (continuous admission), K = 3: each output equals its solo
    run, or parts from it only at a near-tie of the target (batched kernels round differently)."""
    items = load_prompts("codegen")[:2] + load_prompts("codeedit")[:2]
    config = GenerationConfig(max_new_tokens=32, sampling=GREEDY, k=3)
    ids = [batch_decoder.encode(i["prompt"], i["chat"]) for i in items]
    prompts = [[{"role": "user", "content": i["prompt"]}] if i["chat"] else i["prompt"] for i in items]
    batched = batch_decoder.generate_many(prompts, config)
    assert any(r.drafted >= 2 for b in batched for r in b.stats.rounds)
    for prompt, b in zip(ids, batched):
        solo = batch_decoder.generate_ids(prompt, config)
        at = next((i for i, (x, y) in enumerate(zip(solo, b.tokens)) if x != y), None)
        if at is None:
            assert solo == b.tokens
        else:
            assert _margin(batch_decoder, prompt + solo[:at]) < 0.25, f"diverged at token {at} without a tie"


def test_tree_pass_matches_its_chains_and_keeps_the_accepted_path(weights, tokenizer):
    """A draft tree in one llama_decode (scratch sequence id per leaf), beside another sequence's
    row: each node's logits are its chain's (up to batched-kernel rounding); accept_path leaves the
    cache of prefix + path, the rest of the tree is gone, and the neighbour is untouched."""
    first = LlamaCppModel(weights, LlamaSettings(n_ctx=512, n_seq_max=2, tree_leaves=4))
    neighbour = first.sibling()
    ids = tokenizer.encode(CODE)
    other = tokenizer.encode("import os\nimport sys\n")
    first.forward(ids[:-1], 1)
    neighbour.forward(other[:-1], 1)
    tokens, parents = [ids[-1], 100, 200, 300, 400, 500, 600], [-1, 0, 0, 0, 1, 1, 4]
    tree_logits, neighbour_logits = first.forward_batch([(first, tokens, len(tokens), parents),
                                                         (neighbour, other[-1:], 1)])
    reference = LlamaCppModel(weights, LlamaSettings(n_ctx=512, tree_leaves=0))

    def chain(path):
        reference.truncate(0)
        reference.forward(ids[:-1], 1)
        return reference.forward(path, len(path))[-1]

    for j, path in enumerate([[0], [0, 1], [0, 2], [0, 3], [0, 1, 4], [0, 1, 5], [0, 1, 4, 6]]):
        assert (tree_logits[j] - chain([tokens[i] for i in path])).abs().max().item() < 1.0, j
    with pytest.raises(ValueError, match="not a root-to-node path"):
        first.accept_path([0, 2, 4])
    first.accept_path([0, 1, 4, 6])
    assert first.length == len(ids) + 3
    after = first.forward([7], 1)[0]
    assert (after - chain([ids[-1], 100, 400, 600, 7])).abs().max().item() < 1.0
    reference.truncate(0)
    reference.forward(other[:-1], 1)
    assert (neighbour_logits[0] - reference.forward(other[-1:], 1)[0]).abs().max().item() < 1.0
    first.truncate(len(ids) - 1)  # a tree whose every candidate fails keeps the root only
    first.forward_tree(tokens, parents)
    first.accept_path([0])
    assert first.length == len(ids)
    assert (first.forward([9], 1)[0] - chain([ids[-1], 9])).abs().max().item() < 1.0
    too_wide = [ids[-1]] + list(range(10, 15)), [-1, 0, 0, 0, 0, 0]
    with pytest.raises(ValueError, match="tree_leaves >= 5"):
        first.forward_tree(*too_wide)


CHILD = """
import sys
from specdecode.backends.llamacpp import LlamaWeights
from specdecode.backends.weights import DRAFT, ensure_gguf
path = ensure_gguf(DRAFT, progress=False)
print("ready", flush=True)
kept = []  # kept loaded: a free between loads is not what this measures
try:
    for _ in range(8):
        kept.append(LlamaWeights(path))
    print("not interrupted", flush=True)
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


def test_ctrl_c_during_a_load_is_not_lost():
    """While llama.cpp loads weights the only Python code that runs is its log callback (a line per tensor),
    so a Ctrl-C raised its KeyboardInterrupt in there, where ctypes swallows it: a process loading in a
    loop ignored 5 Ctrl-Cs of 5. Held back over the load, the key counts as the load returns. (The loop
    keeps what it loaded: the weights' free runs the log callback too, outside any load, where a
    generation never frees them.)"""
    import signal
    import subprocess
    import sys
    import time

    # SIGINT as a terminal leaves it: a background job of a non-interactive shell (a CI runner's, maybe)
    # inherits it ignored, and Python keeps it so
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert child.stdout.readline().strip() == "ready"
        time.sleep(1.0)  # inside a load, nearly all of the time
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=30)
    finally:
        child.kill()
    assert out.strip() == "interrupted" and "Exception ignored" not in err, (out, err)
