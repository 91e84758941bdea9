"""A JSONL of prompts -> a JSONL of completions: the work of ``python -m dpo_megatron.generate``
(:mod:`dpo_megatron.cli.generate`, which builds the policy and the tokenizer).

The prompts are encoded as the data path encodes prompts (:func:`encode_prompts`: ``messages``
through the chat template with the generation prompt, a text prompt as one user turn unless
``generation.apply_chat_template=false``), sampled with
``generation.*`` (:class:`~dpo_megatron.generation.config.GenerationConfig`), and rank 0 writes
every completion, one JSON object a line, atomically once all are done. Each row's ``prompt`` is
the form the policy was sampled after (``data.encode.prompt_form``): a message list when the chat
template framed it (a text prompt then reads ``[{"role": "user", "content": text}]``), the text
when it went as it stands; its ``prompt_ids`` are the ids sampled after.
``python -m dpo_megatron.score``, and a preference row built from the rows, encode that form
with the data path's encoder, so they feed a model the same prompt ids (and the scorer knows
from ``prompt_ids`` whether its tokenizer reads the sampled ``completion_ids`` as they are).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from dpo_megatron.data.sources import DataError, read_json_rows
from dpo_megatron.generation.config import GenerationConfig
from dpo_megatron.utils import ranks


def read_prompts(path: str) -> list:
    """The prompts of a JSONL file: per line a ``prompt`` string or a ``messages`` list of
    ``{"role", "content"}`` objects (other fields ignored); blank lines skipped.

    Raises:
        DataError: a missing file, a line that is not a JSON object, or a row without a valid
            ``prompt`` / ``messages`` (the message names file, line and field).
    """
    if not os.path.isfile(path):
        raise DataError(f"generation.prompts={path}: no such file")
    texts, where, _ = read_json_rows(Path(path))
    prompts = []
    for text, location in zip(texts, where):
        row = json.loads(text)
        if isinstance(row.get("prompt"), str) and row["prompt"]:
            prompts.append(row["prompt"])
        elif isinstance(row.get("messages"), list) and all(
            isinstance(m, dict) and {"role", "content"} <= m.keys() for m in row["messages"]
        ):
            prompts.append(row["messages"])
        else:
            raise DataError(
                f"{path}: {location}: field 'prompt' (a non-empty string) or 'messages' (a list "
                f"of {{'role', 'content'}} objects) is missing or malformed"
            )
    if not prompts:
        raise DataError(f"{path}: no prompt in the file")
    return prompts


@dataclass(frozen=True)
class EncodedPrompts:
    """The prompts of a generate run as they are sampled.

    Attributes:
        prompts: each prompt in the form the model reads it (``data.encode.prompt_form``: a
            message list through the chat template, or a text as it stands); what the output
            rows hold as ``prompt``.
        prompt_ids: their token ids (``data.encode.encode_prompt`` of each form).
        note: the start-up line saying how text prompts were sent (None: nothing to say).
    """

    prompts: list
    prompt_ids: list[list[int]]
    note: str | None


def encode_prompts(
    prompts: list, tokenizer, settings, apply_chat_template: bool = True
) -> EncodedPrompts:
    """The form and token ids of each prompt, and the start-up line saying how text prompts
    were sent.

    A ``messages`` prompt goes through the chat template with the generation prompt; a text
    prompt too, as one user turn, when ``apply_chat_template`` and the tokenizer (or
    ``settings.chat_template``) has a template, else as it stands (``data.encode.prompt_form``
    decides, ``data.encode.encode_prompt`` encodes).

    Raises:
        DataError: a ``messages`` prompt and no chat template.
    """
    from dpo_megatron.data.encode import encode_prompt, prompt_form

    forms = [prompt_form(p, tokenizer, settings, apply_chat_template) for p in prompts]
    ids = [encode_prompt(form, tokenizer, settings) for form in forms]
    turned = sum(isinstance(p, str) and not isinstance(f, str) for p, f in zip(prompts, forms))
    note = None
    if turned:
        note = (
            f"[generate] {turned} text prompt(s) sent as one user turn through the chat template "
            "(generation.apply_chat_template=false: as they stand)"
        )
    return EncodedPrompts(forms, ids, note)


def completion_rows(encoded: EncodedPrompts, completions: list, tokenizer) -> list[dict]:
    """The output rows, prompt by prompt then sample by sample: ``prompt`` (the form sampled,
    ``encoded.prompts[i]``), ``prompt_index``, ``sample_index``, ``completion``
    (``completions[i][j]`` decoded, special tokens skipped), ``completion_ids`` (the generated
    ids, prompt excluded, stop token kept) and ``prompt_ids`` (the ids sampled after,
    ``encoded.prompt_ids[i]``). ``python -m dpo_megatron.score`` scores ``prompt_ids`` +
    ``completion_ids`` when its tokenizer reads the prompt as those ``prompt_ids``, the text
    otherwise (``reward.rows.encode_rows``)."""
    return [
        {
            "prompt": prompt,
            "prompt_index": i,
            "sample_index": j,
            "completion": tokenizer.decode(ids, skip_special_tokens=True),
            "completion_ids": ids,
            "prompt_ids": prompt_ids,
        }
        for i, (prompt, prompt_ids, samples) in enumerate(
            zip(encoded.prompts, encoded.prompt_ids, completions)
        )
        for j, ids in enumerate(samples)
    ]


def generate_file(
    policy,
    encoded: EncodedPrompts,
    *,
    tokenizer,
    eos_token_id: int,
    path: str,
    g: GenerationConfig,
) -> str:
    """Sample ``g.num_samples`` completions of each prompt of ``encoded``
    (:func:`encode_prompts`) from ``policy`` (this rank's chunks) with the sampling of ``g`` (a
    :class:`GenerationConfig`), stopping at ``eos_token_id`` or a ``g.stop_ids`` id; rank 0
    writes their rows (:func:`completion_rows`) to ``path`` and says so in one line.
    Collective; returns ``path``."""
    from dpo_megatron.generation import generate
    from dpo_megatron.utils.files import write_text_atomic

    params = g.params(g.seed, [eos_token_id, *g.stop_ids])
    started = time.time()
    completions = generate(
        policy,
        encoded.prompt_ids,
        params,
        num_samples=g.num_samples,
        micro_batch_size=g.micro_batch_size,
        pad_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
        vocab_size=len(tokenizer),
    )
    seconds = time.time() - started
    if ranks.is_rank0():
        lines = [
            json.dumps(row, ensure_ascii=False)
            for row in completion_rows(encoded, completions, tokenizer)
        ]
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        write_text_atomic(path, "".join(line + "\n" for line in lines))
        tokens = sum(len(ids) for samples in completions for ids in samples)
        print(
            f"[generate] {len(lines)} completions of {len(encoded.prompts)} prompts -> {path} "
            f"({tokens} tokens in {seconds:.1f} s, {tokens / max(seconds, 1e-9):.1f} tokens/s)",
            flush=True,
        )
    ranks.barrier()
    return path
