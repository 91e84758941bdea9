"""Mistral- and Mixtral-family Hugging Face folders through the launcher.

Each folder is a tiny random model built with transformers plus the real Mistral-7B v0.1
SentencePiece tokenizer from the offline cache (``tokenizer.model`` + ``tokenizer_config.json``),
as a Mistral / Mixtral repo ships it.

* transformers.AutoTokenizer routes ``mistral`` / ``mixtral`` folders through ``mistral_common``
  whenever it is importable. Earlier set-ups installed it ``--no-deps`` (to read the SentencePiece
  file); its Tekken tokenizer then failed on the missing ``tiktoken`` and the launcher's
  pre-check ended in a raw traceback. The assets step now reads the file from the downloaded
  wheel and ``scripts/setup.sh`` removes such an install; the runs here happen in that
  environment (``mistral_common`` absent: a ``sitecustomize`` on PYTHONPATH hides whatever this
  machine's venv still holds), and a partial install left in place is named in one line.
* An MoE model at TP 2 without ``parallel.sequence_parallel=true`` was refused; sequence
  parallelism is now turned on (megatron-core requires it) and the output says so.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER_CONFIG = {
    "tokenizer_class": "LlamaTokenizer",
    "bos_token": "<s>",
    "eos_token": "</s>",
    "unk_token": "<unk>",
    "add_bos_token": True,
    "add_eos_token": False,
    "model_max_length": 32768,
}
SP_NOTE = (
    "note: parallel.sequence_parallel turned on: megatron-core's mixture-of-experts layer "
    "(4 experts) needs it at parallel.tensor_model_parallel_size=2"
)


def test_sequence_parallel_is_required_only_for_moe_at_tp_above_1():
    from dpo_megatron.models import ModelConfig
    from dpo_megatron.parallel import ParallelConfig
    from dpo_megatron.training.run_models import require_sequence_parallel

    def resolved(tp, experts, sp=False):
        given = ParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=sp)
        parallel, note = require_sequence_parallel(given, ModelConfig(num_experts=experts))
        assert given.sequence_parallel is sp  # the layout given is not changed
        return note, parallel.sequence_parallel

    assert resolved(2, 4) == (SP_NOTE, True)
    assert resolved(1, 4) == (None, False)
    assert resolved(2, None) == (None, False)
    assert resolved(2, 4, sp=True) == (None, True)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{"mistral": folder, "mixtral": folder, "data": preference file, "config": YAML}."""
    from tests.scripts import load_script

    ensure_sentencepiece_model = load_script("assets").ensure_sentencepiece_model
    from tests.models.conversion_helpers import save_tiny_hf_folder
    from tests.training.test_lifecycle import write_fixture

    root = tmp_path_factory.mktemp("mistral_family")
    out = {}
    for arch in ("mistral", "mixtral"):
        folder = save_tiny_hf_folder(arch, str(root / arch), vocab_size=32000)
        shutil.copyfile(ensure_sentencepiece_model(), os.path.join(folder, "tokenizer.model"))
        with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
            json.dump(TOKENIZER_CONFIG, f)
        out[arch] = folder
    out["data"], _ = write_fixture(root / "data")
    out["config"] = str(root / "run.yaml")
    with open(out["config"], "w") as f:
        f.write("loss:\n  name: sigmoid\n  beta: 0.1\n")
    return out


def _env(extra_path):
    from tests.scripts import launcher_env

    return launcher_env(PYTHONPATH=f"{ROOT}:{extra_path}", HF_DATASETS_DISABLE_PROGRESS_BARS="1")


def _args(folders, arch, *extra):
    return [
        "--config",
        folders["config"],
        f"model.hf_path={folders[arch]}",
        f"data.path={folders['data']}",
        "data.format=standard",
        "data.max_length=32",
        "data.max_prompt_length=16",
        "train.micro_batch_size=1",
        "train.global_batch_size=2",
        "train.train_iters=1",
        "logging.tensorboard=false",
        *extra,
    ]


@pytest.fixture(scope="module")
def without_mistral_common(tmp_path_factory):
    """A PYTHONPATH folder whose sitecustomize makes ``mistral_common`` absent in every process
    (``importlib.util.find_spec`` gives None, an import fails): the venv setup.sh now makes."""
    folder = tmp_path_factory.mktemp("no_mistral_common")
    (folder / "sitecustomize.py").write_text("import sys\nsys.modules['mistral_common'] = None\n")
    return str(folder)


@pytest.fixture(scope="module")
def partial_mistral_common(tmp_path_factory):
    """A PYTHONPATH folder holding mistral-common installed ``--no-deps``, as earlier set-ups
    left it in the venv."""
    from tests.scripts import load_script

    MISTRAL_COMMON_PACKAGE = load_script("assets").MISTRAL_COMMON_PACKAGE

    folder = tmp_path_factory.mktemp("partial_mistral_common")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--target",
            str(folder),
            MISTRAL_COMMON_PACKAGE,
        ],
        check=True,
        capture_output=True,
    )
    return str(folder)


@pytest.mark.slow
def test_a_partial_mistral_common_stops_the_precheck_with_one_line(folders, partial_mistral_common):
    """A mistral-common installed without its dependencies stops the pre-check with one line
    saying so (not a traceback ending in ``ModuleNotFoundError: No module named 'tiktoken'``)."""
    env = _env(partial_mistral_common)
    missing = subprocess.run(  # the module the partial install misses (tiktoken here)
        [
            sys.executable,
            "-c",
            "try:\n import mistral_common.tokens.tokenizers.tekken\n"
            "except ImportError as e:\n print(e.name)",
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert missing
    out = subprocess.run(
        [sys.executable, "-m", "dpo_megatron.config", *_args(folders, "mistral")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 1
    assert out.stderr.splitlines() == [
        f"config error: cannot load the tokenizer of {folders['mistral']}: transformers reads "
        f"Mistral-family tokenizers through mistral-common, installed in {sys.prefix} without "
        f"its dependency {missing}; run `bash scripts/setup.sh` again (it removes that install) "
        f"or `{sys.executable} -m pip uninstall mistral-common`"
    ], out.stderr[-3000:]


def _launch(folders, arch, run_dir, env, *extra):
    from tests.scripts import run_script

    out = run_script(
        "scripts/pretrain_dpo.sh", *_args(folders, arch, *extra), f"run_dir={run_dir}", env=env
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"\[train\] step 1/1 \| loss ([0-9.]+)", out.stdout)]
    assert len(losses) == 1 and abs(losses[0] - math.log(2)) < 1e-4, out.stdout[-3000:]
    assert os.path.isfile(os.path.join(run_dir, "checkpoints", "iter_0000001", "manifest.json"))
    return out


@pytest.mark.slow
def test_mistral_and_mixtral_folders_train_through_the_launcher(
    folders, without_mistral_common, tmp_path
):
    """The pre-check and one step of each folder with its SentencePiece tokenizer; the Mixtral
    one at TP 2 without ``parallel.sequence_parallel`` (turned on, and said so by the pre-check
    and by rank 0): neither the Mistral-format branch's traceback nor a config error asking
    for ``parallel.sequence_parallel=true``."""
    env = _env(without_mistral_common)
    mistral = _launch(folders, "mistral", str(tmp_path / "mistral"), env)
    assert "layout TP 1 x PP 1 x DP 1" in mistral.stdout and SP_NOTE not in mistral.stdout
    mixtral = _launch(
        folders, "mixtral", str(tmp_path / "mixtral"), env, "parallel.tensor_model_parallel_size=2"
    )
    assert mixtral.stderr.splitlines().count(SP_NOTE) == 1, mixtral.stderr[-3000:]  # pre-check
    assert mixtral.stdout.splitlines().count(SP_NOTE) == 1, mixtral.stdout[-3000:]  # rank 0
    assert "layout TP 2 x PP 1 x DP 1" in mixtral.stdout
    with open(tmp_path / "mixtral" / "checkpoints" / "iter_0000001" / "train_state.json") as f:
        assert json.load(f)["layout"]["tensor_model_parallel_size"] == 2
