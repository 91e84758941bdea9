"""The ``generation.*`` section of the config tree: what ``python -m dpo_megatron.generate``
reads, samples and writes. Imports nothing heavy."""

from __future__ import annotations

from dataclasses import dataclass, field

from dpo_megatron.utils.config_checks import check_range


@dataclass
class GenerationConfig:
    """Sampling from the policy (``dpo_megatron.generation``) and the generate command's files."""

    prompts: str = ""
    """JSONL file of prompts, one object a line: ``{"prompt": str}`` (plain text, encoded as
    the data path encodes a text prompt) or ``{"messages": [{"role", "content"}, ...]}``
    (rendered with the chat template, ``data.chat_template`` or the tokenizer's, with the
    generation prompt); other fields are ignored."""
    output: str = ""
    """JSONL file written (atomically, at the end): one row per completion with ``prompt`` (as
    given), ``prompt_index``, ``sample_index``, ``completion`` (decoded text, special tokens
    skipped) and ``completion_ids`` (stop token kept). Empty: ``<run_dir>/generations.jsonl``."""
    num_samples: int = 1
    """Completions per prompt (>= 1)."""
    max_new_tokens: int = 256
    """Most tokens per completion, the stop token included (>= 1)."""
    temperature: float = 1.0
    """Softmax temperature (>= 0; 0: greedy)."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1] (1: off)."""
    seed: int = 0
    """Seed of every completion's random stream, with its prompt and sample indices (>= 0): the
    same completions at any layout and micro-batch size."""
    micro_batch_size: int = 8
    """Completions per micro-batch per data-parallel rank (>= 1)."""
    stop_ids: list[int] = field(default_factory=list)
    """Token ids that end a completion besides the tokenizer's EOS (kept in the completion)."""

    def validate(self) -> None:
        """Raises ValueError naming the field and its valid range."""
        check_range("generation", self, "num_samples", 1)
        check_range("generation", self, "max_new_tokens", 1)
        check_range("generation", self, "temperature", 0, why="0 is greedy")
        check_range("generation", self, "top_p", 0, 1, low_open=True, why="1 keeps every token")
        check_range("generation", self, "seed", 0)
        check_range("generation", self, "micro_batch_size", 1)
        for token in self.stop_ids:
            if token < 0:
                raise ValueError(f"generation.stop_ids holds {token}: token ids are >= 0")
