"""Drafters: whatever proposes the K tokens the target verifies."""

from specdecode.backends.protocol import Model
from specdecode.drafters.lookup import LookupDrafter
from specdecode.drafters.model import ModelDrafter
from specdecode.drafters.protocol import Drafter, Proposal


def auto_drafters(draft: Model, tree: int = 0, min_confidence: float = 0.0) -> list[Drafter]:
    """The `auto` drafter, tried in order each round (the first that proposes drafts).

    Chains: prompt lookup (free; it proposes only where the context's tail occurred before), then
    the draft model. With a tree (`tree` extra nodes): the draft model's tree with lookup's
    continuations of its paths as copies first (a superset of what lookup alone would draft, up to
    the tree's size and depth), then lookup's chain for the rounds where the draft model does not
    pay (adaptive K gives it K = 0)."""
    if not tree:
        return [LookupDrafter(), ModelDrafter(draft, min_confidence=min_confidence)]
    return [ModelDrafter(draft, min_confidence=min_confidence, tree=tree, branches=LookupDrafter()), LookupDrafter()]


__all__ = ["Drafter", "LookupDrafter", "ModelDrafter", "Proposal", "auto_drafters"]
