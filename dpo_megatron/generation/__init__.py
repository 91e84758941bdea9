"""Generation from the policy at any layout, with a KV cache.

``SamplingParams`` (temperature, top-p, max new tokens, seed, stop ids) and ``generate`` (batched,
collective over the world): see :mod:`dpo_megatron.generation.engine` for how a call runs and
:mod:`dpo_megatron.generation.sampling` for how tokens are chosen. ``config`` holds the
``generation.*`` config section and imports nothing heavy; ``files`` a JSONL of prompts sampled
into a JSONL of completions (``python -m dpo_megatron.generate``); the rest is imported when
first used.
"""

__all__ = ["SamplingParams", "generate"]


def __getattr__(name):  # torch and megatron-core only when asked for (the config stays light)
    if name == "SamplingParams":
        from dpo_megatron.generation.sampling import SamplingParams

        return SamplingParams
    if name == "generate":
        from dpo_megatron.generation.engine import generate

        return generate
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
