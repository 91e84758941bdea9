"""The newer architectures through the launcher, each in an interleaved pipeline: a tiny random
model of each architecture, saved by transformers, trains one step through
``scripts/pretrain_dpo.sh model.hf_path=...`` at lr 0 and reproduces transformers' log-probs,
at PP 2 x VPP 2.

Each family's tiny random transformers folder (4 layers, vocabulary of the tiny tokenizer) trains
one step of 4 pairs at PP 2 x VPP 2 (one layer per model chunk, so every per-layer pattern -
sliding windows, NoPE layers, dense first layers, local RoPE - is read at its global layer number
on another chunk than its neighbours) with ``train.lr=0``. The step's ``logps/chosen`` /
``logps/rejected`` (mean summed completion log-prob, nats) must equal transformers' on the same
token ids within 1e-5 relative, the loss must be ln 2, and the checkpoint must be written. The
token ids come from the engine's own data pipeline (``load_items``) on the same file and
tokenizer, so the comparison is of the model alone.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.models.conversion_helpers import completion_logps, save_tiny_hf_folder
from tests.scripts import run_script
from tests.training.test_lifecycle import fixture_data_overrides, read_metrics, write_fixture

pytestmark = pytest.mark.slow

NEW_FAMILIES = ["smollm3", "olmo3", "gemma3", "deepseek_v3", "gpt_oss"]
PAIRS = 4  # one step of every pair: the logged means do not depend on the order
VOCAB = 400  # the tiny tokenizer's


@pytest.fixture(scope="module")
def fixture(tmp_path_factory):
    root = tmp_path_factory.mktemp("architecture_launches")
    data_file, tok_dir = write_fixture(root / "data", rows=PAIRS, seed=1)
    config = root / "run.yaml"  # the package defaults (one rank, no eval split) and DPO
    config.write_text("loss:\n  name: sigmoid\n  beta: 0.1\n")
    return str(config), data_file, tok_dir


def _overrides(config, run_dir, data_file, tok_dir, hf_dir):
    return [
        "--config",
        config,
        f"run_dir={run_dir}",
        f"model.hf_path={hf_dir}",
        *fixture_data_overrides(data_file, tok_dir),
        "train.micro_batch_size=1",
        f"train.global_batch_size={PAIRS}",
        "train.train_iters=1",
        "train.lr=0",
        "logging.tensorboard=false",
        "parallel.pipeline_model_parallel_size=2",
        "parallel.virtual_pipeline_model_parallel_size=2",
    ]


def _hf_means(config, hf_dir, data_file, tok_dir):
    """transformers' mean summed completion log-probs (chosen, rejected) over the pairs the
    engine's data pipeline builds from the file."""
    from transformers import AutoModelForCausalLM

    from dpo_megatron.config import load_config
    from dpo_megatron.data import load_tokenizer
    from dpo_megatron.data.pipeline import load_items

    args = _overrides(config, "unused", data_file, tok_dir, hf_dir)
    cfg = load_config(args[1], args[2:])
    pairs = load_items(cfg.data, load_tokenizer(tok_dir), "pairs").train
    assert len(pairs) == PAIRS
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    sums = completion_logps(model, pairs)
    return {f"logps/{side}": sum(v) / len(v) for side, v in sums.items()}


@pytest.mark.parametrize("arch", NEW_FAMILIES)
def test_new_architecture_trains_through_the_launcher_at_vpp(fixture, arch, tmp_path):
    config, data_file, tok_dir = fixture
    hf_dir = save_tiny_hf_folder(arch, str(tmp_path / "hf"), vocab_size=VOCAB)
    run_dir = tmp_path / "run"
    out = run_script(
        "scripts/pretrain_dpo.sh", *_overrides(config, run_dir, data_file, tok_dir, hf_dir)
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    step = read_metrics(run_dir)[1]
    assert step["loss"] == pytest.approx(math.log(2), abs=1e-7)
    for key, want in _hf_means(config, hf_dir, data_file, tok_dir).items():
        assert abs(step[key] - want) <= 1e-5 * abs(want), (arch, key, step[key], want)
    with open(run_dir / "checkpoints" / "iter_0000001" / "train_state.json") as f:
        layout = json.load(f)["layout"]
    assert (
        layout["pipeline_model_parallel_size"],
        layout["virtual_pipeline_model_parallel_size"],
    ) == (2, 2)
