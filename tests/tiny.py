"""Tiny random causal LMs and a character tokenizer, built in-process (nothing downloaded)."""

from __future__ import annotations

import string

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from specdecode.backends.hf import HFModel

CHARS = string.ascii_letters + string.digits + " .,:;!?()[]{}=+-*/_'\"\n"
SPECIALS = ["<eos>", "<unk>"]
CHAT_TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}[assistant]{% endif %}")


def char_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIALS + list(CHARS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_model(vocab: int, seed: int, layers: int = 2, hidden: int = 32, scale: float = 0.6,
               dtype: torch.dtype = torch.float64, base: Qwen2ForCausalLM | None = None,
               noise: float = 0.0, max_len: int = 256) -> Qwen2ForCausalLM:
    """Random weights from an explicit generator. With `base`, copy its weights plus `noise`
    (a draft that agrees with the target often, so multi-token acceptance gets exercised)."""
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max_len, tie_word_embeddings=False, eos_token_id=0)
    model = Qwen2ForCausalLM(config).to(dtype).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        params = dict(model.named_parameters())
        source = dict(base.named_parameters()) if base is not None else {}
        for name, p in params.items():
            if name in source:
                p.copy_(source[name] + noise * torch.randn(p.shape, generator=g, dtype=dtype))
            elif "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=dtype) * scale)
    return model


def tiny_pair(vocab: int = len(SPECIALS) + len(CHARS), seed: int = 0, noise: float = 0.15,
              dtype: torch.dtype = torch.float64, scale: float = 0.6) -> tuple[HFModel, HFModel]:
    """scale ~0.6 gives peaked next-token distributions, ~0.15 flat-ish ones (for sampling tests)."""
    target = tiny_model(vocab, seed, dtype=dtype, scale=scale)
    draft = tiny_model(vocab, seed + 1000, base=target, noise=noise, dtype=dtype)
    return HFModel(target, "tiny-target"), HFModel(draft, "tiny-draft")


def save_pair(root, seed: int, scale: float = 0.4, noise: float = 0.05, max_len: int = 256) -> tuple[str, str]:
    """A float32 tiny target and a close draft saved as transformers directories (for CLI/server tests)."""
    vocab = len(SPECIALS) + len(CHARS)
    target = tiny_model(vocab, seed=seed, dtype=torch.float32, scale=scale, max_len=max_len)
    draft = tiny_model(vocab, seed=seed + 1, base=target, noise=noise, dtype=torch.float32, max_len=max_len)
    dirs = []
    for name, model in [("target", target), ("draft", draft)]:
        model.save_pretrained(root / name)
        char_tokenizer().save_pretrained(root / name)
        dirs.append(str(root / name))
    return dirs[0], dirs[1]
