"""A gpt-oss folder saved by transformers through ``scripts/pretrain_dpo.sh model.hf_path=...``
(issue 25's acceptance): the pre-check reads its config.json, one step at lr 0 on four pairs
(one global batch: the step sees every pair) gives loss ln 2, and its ``logps/chosen`` /
``logps/rejected`` are transformers' mean summed completion log-probs of the same pairs,
tokenized by the engine's own data path, within 1e-5 relative (fp32)."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from tests.models.conversion_helpers import build_tiny_hf_model, save_tiny_hf_folder
from tests.training.test_lifecycle import read_metrics, write_fixture

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = dict(format="standard", max_length=32, max_prompt_length=16)
"""The run's data settings, also used to tokenize the pairs for transformers here."""


def _hf_logps(data_file: str, tok_dir: str) -> tuple[float, float]:
    """transformers' mean summed completion log-probs (chosen, rejected) of the file's pairs."""
    from dpo_megatron.data import DataConfig, load_preference_pairs, load_tokenizer

    pairs = load_preference_pairs(DataConfig(path=data_file, **DATA), load_tokenizer(tok_dir)).train
    model = build_tiny_hf_model("gpt_oss", vocab_size=400)
    sums = {"chosen": [], "rejected": []}
    with torch.no_grad():
        for pair in pairs:
            for side in sums:
                completion = list(getattr(pair, f"{side}_ids"))
                ids = torch.tensor([list(pair.prompt_ids) + completion])
                logps = model(input_ids=ids).logits[0, :-1].log_softmax(-1)
                per_token = logps.gather(-1, ids[0, 1:, None])[:, 0]
                sums[side].append(per_token[-len(completion) :].sum().item())
    assert len(sums["chosen"]) == 4
    return tuple(sum(v) / len(v) for v in (sums["chosen"], sums["rejected"]))


@pytest.mark.slow
def test_a_gpt_oss_folder_trains_one_step_through_the_launcher(tmp_path):
    data_file, tok_dir = write_fixture(tmp_path / "data", rows=4)
    hf_dir = save_tiny_hf_folder("gpt_oss", str(tmp_path / "hf"), vocab_size=400)
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        env.pop(k, None)
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [
            "bash",
            "scripts/pretrain_dpo.sh",
            "--config",
            "configs/tiny_cpu.yaml",
            f"run_dir={run_dir}",
            f"model.hf_path={hf_dir}",
            "model.params_dtype=float32",
            f"data.path={data_file}",
            f"data.tokenizer={tok_dir}",
            *(f"data.{k}={v}" for k, v in DATA.items()),
            "data.cache_dir=none",
            "train.micro_batch_size=2",
            "train.global_batch_size=4",
            "train.train_iters=1",
            "train.lr=0",
            "checkpoint.save_interval=0",
            "logging.tensorboard=false",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    step = read_metrics(run_dir)[1]
    assert step["loss"] == pytest.approx(math.log(2), abs=1e-7)
    for key, want in zip(("logps/chosen", "logps/rejected"), _hf_logps(data_file, tok_dir)):
        assert abs(step[key] - want) <= 1e-5 * abs(want), (key, step[key], want)
