"""Cheaper drafts: int8 weights and a restricted head approximate the draft, and stay exact."""

import pytest
import torch
from torch import nn

from specdecode.backends.cheap import Int8Linear, RestrictedHead, frequent_tokens, quantize_int8, restrict_head
from specdecode.backends.hf import HFModel
from specdecode.core.probs import GREEDY
from specdecode.drafters.model import ModelDrafter
from specdecode.engine.config import GenerationConfig
from specdecode.engine.engine import generate_tokens
from tests.tiny import tiny_model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_close_to_linear(dtype):
    g = torch.Generator().manual_seed(0)
    lin = nn.Linear(64, 48).to(dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(48, 64, generator=g))
    q = Int8Linear(lin)
    x = torch.randn(3, 5, 64, generator=g).to(dtype)
    ref, out = lin(x).float(), q(x).float()
    assert out.shape == ref.shape
    assert (out - ref).norm() / ref.norm() < 0.02
    assert q.weight_int8.dtype == torch.int8


def test_restricted_head_masks_other_tokens():
    g = torch.Generator().manual_seed(0)
    head = nn.Linear(16, 10, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(10, 16, generator=g))
    keep = torch.tensor([0, 3, 7])
    r = RestrictedHead(head, keep, 10)
    h = torch.randn(2, 16, generator=g)
    out = r(h)
    assert out.shape == (2, 10) and r.out_features == 10
    assert torch.allclose(out[:, keep], head(h)[:, keep], atol=1e-5)
    mask = torch.ones(10, dtype=torch.bool)
    mask[keep] = False
    assert torch.isinf(out[:, mask]).all()


def test_frequent_tokens_includes_always():
    keep = frequent_tokens(1000, 10, always=torch.tensor([999, 5]))
    assert keep.tolist() == list(range(10)) + [999]


def test_restrict_head_validates_ids():
    model = tiny_model(20, seed=0, dtype=torch.float32)
    with pytest.raises(ValueError, match="token ids"):
        restrict_head(model, torch.tensor([25]))


def test_cheap_draft_keeps_greedy_identity():
    target_model = tiny_model(40, seed=5, dtype=torch.float32)
    draft_model = tiny_model(40, seed=6, base=target_model, noise=0.05, dtype=torch.float32)
    quantize_int8(restrict_head(draft_model, frequent_tokens(40, 25)))
    target, draft = HFModel(target_model, "t"), HFModel(draft_model, "d")
    assert draft.vocab_size == 40
    for prompt in ([1, 2, 3], [7, 8, 9, 10, 11]):
        config = GenerationConfig(max_new_tokens=30, sampling=GREEDY, k=4)
        spec = [t for r in generate_tokens(target, [ModelDrafter(draft)], prompt, config, frozenset()) for t in r.tokens]
        plain = [t for r in generate_tokens(target, [], prompt, config, frozenset()) for t in r.tokens]
        assert spec == plain
