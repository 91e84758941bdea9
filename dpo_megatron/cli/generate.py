"""Sample completions of a JSONL of prompts from a policy:
``python -m dpo_megatron.generate --config FILE [k=v ...]`` (one process, or one per rank under
torchrun, at any layout of ``parallel.*``).

The policy is built as training builds it (``model.hf_path``, or a checkpoint with
``model.load``; ``model.*`` / ``parallel.*`` as for a run), the prompts are encoded as the data
path encodes prompts (``data.tokenizer`` or the model folder's tokenizer; ``data.chat_template``
or the tokenizer's for ``messages``, and for a text prompt as one user turn unless
``generation.apply_chat_template=false``), and ``generation.*`` says how to sample and where to
write (:mod:`dpo_megatron.generation.files`). A mistake ends every rank with one line and status 2.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

from dpo_megatron.cli import command
from dpo_megatron.config import load_config


def check_config(cfg) -> None:
    """The sections the command reads (``parallel``, ``model``, ``data``'s tokenizer and chat
    template, ``generation``), before torch is imported; no data set is needed.

    Raises:
        ValueError: naming the field and what to do.
    """
    command.check_start(cfg, run_folder=False)
    cfg.model.validate()
    cfg.generation.validate()
    if not cfg.generation.prompts:
        raise ValueError("set generation.prompts to a JSONL file of prompts")
    if not cfg.model.hf_path and not cfg.model.load:
        raise ValueError("set model.hf_path (an HF folder) or model.load (a checkpoint)")


def start_line(cfg, model_cfg, data_parallel_size: int) -> str:
    """The start-up line (rank 0): the layout and the weights sampled from, in words, as a
    training run's start-up line names them. ``model_cfg``: the resolved model section."""
    from dpo_megatron.training import run_models

    layout = cfg.parallel.describe(data_parallel_size, experts=bool(model_cfg.num_experts))
    weights = run_models.weights_source(model_cfg, seed=cfg.train.seed)
    return f"[generate] layout {layout} | weights: {weights}"


def run(cfg, prompts: list) -> str:
    """Build the policy and tokenizer, sample every prompt's completions and write them
    (rank 0); returns the output path (collective)."""
    from megatron.core import parallel_state

    from dpo_megatron.data.encode import encode_settings
    from dpo_megatron.data.tokenizer import load_tokenizer, resolve_chat_template
    from dpo_megatron.generation.files import encode_prompts, generate_file
    from dpo_megatron.parallel import initialize_distributed, set_seed
    from dpo_megatron.training import run_models
    from dpo_megatron.utils.ranks import is_rank0

    model_cfg = run_models.resolve_model_config(cfg)
    parallel, note = run_models.require_sequence_parallel(cfg.parallel, model_cfg)
    cfg = dataclasses.replace(cfg, parallel=parallel)
    initialize_distributed(cfg.parallel)
    set_seed(cfg.train.seed)
    if note and is_rank0():
        print(note, flush=True)
    tokenizer = load_tokenizer(cfg.data.tokenizer or model_cfg.hf_path)
    run_models.check_vocab_fits(tokenizer, model_cfg)
    settings = encode_settings(tokenizer, resolve_chat_template(cfg.data.chat_template))
    encoded = encode_prompts(prompts, tokenizer, settings, cfg.generation.apply_chat_template)
    if encoded.note and is_rank0():
        print(encoded.note, flush=True)
    policy = run_models.build_policy(
        model_cfg, parallel=cfg.parallel, lora=cfg.lora, seed=cfg.train.seed
    )
    if is_rank0():
        print(start_line(cfg, model_cfg, parallel_state.get_data_parallel_world_size()), flush=True)
    path = cfg.generation.output or os.path.join(cfg.run_dir, "generations.jsonl")
    return generate_file(
        policy,
        encoded,
        tokenizer=tokenizer,
        eos_token_id=settings.eos_token_id,
        path=path,
        g=cfg.generation,
    )


def main(argv: Sequence[str] | None = None) -> None:
    """One rank of the command (module docstring)."""
    from dpo_megatron.generation.files import read_prompts

    args = command.parse(command.parser(__doc__, "python -m dpo_megatron.generate"), argv)
    with command.stops(config=True):  # every mistake found before torch: a stop in a second
        cfg = load_config(args.config, args.overrides, check=False)
        check_config(cfg)
        prompts = read_prompts(cfg.generation.prompts)
    command.run_in_ranks(run, cfg, prompts)  # a chat prompt without a chat template: one line


if __name__ == "__main__":
    command.start(main, ranks=True)
