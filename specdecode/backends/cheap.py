"""Make a draft model cheaper per token without touching exactness.

Speculative decoding is exact for *any* draft, because q is whatever the draft
actually produced. So the draft may be approximated freely to raise c:

- `quantize_int8`: weight-only int8 for every nn.Linear (per-output-channel
  symmetric scales). Decoding on CPU is memory-bound, so halving the bytes read
  per token (vs bf16) is what buys speed.
- `restrict_head`: the output layer computes logits for a fixed subset of the
  vocabulary only; all other tokens get q = 0 (logit -inf). When the target wants
  one of them, the draft is rejected and the residual max(0, p - q) = p there
  supplies it, so the output law is unchanged.

These are for drafts only: applied to a target they would change the output.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel


class Int8Linear(nn.Module):
    """y = x W^T + b with W stored as int8 rows times a per-row scale."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
        self.register_buffer("weight_int8", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(linear.weight.dtype))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float32, torch.float16):
            y = torch.ops.aten._weight_int8pack_mm(x2, self.weight_int8, self.scale.to(x.dtype))
        else:  # portable fallback: dequantise on the fly
            y = nn.functional.linear(x2, self.weight_int8.to(x.dtype)) * self.scale.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*shape[:-1], self.out_features)


def quantize_int8(model: PreTrainedModel) -> PreTrainedModel:
    """Replace every nn.Linear of `model` (the output head included) by an Int8Linear, in place."""
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, child_name, Int8Linear(child))
    return model


class RestrictedHead(nn.Module):
    """Logits for `keep` token ids only; every other id gets -inf (probability 0)."""

    def __init__(self, head: nn.Module, keep: torch.Tensor, vocab_size: int) -> None:
        super().__init__()
        weight = _head_weight(head)
        self.sub = nn.Linear(weight.shape[1], len(keep), bias=False, dtype=weight.dtype, device=weight.device)
        with torch.no_grad():
            self.sub.weight.copy_(weight[keep])
        self.register_buffer("keep", keep.to(weight.device))
        self.out_features = vocab_size  # logits still span the whole vocabulary

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        sub = self.sub(hidden)
        out = torch.full((*hidden.shape[:-1], self.out_features), float("-inf"), dtype=sub.dtype, device=sub.device)
        out[..., self.keep] = sub
        return out


def restrict_head(model: PreTrainedModel, keep: torch.Tensor) -> PreTrainedModel:
    """Restrict the output layer to the token ids in `keep` (sorted, unique), in place."""
    head = model.get_output_embeddings()
    vocab = _head_weight(head).shape[0]
    keep = torch.unique(keep.long())
    if keep.numel() == 0 or int(keep.max()) >= vocab or int(keep.min()) < 0:
        raise ValueError(f"keep must hold token ids in [0, {vocab})")
    model.set_output_embeddings(RestrictedHead(head, keep, vocab))
    model.config.tie_word_embeddings = False  # the new head must not be re-tied to the input embeddings
    return model


def frequent_tokens(vocab_size: int, top: int, always: torch.Tensor | None = None) -> torch.Tensor:
    """A proxy for the most frequent tokens of a BPE vocabulary: the lowest ids.

    Byte-level BPE assigns ids in merge order, and merges are learned most-frequent
    first, so low ids are the common tokens. `always` (e.g. special tokens) is added.
    """
    keep = torch.arange(min(top, vocab_size))
    return keep if always is None else torch.unique(torch.cat([keep, always.long()]))


def _head_weight(head: nn.Module) -> torch.Tensor:
    if isinstance(head, nn.Linear):
        return head.weight
    raise ValueError(f"the output layer is a {type(head).__name__}, not nn.Linear; restrict it before quantising")
