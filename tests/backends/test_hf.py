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


def _sliding_config(cls, **kw):
    return cls(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=1, max_position_embeddings=64, **kw)


def test_sliding_window_model_is_refused_with_the_fix():
    """A sliding-window cache cannot crop once its window fills: refuse at construction, naming
    the model and the fix (the unguarded crop raised mid-generation)."""
    from transformers import MistralConfig, MistralForCausalLM
    model = MistralForCausalLM(_sliding_config(MistralConfig, sliding_window=4)).eval()
    with pytest.raises(ValueError, match=r"mistral-sw uses sliding-window attention \(window 4 in 2 of 2.*config\.json"):
        HFModel(model, "mistral-sw")


def test_inactive_sliding_window_is_accepted():
    """Qwen2 configs carry sliding_window but use_sliding_window=False: full attention, accepted;
    with use_sliding_window=True on some layers it is refused."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    inactive = HFModel(Qwen2ForCausalLM(_sliding_config(Qwen2Config, sliding_window=4)).eval(), "qwen2")
    inactive.forward(list(range(8)), 1)
    inactive.truncate(6)  # crop past the (inactive) window works
    assert inactive.length == 6
    active = Qwen2ForCausalLM(_sliding_config(Qwen2Config, sliding_window=4, use_sliding_window=True,
                                              max_window_layers=1)).eval()
    with pytest.raises(ValueError, match="window 4 in 1 of 2"):
        HFModel(active, "qwen2-sw")
