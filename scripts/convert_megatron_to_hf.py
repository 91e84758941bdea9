#!/usr/bin/env python
"""Convert a megatron-core distributed checkpoint (model weights) into a Hugging Face folder.

    python scripts/convert_megatron_to_hf.py --load CKPT_DIR --save HF_OUT [--dtype bfloat16]
    torchrun --nproc-per-node 2 scripts/convert_megatron_to_hf.py --load CKPT_DIR \\
        --save HF_OUT --tensor-model-parallel-size 2

The architecture is CKPT_DIR/model_config.json (written by convert_hf_to_megatron.py and by
training) or, with --hf-path, the source HF folder's config.json; config.json, generation config
and tokenizer files are taken from that folder (tokenizer: --tokenizer-dir overrides). The output
is written to a temporary folder and renamed into place when complete. Every file of CKPT_DIR is
checked against its manifest of checksums (and for pickled code) before anything is loaded, and
the checkpoint used (path, step, run id) is printed.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--load", required=True, help="megatron-core distributed checkpoint folder")
    p.add_argument("--save", required=True, help="output HF folder")
    p.add_argument("--hf-path", default=None,
                   help="source HF folder (config.json, tokenizer); default: the hf_path stored "
                        "in the checkpoint's model_config.json")
    p.add_argument("--tokenizer-dir", default=None, help="folder to copy tokenizer files from")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    return p.parse_args(argv)


def describe_checkpoint(path: str) -> str:
    """``<path> (step N, run <id>)`` for a training checkpoint, ``<path>`` for a model-only one."""
    from dpo_megatron.checkpointing.training_checkpoint import read_train_state

    if not os.path.isfile(os.path.join(path, "train_state.json")):
        return path
    state = read_train_state(path)
    return f"{path} (step {state.get('step')}, run {state.get('run_id') or 'without an id'})"


def main(argv=None) -> None:
    args = parse_args(argv)
    from dpo_megatron.checkpointing import load_model_checkpoint, load_model_config
    from dpo_megatron.checkpointing.training_checkpoint import find_latest_checkpoint
    from dpo_megatron.models import (ModelConfig, build_model_chunks, export_hf,
                                     model_config_from_hf)
    from dpo_megatron.parallel import ParallelConfig, destroy_distributed, initialize_distributed

    # A run's checkpoints/ folder (as model.load accepts) means its latest checkpoint.
    args.load = find_latest_checkpoint(args.load) or args.load
    stored = load_model_config(args.load)
    base = dataclasses.replace(stored or ModelConfig(), params_dtype="float32",
                               transformer_impl="local")  # keeps e.g. pad_attention_heads
    if args.hf_path:
        model_cfg = model_config_from_hf(args.hf_path, base)
    elif stored is not None:
        model_cfg = dataclasses.replace(stored, params_dtype="float32", transformer_impl="local")
    else:
        raise SystemExit(f"{args.load} has no model_config.json: pass --hf-path")
    parallel = ParallelConfig(tensor_model_parallel_size=args.tensor_model_parallel_size,
                              pipeline_model_parallel_size=args.pipeline_model_parallel_size)
    initialize_distributed(parallel)
    try:
        chunks = build_model_chunks(model_cfg, parallel)
        load_model_checkpoint(chunks, args.load)  # verifies the checksums and pickles first
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"loaded {describe_checkpoint(args.load)}", flush=True)
        export_hf(chunks, model_cfg, args.save, dtype=args.dtype,
                  tokenizer_dir=args.tokenizer_dir)
    finally:
        destroy_distributed()
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"wrote {args.save}")


if __name__ == "__main__":  # required: dist_checkpointing's writer spawns a helper process
    main()
