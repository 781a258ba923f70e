"""Drafters: whatever proposes the K tokens the target verifies."""

from specdecode.drafters.model import ModelDrafter
from specdecode.drafters.protocol import Drafter, Proposal

__all__ = ["Drafter", "ModelDrafter", "Proposal"]
