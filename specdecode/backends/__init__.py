"""Model backends: the small protocol the engine needs, and its transformers implementation."""

from specdecode.backends.protocol import Model

__all__ = ["Model"]
