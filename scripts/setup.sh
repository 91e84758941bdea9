#!/usr/bin/env bash
# Set up a fresh machine: a virtual environment in .venv with torch, megatron-core and this package
# (editable, with test, conversion and benchmark extras), then the offline assets
# (SmolLM2-135M-Instruct, LLaMA-Factory's dpo_en_demo / dpo_zh_demo / alpaca_en_demo / kto_en_demo,
# Mistral's SentencePiece model, the word-count prompts) cached under ~/.cache/dpo_megatron.
# Safe to re-run.
#
#   bash scripts/setup.sh            # CPU torch wheel, all assets
#   TORCH_SPEC=torch bash scripts/setup.sh    # GPU machines: your own torch
#   SKIP_ASSETS=1 bash scripts/setup.sh       # no assets (DPO_MEGATRON_CACHE moves their cache)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
for a in "$@"; do
  if [[ "$a" == "-h" || "$a" == "--help" ]]; then
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"
    exit 0
  fi
done
cd "$ROOT"
PY="${PYTHON:-python3}"
[[ -x .venv/bin/python ]] || "$PY" -m venv .venv
VPY="$ROOT/.venv/bin/python"
"$VPY" -m pip install -q --upgrade pip
# torch first, pinned: on CPU machines 2.13.0 is a local CPU wheel; an unpinned torch would pull a
# multi-GB CUDA build. GPU machines: set TORCH_SPEC (e.g. TORCH_SPEC=torch) to choose your own.
"$VPY" -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
"$VPY" -m pip install -q -e ".[test,convert,bench]"
# Earlier versions of the assets step installed mistral-common with --no-deps to read one file;
# transformers.AutoTokenizer then takes its Mistral-format branch for every mistral / mixtral
# folder and dies on the missing tiktoken. The assets step now reads the file from the downloaded
# wheel; this removes such a partial install (a working one is left alone).
"$VPY" scripts/assets.py --remove-partial-mistral-common
if [[ "${SKIP_ASSETS:-0}" != 1 ]]; then
  "$VPY" scripts/assets.py
fi
echo
echo "Set up. Run the tools from .venv (.venv/bin/python, .venv/bin/torchrun), or activate it first:"
echo "  source $ROOT/.venv/bin/activate"
