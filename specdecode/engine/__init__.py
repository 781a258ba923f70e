"""The engine: requests, rounds (draft -> verify -> accept -> roll back) and the plain-decoding baseline."""

from specdecode.engine.config import GenerationConfig
from specdecode.engine.decoder import Generation, SpeculativeDecoder, generate
from specdecode.engine.engine import Engine, generate_tokens
from specdecode.engine.request import Request, State
from specdecode.engine.scheduler import SchedulerConfig
from specdecode.engine.stats import GenerationStats, RoundRecord
from specdecode.engine.text import Chunk

__all__ = ["Chunk", "Engine", "Generation", "GenerationConfig", "GenerationStats", "Request", "RoundRecord",
           "SchedulerConfig", "SpeculativeDecoder", "State", "generate", "generate_tokens"]
