#!/usr/bin/env bash
# Launch iterative (online) DPO: rounds of sample -> score -> pair -> train on the same engine and
# launcher as DPO (dpo_megatron/online/rounds.py).
#
#   scripts/iterative_dpo.sh [--config FILE] [key=value ...]
#
# With no --config: configs/online_smollm2_cpu.yaml (SmolLM2-135M-Instruct on prompts of
# dpo_en_demo, CPU/gloo). Continue a stopped run with checkpoint.resume=auto: finished phases
# are skipped, an unfinished round's training resumes from its last checkpoint.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=stage_help.sh
source "$ROOT/scripts/stage_help.sh"
stage_help "${BASH_SOURCE[0]}" "the online.* keys set the rounds (docs/REWARD_AND_ONLINE.md)." "$@"
export DPO_MEGATRON_DEFAULT_CONFIG="${DPO_MEGATRON_DEFAULT_CONFIG:-$ROOT/configs/online_smollm2_cpu.yaml}"
export DPO_MEGATRON_ENTRY="${DPO_MEGATRON_ENTRY:-dpo_megatron.cli.online}"
export DPO_MEGATRON_PRECHECK="${DPO_MEGATRON_PRECHECK:--m dpo_megatron.cli.online --check}"
exec bash "$ROOT/scripts/pretrain_dpo.sh" "$@"
