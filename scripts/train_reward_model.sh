#!/usr/bin/env bash
# Train a Bradley-Terry reward model (loss.name=bradley_terry: -log sigmoid(r_chosen -
# r_rejected), a scalar head on each sequence's last token instead of the LM head) on preference
# pairs, through the same engine and launcher as DPO.
#
#   scripts/train_reward_model.sh [--config FILE] [key=value ...]
#
# With no --config: configs/rm_smollm2_cpu.yaml (SmolLM2-135M-Instruct on the real dpo_en_demo
# pairs, 2 ranks of data parallelism on CPU/gloo, held-out accuracy reported, exported as an HF
# *ForSequenceClassification folder). Then score a JSONL of (prompt, completion) rows with it:
#   .venv/bin/python -m dpo_megatron.score --input rows.jsonl --output scored.jsonl \
#       model.hf_path=runs/rm_smollm2_cpu/checkpoints/hf
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=stage_help.sh
source "$ROOT/scripts/stage_help.sh"
stage_help "${BASH_SOURCE[0]}" "loss parameter: loss.center_rewards_coefficient (0)." "$@"
export DPO_MEGATRON_DEFAULT_CONFIG="${DPO_MEGATRON_DEFAULT_CONFIG:-$ROOT/configs/rm_smollm2_cpu.yaml}"
exec bash "$ROOT/scripts/pretrain_dpo.sh" "$@"
