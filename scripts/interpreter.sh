# Sourced by the launchers (pretrain_dpo.sh, train_reference_style.sh, gpu_check.sh,
# slurm/node_env.sh): the interpreter, one copy. Needs ROOT. Sets PYTHON: $PYTHON, else ROOT's
# .venv (a set-up machine), else python3 (a bare machine).
if [[ -n "${PYTHON:-}" ]]; then :
elif [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"
else PYTHON=python3; fi
