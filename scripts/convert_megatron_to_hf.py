#!/usr/bin/env python
"""Convert a megatron-core distributed checkpoint (model weights) into a Hugging Face folder.

    python scripts/convert_megatron_to_hf.py --load CKPT_DIR --save HF_OUT [--dtype bfloat16]
    torchrun --nproc-per-node 2 scripts/convert_megatron_to_hf.py --load CKPT_DIR \\
        --save HF_OUT --tensor-model-parallel-size 2

The architecture is CKPT_DIR/model_config.json (written by convert_hf_to_megatron.py and by
training) or, with --hf-path, the source HF folder's config.json; a LoRA training checkpoint
(adapters only) is merged into the base it was trained on (its hf_path or load), or with
--adapter written as a PEFT adapter folder; config.json,
generation config and tokenizer files are taken from that folder (tokenizer: --tokenizer-dir
overrides). The output is written to a temporary folder and renamed into place when complete. The
checkpoint it loads (path, training step, run folder) is printed first: a run's ``checkpoints``
folder means its latest complete checkpoint, so the line says which one that was. Every file of
CKPT_DIR is then checked against its manifest of checksums (and for pickled code) before any tensor
is loaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dpo_megatron.compat import before_megatron_import  # noqa: E402

before_megatron_import()  # before megatron-core's import (its warnings; no torch.compile on CPU)

from dpo_megatron.utils.exits import fail  # noqa: E402  (mistakes: one line from rank 0, exit 2)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--load", required=True, help="megatron-core distributed checkpoint folder")
    p.add_argument("--save", required=True, help="output HF folder")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a --save folder that is not empty (its whole content is replaced)",
    )
    p.add_argument(
        "--hf-path",
        default=None,
        help="source HF folder (config.json, tokenizer); default: the hf_path stored "
        "in the checkpoint's model_config.json",
    )
    p.add_argument("--tokenizer-dir", default=None, help="folder to copy tokenizer files from")
    p.add_argument(
        "--adapter",
        action="store_true",
        help="a LoRA checkpoint: write its adapters as a PEFT folder (adapter_config.json + "
        "adapter_model.safetensors, for peft.PeftModel.from_pretrained) instead of merging them",
    )
    p.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float16", "float32"],
        help="dtype of the exported weights (default bfloat16; float32: exact)",
    )
    p.add_argument(
        "--tensor-model-parallel-size",
        type=int,
        default=1,
        help="ranks that load the checkpoint together (any layout reads any checkpoint; more "
        "ranks: less memory each); launch as many with torchrun",
    )
    p.add_argument(
        "--pipeline-model-parallel-size",
        type=int,
        default=1,
        help="pipeline stages that load the checkpoint together (as above)",
    )
    return p.parse_args(argv)


def describe_checkpoint(path: str) -> str:
    """ "checkpoint <path> (step N of run <run folder>)" for a training checkpoint in a run's
    ``checkpoints`` folder, "checkpoint <path> (step N of run id <id>)" for one elsewhere, else
    "checkpoint <path> (not a training checkpoint: no train_state.json)"."""
    from dpo_megatron.checkpointing.training_checkpoint import TRAIN_STATE_FILE, read_train_state

    path = os.path.abspath(path)
    if not os.path.isfile(os.path.join(path, TRAIN_STATE_FILE)):
        return f"checkpoint {path} (not a training checkpoint: no {TRAIN_STATE_FILE})"
    state = read_train_state(path)
    step = state.get("step", "?")
    parent = os.path.dirname(path)
    if os.path.basename(parent) == "checkpoints":
        return f"checkpoint {path} (step {step} of run {os.path.dirname(parent)})"
    # elsewhere (checkpoint.save, a copy): the folder above is no run folder; the id says whose
    return f"checkpoint {path} (step {step} of run id {state.get('run_id', '?')})"


def main(argv=None) -> None:
    args = parse_args(argv)
    from dpo_megatron.utils.files import check_output_folder

    try:  # before any model is built: the output replaces the whole folder
        sources = [args.load, args.hf_path, args.tokenizer_dir]
        check_output_folder(args.save, sources, args.overwrite)
    except ValueError as e:
        fail(f"error: --save {e}")
    from dpo_megatron.checkpointing import load_model_config
    from dpo_megatron.checkpointing.integrity import CheckpointIntegrityError
    from dpo_megatron.checkpointing.training_checkpoint import find_latest_checkpoint
    from dpo_megatron.models import ModelConfig, build_model_chunks, export_hf, model_config_from_hf
    from dpo_megatron.models.conversion import export_peft_adapter
    from dpo_megatron.models.conversion.layout import converter_layout
    from dpo_megatron.parallel import destroy_distributed, initialize_distributed

    # A run's checkpoints/ folder (as model.load accepts) means its latest checkpoint.
    args.load = find_latest_checkpoint(args.load) or args.load
    if not os.path.isdir(args.load):
        fail(f"error: --load {args.load}: no such checkpoint folder")
    run_checkpoints = os.path.join(args.load, "checkpoints")
    if os.path.isdir(run_checkpoints) and not os.path.isfile(
        os.path.join(args.load, "metadata.json")
    ):
        fail(
            f"error: --load {args.load} is a run folder: pass {run_checkpoints} (its latest "
            "checkpoint) or one of its iter_* folders"
        )
    rank0 = int(os.environ.get("RANK", "0")) == 0
    if rank0:
        print(f"loading {describe_checkpoint(args.load)}", flush=True)
    stored = load_model_config(args.load)
    base = dataclasses.replace(
        stored or ModelConfig(), params_dtype="float32", transformer_impl="local"
    )  # keeps e.g. pad_attention_heads
    if args.hf_path:
        model_cfg = model_config_from_hf(args.hf_path, base)
        if stored is not None:  # the checkpoint's head (a reward model's), whatever the folder's
            model_cfg = dataclasses.replace(model_cfg, head=stored.head)
    elif stored is not None:
        model_cfg = dataclasses.replace(stored, params_dtype="float32", transformer_impl="local")
    else:
        fail(f"error: --load {args.load} has no model_config.json: pass --hf-path")
    try:  # the model against the layout, then the layout against the ranks: one line each
        parallel = converter_layout(model_cfg, vars(args))
    except ValueError as e:
        fail(f"error: {e}")
    initialize_distributed(parallel)
    try:
        chunks = build_model_chunks(model_cfg, parallel)
        try:  # verifies the checksums and pickles first
            adapters = load_weights(chunks, model_cfg, args.load, base=not args.adapter)
        except CheckpointIntegrityError as e:  # names each bad file: one line, as the trainer's
            fail(f"error: {e}")
        if args.adapter:
            if adapters is None:
                fail(f"error: --adapter: {args.load} holds no LoRA adapters")
            export_peft_adapter(chunks, model_cfg, adapters, args.save, dtype=args.dtype)
        else:
            export_hf(
                chunks, model_cfg, args.save, dtype=args.dtype, tokenizer_dir=args.tokenizer_dir
            )
    finally:
        destroy_distributed()
    if rank0:
        print(f"wrote {args.save} ({args.dtype})")


def load_weights(chunks: list, model_cfg, ckpt_dir: str, base: bool = True):
    """The checkpoint's weights into ``chunks``; returns its ``LoraConfig``, or None for a
    checkpoint of whole weights. A LoRA training checkpoint holds adapters only: its base is
    loaded from where the run took it (``model_config.json``: ``hf_path`` or ``load``) unless
    ``base`` is False (the adapters alone are exported), the adapters are attached and loaded,
    and a merged export merges them.

    Raises:
        SystemExit: (:func:`~dpo_megatron.utils.exits.fail`, one line, exit 2) a LoRA
            checkpoint whose base was randomly initialised (not recoverable), its base asked for.
    """
    from dpo_megatron.checkpointing import load_model_checkpoint
    from dpo_megatron.checkpointing.training_checkpoint import checkpoint_lora

    lora = checkpoint_lora(ckpt_dir)
    if not lora:
        load_model_checkpoint(chunks, ckpt_dir)
        return None
    from dpo_megatron.models.lora import AdapterCheckpoint, attach_lora
    from dpo_megatron.models.lora_config import LoraConfig

    if base:  # (without it the adapters alone are exported: the base plays no part)
        _load_base(chunks, model_cfg, ckpt_dir, lora.get("base"))
    fields = {k: v for k, v in lora.items() if k != "base"}
    adapters = LoraConfig(enabled=True, **fields)
    attach_lora(chunks, adapters, model_cfg, seed=0)  # values come from the checkpoint
    load_model_checkpoint([AdapterCheckpoint(c) for c in chunks], ckpt_dir)
    return adapters


def _load_base(chunks: list, model_cfg, ckpt_dir: str, described: str) -> None:
    """The base weights a LoRA checkpoint's adapters were trained on, from where the run took
    them (``model_cfg.load`` or ``model_cfg.hf_path``).

    Raises:
        SystemExit: (:func:`~dpo_megatron.utils.exits.fail`) a randomly initialised base
            (``described``: the checkpoint's words for it).
    """
    from dpo_megatron.checkpointing import load_model_checkpoint

    if model_cfg.load:
        from dpo_megatron.training.run_models import resolve_model_load

        load_model_checkpoint(chunks, resolve_model_load(model_cfg.load))
    elif model_cfg.hf_path:
        from dpo_megatron.models import load_hf_weights

        load_hf_weights(chunks, model_cfg, model_cfg.hf_path)
    else:
        fail(
            f"error: {ckpt_dir} holds LoRA adapters of a randomly initialised base "
            f"({described}): there are no base weights to merge them into"
        )


if __name__ == "__main__":  # required: dist_checkpointing's writer spawns a helper process
    main()
