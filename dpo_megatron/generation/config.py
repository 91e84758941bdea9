"""The ``generation.*`` section of the config tree: what ``python -m dpo_megatron.generate``
reads, samples and writes. Imports nothing heavy."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from dpo_megatron.utils.config_checks import check_range


@dataclass
class SamplingConfig:
    """How completions are sampled from the policy: the fields ``generation.*`` and
    ``online.sampling.*`` share (one owner of their meaning, ranges and mapping onto
    :class:`dpo_megatron.generation.sampling.SamplingParams`)."""

    max_new_tokens: int = 256
    """Most tokens per completion, the stop token included (>= 1); a completion also ends at
    EOS."""
    temperature: float = 1.0
    """Softmax temperature (>= 0; 0: greedy, refused where several samples per prompt must
    differ)."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1] (1: off)."""
    seed: int = 0
    """Seed of every completion's random stream, with its prompt and sample indices (>= 0): the
    same completions at any layout and micro-batch size."""
    micro_batch_size: int = 8
    """Completions per generation forward per data-parallel rank (>= 1)."""

    def validate_sampling(self, section: str, greedy: bool = True) -> None:
        """Raises ValueError naming ``<section>.<field>`` and its valid range (``greedy``: whether
        temperature 0 is allowed)."""
        why = "0 is greedy" if greedy else "> 0: the samples of a prompt must differ"
        check_range(section, self, "temperature", 0, low_open=not greedy, why=why)
        check_range(section, self, "top_p", 0, 1, low_open=True, why="1 keeps every token")
        check_range(section, self, "max_new_tokens", 1)
        check_range(section, self, "seed", 0)
        check_range(section, self, "micro_batch_size", 1)

    def params(self, seed: int, stop_ids: Iterable[int]):
        """These settings as :class:`~dpo_megatron.generation.sampling.SamplingParams` with the
        given seed (a run may derive it, e.g. per round) and stop ids (sorted, unique)."""
        from dpo_megatron.generation.sampling import SamplingParams

        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            max_new_tokens=self.max_new_tokens,
            seed=seed,
            stop_ids=tuple(sorted(set(stop_ids))),
        )


@dataclass
class GenerationConfig(SamplingConfig):
    """Sampling from the policy (``dpo_megatron.generation``) and the generate command's files;
    the sampling fields are :class:`SamplingConfig`'s."""

    prompts: str = ""
    """JSONL file of prompts, one object a line: ``{"prompt": str}`` (a text: see
    ``apply_chat_template``) or ``{"messages": [{"role", "content"}, ...]}`` (rendered with the
    chat template, ``data.chat_template`` or the tokenizer's, with the generation prompt); other
    fields are ignored."""
    apply_chat_template: bool = True
    """A ``{"prompt": text}`` row reaches the model as one user turn through the chat template
    (``data.chat_template`` or the tokenizer's) when there is one, as an instruct model expects
    (given the bare text it often ends at once: empty completions); the start-up says so in one
    line. False, or no template: the text as it stands (a base model's continuation, encoded as
    the data path encodes a text prompt)."""
    output: str = ""
    """JSONL file written (atomically, at the end): one row per completion with ``prompt`` (the
    form sampled after: a message list when the chat template framed it, so a text sent as one
    user turn reads ``[{"role": "user", "content": text}]``; a text sent as it stands, as
    given), ``prompt_index``, ``sample_index``, ``completion`` (decoded text, special tokens
    skipped) and ``completion_ids`` (stop token kept; none after a completion cut at
    ``max_new_tokens``). ``python -m dpo_megatron.score`` reads the rows as they are: the
    prompt's ids then exactly ``completion_ids``. Empty: ``<run_dir>/generations.jsonl``."""
    num_samples: int = 1
    """Completions per prompt (>= 1)."""
    stop_ids: list[int] = field(default_factory=list)
    """Token ids that end a completion besides the tokenizer's EOS (kept in the completion)."""

    def validate(self) -> None:
        """Raises ValueError naming the field and its valid range."""
        self.validate_sampling("generation")
        check_range("generation", self, "num_samples", 1)
        for token in self.stop_ids:
            if token < 0:
                raise ValueError(f"generation.stop_ids holds {token}: token ids are >= 0")
