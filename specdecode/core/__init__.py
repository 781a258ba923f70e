"""Pure mathematics of speculative decoding: no model code, no imports from the rest of specdecode."""

from specdecode.core.probs import GREEDY, SamplingParams, logits_to_probs, sample, sample_with_noise
from specdecode.core.theory import (CostModel, acceptance_rate, break_even_alpha, expected_tokens, optimal_k,
                                    speedup, tokens_per_round_pmf, tv_distance)
from specdecode.core.block import verify_block, verify_block_reference
from specdecode.core.tree import DraftTree, TreeResult, verify_tree, verify_tree_reference
from specdecode.core.verify import Randomness, VerifyResult, verify, verify_reference

# The exact verification rules, by the name users select them with (--verify, `verification`).
VERIFY_RULES = {"token": verify, "block": verify_block}

__all__ = [
    "GREEDY", "SamplingParams", "logits_to_probs", "sample", "sample_with_noise",
    "CostModel", "acceptance_rate", "break_even_alpha", "expected_tokens", "optimal_k", "speedup",
    "tokens_per_round_pmf", "tv_distance",
    "Randomness", "VerifyResult", "verify", "verify_reference", "verify_block", "verify_block_reference",
    "DraftTree", "TreeResult", "verify_tree", "verify_tree_reference", "VERIFY_RULES",
]
