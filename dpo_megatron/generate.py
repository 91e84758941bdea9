"""Sample completions of a JSONL of prompts from a policy:
``python -m dpo_megatron.generate --config FILE [k=v ...]`` (one process, or one per rank under
torchrun, at any layout of ``parallel.*``).

The policy is built as training builds it (``model.hf_path``, or a checkpoint with
``model.load``; ``model.*`` / ``parallel.*`` as for a run), the prompts are encoded as the data
path encodes prompts (``data.tokenizer`` or the model folder's tokenizer; ``data.chat_template``
or the tokenizer's for ``messages``, and for a text prompt as one user turn unless
``generation.apply_chat_template=false``: :func:`encode_prompts`), and ``generation.*`` says how
to sample and where to write
(``dpo_megatron.generation.config.GenerationConfig``). Completions stop at the tokenizer's EOS or
a ``generation.stop_ids`` id. Rank 0 writes the output file atomically once all are done.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Optional, Sequence

from dpo_megatron.compat import before_megatron_import

before_megatron_import()  # before megatron-core's import (its warnings; no torch.compile on CPU)

from dpo_megatron.config import DPOConfig, load_config, parse_args  # noqa: E402
from dpo_megatron.data.reader import DataError, read_json_rows  # noqa: E402
from dpo_megatron.utils import ranks  # noqa: E402
from dpo_megatron.utils.exits import fail  # noqa: E402


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
                f"{path}, {location}: field 'prompt' (a non-empty string) or 'messages' (a list "
                f"of {{'role', 'content'}} objects) is missing or malformed"
            )
    if not prompts:
        raise DataError(f"{path}: no prompt in the file")
    return prompts


def encode_prompts(
    prompts: list, tokenizer, settings, apply_chat_template: bool = True
) -> tuple[list[list[int]], Optional[str]]:
    """Token ids of each prompt, and the start-up line saying how text prompts were sent (None
    when there is none, or nothing to say).

    A ``messages`` prompt goes through the chat template with the generation prompt; a text
    prompt too, as one user turn, when ``apply_chat_template`` and the tokenizer (or
    ``settings.chat_template``) has a template, else as it stands (``data.encode.encode_prompt``
    either way).

    Raises:
        DataError: a ``messages`` prompt and no chat template.
    """
    from dpo_megatron.data.encode import encode_prompt
    from dpo_megatron.data.tokenizer import has_chat_template

    as_chat = apply_chat_template and has_chat_template(tokenizer, settings.chat_template)
    texts = sum(isinstance(p, str) for p in prompts)
    ids = [
        encode_prompt(
            [{"role": "user", "content": p}] if as_chat and isinstance(p, str) else p,
            tokenizer,
            settings,
        )
        for p in prompts
    ]
    note = None
    if texts and as_chat:
        note = (
            f"[generate] {texts} text prompt(s) sent as one user turn through the chat template "
            "(generation.apply_chat_template=false: as they stand)"
        )
    return ids, note


def output_path(cfg: DPOConfig) -> str:
    """``generation.output``, or ``<run_dir>/generations.jsonl``."""
    return cfg.generation.output or os.path.join(cfg.run_dir, "generations.jsonl")


def run(cfg: DPOConfig, prompts: list) -> str:
    """Build the policy and tokenizer, sample every prompt's completions, write them (rank 0);
    returns the output path (collective)."""
    from dpo_megatron.data.encode import encode_settings
    from dpo_megatron.data.tokenizer import load_tokenizer, resolve_chat_template
    from dpo_megatron.generation import generate
    from dpo_megatron.parallel import initialize_distributed, set_seed
    from dpo_megatron.training import run_models
    from dpo_megatron.utils.files import write_text_atomic

    model_cfg = run_models.resolve_model_config(cfg)
    note = run_models.require_sequence_parallel(cfg, model_cfg)
    initialize_distributed(cfg.parallel)
    set_seed(cfg.train.seed)
    if note and ranks.is_rank0():
        print(note, flush=True)
    tokenizer = load_tokenizer(cfg.data.tokenizer or model_cfg.hf_path)
    run_models.check_vocab_fits(tokenizer, model_cfg)
    g = cfg.generation
    settings = encode_settings(tokenizer, resolve_chat_template(cfg.data.chat_template))
    prompt_ids, note = encode_prompts(prompts, tokenizer, settings, g.apply_chat_template)
    if note and ranks.is_rank0():
        print(note, flush=True)
    policy = run_models.build_policy(cfg, model_cfg)
    params = g.params(g.seed, [settings.eos_token_id, *g.stop_ids])
    started = time.time()
    completions = generate(
        policy,
        prompt_ids,
        params,
        num_samples=g.num_samples,
        micro_batch_size=g.micro_batch_size,
        pad_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
        vocab_size=len(tokenizer),
    )
    seconds = time.time() - started
    path = output_path(cfg)
    if ranks.is_rank0():
        lines = [
            json.dumps(
                {
                    "prompt": prompt,
                    "prompt_index": i,
                    "sample_index": j,
                    "completion": tokenizer.decode(ids, skip_special_tokens=True),
                    "completion_ids": ids,
                },
                ensure_ascii=False,
            )
            for i, (prompt, samples) in enumerate(zip(prompts, completions))
            for j, ids in enumerate(samples)
        ]
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        write_text_atomic(path, "".join(line + "\n" for line in lines))
        tokens = sum(len(ids) for samples in completions for ids in samples)
        print(
            f"[generate] {len(lines)} completions of {len(prompts)} prompts -> {path} "
            f"({tokens} tokens in {seconds:.1f} s, {tokens / max(seconds, 1e-9):.1f} tokens/s)",
            flush=True,
        )
    ranks.barrier()
    return path


def check_config(cfg: DPOConfig) -> None:
    """The sections the command reads (``parallel``, ``model``, ``data``'s tokenizer and chat
    template, ``generation``), before torch is imported; the training sections are not checked
    (no data set is needed).

    Raises:
        ValueError: naming the field and what to do.
    """
    cfg.parallel.validate(int(os.environ.get("WORLD_SIZE", "1")))
    cfg.model.validate()
    cfg.generation.validate()
    if not cfg.generation.prompts:
        raise ValueError("set generation.prompts to a JSONL file of prompts")
    if not cfg.model.hf_path and not cfg.model.load:
        raise ValueError("set model.hf_path (an HF folder) or model.load (a checkpoint)")


def main(argv: Optional[Sequence[str]] = None) -> None:
    """One rank of the command; a mistake ends it with one ``config error:`` / ``error:`` line
    and status 2 (``USER_ERROR_EXIT``, :mod:`dpo_megatron.utils.exits`)."""
    config_file, overrides = parse_args(argv)
    try:  # every mistake found before torch is imported: a stop in a second
        cfg = load_config(config_file, overrides, check=False)
        check_config(cfg)
        prompts = read_prompts(cfg.generation.prompts)
    except DataError as e:
        fail(f"error: {e}")
    except ValueError as e:
        fail(f"config error: {e}")
    from dpo_megatron.parallel import destroy_distributed

    try:
        run(cfg, prompts)
    except DataError as e:  # a chat prompt without a chat template
        fail(f"error: {e}")
    finally:
        destroy_distributed()


if __name__ == "__main__":
    main()
