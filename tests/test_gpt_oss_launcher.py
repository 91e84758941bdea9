"""A gpt-oss folder saved by transformers through ``scripts/pretrain_dpo.sh model.hf_path=...``
(issue 25's acceptance): the pre-check reads its config.json, one step at lr 0 on four pairs
(one global batch: the step sees every pair) gives loss ln 2, and its ``logps/chosen`` /
``logps/rejected`` are transformers' mean summed completion log-probs of the same pairs,
tokenized by the engine's own data path, within 1e-5 relative (fp32)."""

from __future__ import annotations

import math

import pytest

from tests.models.conversion_helpers import save_tiny_hf_folder
from tests.training.test_bf16_architectures import _hf_logps as hf_mean_logps
from tests.training.test_lifecycle import read_metrics, write_fixture
from tests.training.test_losses_in_engine import _launch

DATA = dict(format="standard", max_length=32, max_prompt_length=16)
"""The run's data settings, also used to tokenize the pairs for transformers here."""


def _hf_logps(data_file: str, tok_dir: str) -> tuple[float, float]:
    """transformers' mean summed completion log-probs (chosen, rejected) of the file's pairs,
    tokenized by the engine's data path."""
    from dpo_megatron.data import DataConfig, load_preference_pairs, load_tokenizer

    pairs = load_preference_pairs(DataConfig(path=data_file, **DATA), load_tokenizer(tok_dir)).train
    assert len(pairs) == 4
    return hf_mean_logps("gpt_oss", pairs, vocab_size=400)


@pytest.mark.slow
def test_a_gpt_oss_folder_trains_one_step_through_the_launcher(tmp_path):
    data_file, tok_dir = write_fixture(tmp_path / "data", rows=4)
    hf_dir = save_tiny_hf_folder("gpt_oss", str(tmp_path / "hf"), vocab_size=400)
    run_dir = tmp_path / "run"
    out = _launch(  # configs/tiny_cpu.yaml, one step
        run_dir,
        f"model.hf_path={hf_dir}",
        "model.params_dtype=float32",
        f"data.path={data_file}",
        f"data.tokenizer={tok_dir}",
        *(f"data.{k}={v}" for k, v in DATA.items()),
        "data.cache_dir=none",
        "train.micro_batch_size=2",
        "train.global_batch_size=4",
        "train.lr=0",
        "checkpoint.save_interval=0",
        "logging.tensorboard=false",
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    step = read_metrics(run_dir)[1]
    assert step["loss"] == pytest.approx(math.log(2), abs=1e-7)
    for key, want in zip(("logps/chosen", "logps/rejected"), _hf_logps(data_file, tok_dir)):
        assert abs(step[key] - want) <= 1e-5 * abs(want), (key, step[key], want)
