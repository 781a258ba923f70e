"""The transformers backend: cache rollback is exact and cheap; limits give clear errors."""

import pytest
import torch

from specdecode.backends.hf import HFModel, resolve_dtype
from specdecode.backends.protocol import Model
from tests.tiny import tiny_model


@pytest.fixture(scope="module")
def model():
    return HFModel(tiny_model(50, seed=3), "tiny")


def test_implements_protocol(model):
    assert isinstance(model, Model)
    assert model.vocab_size == 50 and model.max_length == 256


def test_truncate_then_reforward_equals_fresh(model):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 50, (40,), generator=g).tolist()
    model.truncate(0)
    fresh = model.forward(tokens, n_logits=40)
    for cut in [1, 7, 20, 39]:
        model.truncate(0)
        model.forward(tokens, n_logits=1)
        model.forward([1, 2, 3], n_logits=1)  # junk that must be rolled back
        model.truncate(cut)
        assert model.length == cut
        again = model.forward(tokens[cut:], n_logits=40 - cut)
        assert torch.allclose(again, fresh[cut:], atol=1e-10, rtol=0), cut


def test_incremental_equals_one_pass(model):
    tokens = list(range(10, 30))
    model.truncate(0)
    one_pass = model.forward(tokens, n_logits=20)
    model.truncate(0)
    steps = torch.cat([model.forward([t], 1) for t in tokens])
    assert torch.allclose(steps, one_pass, atol=1e-10, rtol=0)


def test_errors(model):
    model.truncate(0)
    model.forward([1, 2, 3])
    with pytest.raises(ValueError, match="cannot truncate"):
        model.truncate(5)
    with pytest.raises(ValueError, match="context"):
        model.forward(list(range(50)) * 6)
    with pytest.raises(ValueError, match="n_logits"):
        model.forward([1], n_logits=2)
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("float8", "cpu")
