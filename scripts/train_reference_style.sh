#!/usr/bin/env bash
# Train with the reference DPO repo's command line (Rafailov et al., train.py key=value ...):
# the keys are translated to this engine's, the equivalent scripts/pretrain_sft.sh /
# scripts/pretrain_dpo.sh command is printed, then run; the final policy is written as
# <run dir>/LATEST/policy.pt, as the reference trainer does.
#
#   bash scripts/train_reference_style.sh model=pythia69 datasets=[hh] loss=sft \
#       exp_name=anthropic_dpo_pythia69 gradient_accumulation_steps=2 batch_size=64 \
#       eval_batch_size=32 trainer=FSDPTrainer sample_during_eval=false
#   bash scripts/train_reference_style.sh --dry-run ...   # print the translation only
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/interpreter.sh"  # PYTHON
export PYTHON
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" -m dpo_megatron.cli.dpo_repo "$@"
