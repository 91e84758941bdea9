#!/usr/bin/env python
"""Convert a Hugging Face folder into a megatron-core distributed checkpoint (model weights).

    python scripts/convert_hf_to_megatron.py --hf-path HF_DIR --save CKPT_DIR
    torchrun --nproc-per-node 4 scripts/convert_hf_to_megatron.py --hf-path HF_DIR \\
        --save CKPT_DIR --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2

The checkpoint loads at any TP x PP layout (``dpo_megatron.checkpointing.load_model_checkpoint``);
converting with a split layout only spreads memory: each rank reads just the slices it owns.
The architecture comes from HF_DIR/config.json and is stored as CKPT_DIR/model_config.json.
Every check (architecture, shards, tensor names and shapes, divisibility) runs before anything is
written, and the checkpoint is written to CKPT_DIR.tmp and renamed: a failure leaves no
CKPT_DIR behind.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dpo_megatron.compat import before_megatron_import  # noqa: E402

before_megatron_import()  # before megatron-core's import (its warnings; no torch.compile on CPU)

from dpo_megatron.utils.exits import fail  # noqa: E402  (mistakes: one line from rank 0, exit 2)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hf-path", required=True, help="HF folder: config.json + weights")
    p.add_argument("--save", required=True, help="output checkpoint folder")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a --save folder that is not empty (its whole content is replaced)",
    )
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument(
        "--expert-model-parallel-size",
        type=int,
        default=1,
        help="mixture of experts: ranks that split each layer's experts",
    )
    p.add_argument(
        "--expert-tensor-parallel-size",
        type=int,
        default=None,
        help="mixture of experts: ranks that split each expert (default: TP)",
    )
    p.add_argument(
        "--params-dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="dtype of the stored weights (default float32: exact)",
    )
    p.add_argument(
        "--pad-attention-heads",
        action="store_true",
        help="add zero key/value groups when TP does not divide them (e.g. SmolLM2-135M,"
        " 3 KV heads, at TP 2); recorded in the checkpoint's model_config.json",
    )
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    from dpo_megatron.utils.files import check_output_folder

    try:  # before any model is built: the output replaces the whole folder
        check_output_folder(args.save, [args.hf_path], args.overwrite)
    except ValueError as e:
        fail(f"error: --save {e}")
    from dpo_megatron.checkpointing import save_model_checkpoint
    from dpo_megatron.models import (
        ModelConfig,
        build_model_chunks,
        load_hf_weights,
        model_config_from_hf,
    )
    from dpo_megatron.models.conversion.layout import converter_layout
    from dpo_megatron.parallel import destroy_distributed, initialize_distributed

    try:
        model_cfg = model_config_from_hf(
            args.hf_path,
            ModelConfig(
                params_dtype=args.params_dtype,
                transformer_impl="local",
                pad_attention_heads=args.pad_attention_heads,
            ),
        )
    except FileNotFoundError as e:  # no folder, or no config.json in it: one line
        fail(f"error: --hf-path {e}")
    try:  # the model against the layout, then the layout against the ranks: one line each
        parallel = converter_layout(model_cfg, vars(args))
    except ValueError as e:
        fail(f"error: {e}")
    initialize_distributed(parallel)
    try:
        chunks = build_model_chunks(model_cfg, parallel)
        load_hf_weights(chunks, model_cfg, args.hf_path)
        save_model_checkpoint(chunks, args.save, model_cfg)
    finally:
        destroy_distributed()
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"wrote {args.save}")


if __name__ == "__main__":  # required: dist_checkpointing's writer spawns a helper process
    main()
