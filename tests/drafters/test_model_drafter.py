"""The draft-model drafter never runs past its own context, which may be shorter than the target's."""

import json

import torch

from specdecode.backends.hf import HFModel
from specdecode.cli import main
from specdecode.core.probs import SamplingParams
from specdecode.drafters.model import ModelDrafter
from tests.tiny import CHARS, SPECIALS, char_tokenizer, tiny_model

VOCAB = len(SPECIALS) + len(CHARS)


def _drafter(max_len: int) -> ModelDrafter:
    return ModelDrafter(HFModel(tiny_model(VOCAB, seed=3, max_len=max_len), "tiny-draft"))


def test_k_is_cut_to_the_drafts_room():
    drafter = _drafter(64)
    greedy, g = SamplingParams(), torch.Generator().manual_seed(0)
    for n, expected in [(40, 8), (60, 5), (64, 1)]:
        drafter.reset()
        proposal = drafter.propose(list(range(2, 2 + n)), 8, greedy, g)
        assert len(proposal.tokens) == expected and proposal.q.shape[0] == expected
        assert drafter.model.length <= 64


def test_no_room_for_the_context_proposes_nothing():
    drafter = _drafter(64)
    proposal = drafter.propose([5] * 65, 4, SamplingParams(), torch.Generator().manual_seed(0))
    assert proposal.tokens == [] and proposal.q is None


def test_a_draft_with_a_shorter_context_degrades_gracefully(tmp_path, capsys):
    """Target context 256, draft context 48: a 100-token prompt drafts nothing (plain steps), a
    30-token prompt drafts until the draft is full, then continues plainly; output = plain decoding."""
    target = tiny_model(VOCAB, seed=21, dtype=torch.float32, scale=0.4, max_len=256)
    draft = tiny_model(VOCAB, seed=22, base=target, noise=0.05, dtype=torch.float32, max_len=48)
    for name, model in [("target", target), ("draft", draft)]:
        model.save_pretrained(tmp_path / name)
        char_tokenizer().save_pretrained(tmp_path / name)
    for prompt in ["def f(x):\n    return x" * 4 + "def g", ("a = b + c\n" * 10)[:100]]:
        base = ["generate", prompt, "--target", str(tmp_path / "target"), "--dtype", "float32",
                "--max-new-tokens", "40", "--json"]
        docs = []  # plain decoding refuses a draft model it would not load
        for extra in [["--draft", str(tmp_path / "draft"), "--drafter", "model", "--k", "4"], ["--no-spec"]]:
            assert main(base + extra) == 0
            docs.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
        assert docs[0]["text"] == docs[1]["text"]
        assert docs[0]["stats"]["new_tokens"] == docs[1]["stats"]["new_tokens"]


def test_a_prompt_that_fits_the_target_is_not_refused_by_the_draft(tmp_path, capsys):
    """Target context 512, draft 256: a 255-token prompt used to fail with 'draft: 257 tokens exceed
    the context of 256' (drafting ran past the draft's end)."""
    target = tiny_model(VOCAB, seed=31, dtype=torch.float32, scale=0.4, max_len=512)
    draft = tiny_model(VOCAB, seed=32, base=target, noise=0.05, dtype=torch.float32, max_len=256)
    for name, model in [("target", target), ("draft", draft)]:
        model.save_pretrained(tmp_path / name)
        char_tokenizer().save_pretrained(tmp_path / name)
    prompt = ("x = 1\n" * 50)[:255]
    assert len(char_tokenizer().encode(prompt)) == 255
    rc = main(["generate", prompt, "--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"),
               "--dtype", "float32", "--max-new-tokens", "1", "--drafter", "model", "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert json.loads(out.out.strip().splitlines()[-1])["stats"]["new_tokens"] == 1


def test_lag_counts_the_tokens_a_separate_catch_up_pass_would_feed():
    from specdecode.core.probs import GREEDY
    from specdecode.drafters.model import ModelDrafter
    from tests.tiny import tiny_pair

    _, draft = tiny_pair(vocab=40, seed=3)
    drafter = ModelDrafter(draft)
    context = list(range(1, 21))
    assert drafter.lag(context) == 19  # nothing fed yet: all but the last token
    proposal = drafter.propose(context, 3, GREEDY, torch.Generator().manual_seed(0))
    accepted = context + proposal.tokens[:1] + [7]  # one draft accepted, then a correction
    assert drafter.lag(accepted) == 0  # in sync: the first draft step feeds the new tokens
    assert drafter.lag(accepted + list(range(5))) == 5  # sat out five plain steps: 6 new tokens, the last fed by the step


def test_cells_a_failed_pass_left_in_the_draft_cache_are_dropped():
    """A pass that failed after writing (its row's cells are in the cache, the drafter never heard of
    them) must not shift the next draft: it drafts what a fresh drafter drafts."""
    drafter, fresh = (ModelDrafter(HFModel(tiny_model(VOCAB, seed=3, max_len=64, dtype=torch.float64), "tiny-draft"))
                      for _ in range(2))
    params = SamplingParams(temperature=0.8)
    context = list(range(2, 22))
    first = drafter.propose(context, 3, params, torch.Generator().manual_seed(1)).tokens
    drafter.model.forward([7, 8, 9], n_logits=1)  # what a failed round's pass left behind
    context += first[:2] + [5]  # every draft it fed was accepted: in sync but for the stray cells
    expected = fresh.propose(context, 4, params, torch.Generator().manual_seed(0))
    got = drafter.propose(context, 4, params, torch.Generator().manual_seed(0))
    assert got.tokens == expected.tokens and torch.allclose(got.q, expected.q, rtol=0, atol=1e-12)
    assert drafter.model.length == len(context) + 3  # the context and 3 of the 4 drafts (the last is not fed)
