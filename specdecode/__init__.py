"""specdecode: lossless speculative decoding for causal language models.

    from specdecode import generate
    print(generate("def fib(n):", k=4).text)        # the embedded Qwen2.5-Coder 1.5B/0.5B pair
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy: `import specdecode` stays light (core math needs no transformers import).
    if name in ("generate", "SpeculativeDecoder", "GenerationConfig", "SamplingParams"):
        from specdecode import engine
        from specdecode.core import probs
        return getattr(engine, name, None) or getattr(probs, name)
    raise AttributeError(f"module 'specdecode' has no attribute {name!r}")
