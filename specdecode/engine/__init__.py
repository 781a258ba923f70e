"""The engine: draft -> verify -> accept -> roll back, plus the plain-decoding baseline."""

from specdecode.engine.config import GenerationConfig
from specdecode.engine.decoder import Chunk, Generation, SpeculativeDecoder, generate
from specdecode.engine.loop import Round, generate_tokens
from specdecode.engine.stats import GenerationStats, RoundRecord

__all__ = ["Chunk", "Generation", "GenerationConfig", "GenerationStats", "Round", "RoundRecord",
           "SpeculativeDecoder", "generate", "generate_tokens"]
