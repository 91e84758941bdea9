#!/usr/bin/env bash
# Launch the SFT stage (loss.name=sft: per-token NLL of the completion tokens) through the same
# engine and launcher as DPO.
#
#   scripts/pretrain_sft.sh [--config FILE] [key=value ...]
#
# With no --config: configs/sft_smollm2_cpu.yaml (SmolLM2-135M-Instruct on the real alpaca_en_demo
# instructions, TP 2 x PP 2 on CPU/gloo). Then DPO from its checkpoint:
#   scripts/pretrain_dpo.sh model.load=runs/sft_smollm2_cpu/checkpoints run_dir=runs/dpo_from_sft
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=stage_help.sh
source "$ROOT/scripts/stage_help.sh"
stage_help "${BASH_SOURCE[0]}" "the SFT loss has no parameters besides loss.name=sft." "$@"
export DPO_MEGATRON_DEFAULT_CONFIG="${DPO_MEGATRON_DEFAULT_CONFIG:-$ROOT/configs/sft_smollm2_cpu.yaml}"
exec bash "$ROOT/scripts/pretrain_dpo.sh" "$@"
