#!/usr/bin/env bash
# Fill the wheel folder scripts/gpu_check.sh installs on a GPU machine without a registry:
#
#   bash scripts/gpu_wheels.sh [DIR]        (default: .whl/ at the repository root)
#
# Run it on a machine with a package registry. A bare GPU machine (such as one with Python 3.12
# and torch with CUDA, numpy, packaging, PyYAML, transformers, safetensors, tensorboard, psutil)
# may lack megatron-core and omegaconf: this downloads exactly those two (~2.7 MB; omegaconf 2.4
# vendors its parser runtime), built for CPython 3.12 on x86-64 Linux, whatever this machine is.
#
# .whl/ is git-ignored: a copy of the tracked tree (git clone / archive, or a device tool that
# copies tracked and untracked-but-not-ignored files) leaves it behind. Copy it with the tree
# (rsync -a .whl/ HOST:REPO/.whl/), or name it in the device tool's carry list (carry: [".whl"]).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${1:-$ROOT/.whl}"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[[ -x "$PY" ]] || PY=python3
mkdir -p "$DIR"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$DIR" \
  megatron-core==0.16.1 omegaconf==2.4.0
ls -l "$DIR"
if [[ "$(realpath -m "$DIR")" == "$ROOT/.whl" ]]; then
  echo ".whl/ is git-ignored: copy it with the tree, or name it in the device tool's carry" \
       "list (carry: [\".whl\"])"
else
  echo "copy $DIR to the GPU machine and run: GPU_WHEELS=<that folder> bash scripts/gpu_check.sh"
fi
