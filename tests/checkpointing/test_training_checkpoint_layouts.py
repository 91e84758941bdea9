"""Training checkpoints at TP 2 x PP 2 with the distributed optimizer: exact resume, and loading
at TP 1 x PP 1 (same log-probs; optimizer state resharded).

All runs start from one initial checkpoint (``model.load``), so policy and reference are the
same model at every layout.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tests.multirank import run_ranks
from tests.training.test_lifecycle import TINY_MODEL, read_metrics, tiny_config, write_fixture

pytestmark = pytest.mark.slow

COMMON = [
    "train.train_iters=4",
    "checkpoint.save_interval=2",
    "checkpoint.keep_last_n=0",
    "train.use_distributed_optimizer=true",
]


def _run_then_resume(root, prefix, data_file, tok_dir, layout):
    """A 4-step run, and a copy of it cut back to step 2 then resumed with resume=auto."""
    import torch.distributed as dist

    from dpo_megatron.cli.train import train

    full = os.path.join(root, prefix + "full")
    resumed = os.path.join(root, prefix + "resumed")
    train(tiny_config(full, data_file, tok_dir, *COMMON, *layout))
    if dist.get_rank() == 0:
        shutil.copytree(full, resumed)
        shutil.rmtree(os.path.join(resumed, "checkpoints", "iter_0000004"))
    dist.barrier()
    train(tiny_config(resumed, data_file, tok_dir, *COMMON, *layout, "checkpoint.resume=auto"))
    return full, resumed


def _save_initial(ckpt_dir):
    from dpo_megatron.checkpointing import save_model_checkpoint
    from dpo_megatron.config import load_config
    from dpo_megatron.models import build_model_chunks
    from dpo_megatron.parallel import ParallelConfig, initialize_distributed, set_seed

    initialize_distributed(ParallelConfig())
    set_seed(5)
    cfg = load_config(
        None, ["data.tokenizer=x", "data.path=unused.jsonl", "model.vocab_size=400", *TINY_MODEL]
    )
    save_model_checkpoint(build_model_chunks(cfg.model, cfg.parallel), ckpt_dir, cfg.model)


def _eval_logps(ckpt_dir, data_file, tok_dir):
    """Per-pair chosen/rejected log-probs of the first 4 pairs under the checkpoint's weights
    (this layout), on the rank that owns them (last stage, TP rank 0); None elsewhere."""
    from megatron.core import parallel_state as ps

    from dpo_megatron.checkpointing import load_model_checkpoint
    from dpo_megatron.data import load_preference_pairs, load_tokenizer
    from dpo_megatron.data.collate import PaddedPairs
    from dpo_megatron.losses import build_loss
    from dpo_megatron.models import build_model_chunks
    from dpo_megatron.training.step import step_forward_backward

    cfg = tiny_config("unused", data_file, tok_dir)
    parallel = cfg.parallel
    parallel.tensor_model_parallel_size = ps.get_tensor_model_parallel_world_size()
    parallel.pipeline_model_parallel_size = ps.get_pipeline_model_parallel_world_size()
    chunks = build_model_chunks(cfg.model, parallel)
    load_model_checkpoint(chunks, ckpt_dir)
    tokenizer = load_tokenizer(tok_dir)
    pairs = load_preference_pairs(cfg.data, tokenizer).train[:4]
    batch = (
        PaddedPairs(tokenizer.pad_token_id, 8 * parallel.tensor_model_parallel_size)
        .build(pairs, [[0, 1], [2, 3]])
        .to_device()
    )
    out = step_forward_backward(
        chunks, None, batch, build_loss({"name": "simpo"}), forward_only=True
    )
    if not (ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0):
        return None
    return {k: out.per_item[k].tolist() for k in ("logps/chosen", "logps/rejected")}


def _tp2pp2_runs(root, data_file, tok_dir, init):
    """4 steps straight; the same run cut after step 2's checkpoint and resumed; log-probs."""
    layout = [
        "parallel.tensor_model_parallel_size=2",
        "parallel.pipeline_model_parallel_size=2",
        f"model.load={init}",
    ]
    full, resumed = _run_then_resume(root, "", data_file, tok_dir, layout)
    return _eval_logps(os.path.join(full, "checkpoints", "iter_0000004"), data_file, tok_dir)


def _tp1_runs(root, data_file, tok_dir, init):
    """At TP 1 x PP 1: log-probs of the TP 2 x PP 2 final checkpoint, and a resume of its step-2
    checkpoint (weights and distributed-optimizer state resharded)."""
    from dpo_megatron.cli.train import train
    from dpo_megatron.parallel import ParallelConfig, initialize_distributed, set_seed

    initialize_distributed(ParallelConfig())
    set_seed(1)
    logps = _eval_logps(
        os.path.join(root, "full", "checkpoints", "iter_0000004"), data_file, tok_dir
    )
    train(
        tiny_config(
            os.path.join(root, "tp1"),
            data_file,
            tok_dir,
            *COMMON,
            f"model.load={init}",
            f"checkpoint.resume={os.path.join(root, 'full', 'checkpoints', 'iter_0000002')}",
        )
    )
    return logps


@pytest.fixture(scope="module")
def tp2pp2_runs(tmp_path_factory):
    """(root, data_file, tok_dir, init, TP 2 x PP 2 log-probs of the final checkpoint)."""
    root = tmp_path_factory.mktemp("tp2pp2")
    data_file, tok_dir = write_fixture(root / "data")
    init = str(root / "init")
    run_ranks(_save_initial, world_size=1, ckpt_dir=init)
    results = run_ranks(
        _tp2pp2_runs, world_size=4, root=str(root), data_file=data_file, tok_dir=tok_dir, init=init
    )
    logps = [r for r in results if r is not None]
    assert len(logps) == 1
    return root, data_file, tok_dir, init, logps[0]


def test_exact_resume_at_tp2_pp2_with_distributed_optimizer(tp2pp2_runs):
    """4 steps straight vs 2 steps + resume for 2: the same loss and grad norm at every step
    (exactly equal here; the bar is 1e-6) and bit-identical final weights."""
    root = tp2pp2_runs[0]
    full, resumed = read_metrics(root / "full"), read_metrics(root / "resumed")
    assert sorted(resumed) == [1, 2, 3, 4]
    for step in (3, 4):
        assert abs(resumed[step]["loss"] - full[step]["loss"]) <= 1e-6, step
        assert abs(resumed[step]["grad_norm"] - full[step]["grad_norm"]) <= 1e-6, step
    assert full[4]["loss"] < full[1]["loss"]  # it did train

    from tests.training.test_lifecycle import assert_same_tensors, model_tensors

    assert_same_tensors(
        model_tensors(root / "full" / "checkpoints" / "iter_0000004"),
        model_tensors(root / "resumed" / "checkpoints" / "iter_0000004"),
    )


def test_tp2_pp2_checkpoint_loads_at_tp1(tp2pp2_runs):
    """The TP 2 x PP 2 checkpoint at TP 1 x PP 1: the same log-probs, and resuming its step-2
    checkpoint (weights and distributed-optimizer state resharded) follows the TP 2 x PP 2 run
    to float32 round-off."""
    root, data_file, tok_dir, init, logps_tp2pp2 = tp2pp2_runs
    logps_tp1 = run_ranks(
        _tp1_runs, world_size=1, root=str(root), data_file=data_file, tok_dir=tok_dir, init=init
    )[0]
    for key in ("logps/chosen", "logps/rejected"):
        assert len(logps_tp1[key]) == 4
        for a, b in zip(logps_tp1[key], logps_tp2pp2[key]):
            assert abs(a - b) <= 1e-4 * max(1.0, abs(b)), (key, a, b)
    full, tp1 = read_metrics(root / "full"), read_metrics(root / "tp1")
    assert sorted(tp1) == [3, 4]
    for step in (3, 4):
        assert abs(tp1[step]["loss"] - full[step]["loss"]) <= 1e-5, step
    state = json.loads(
        (root / "tp1" / "checkpoints" / "iter_0000004" / "train_state.json").read_text()
    )
    assert state["layout"]["tensor_model_parallel_size"] == 1


def _dp2_runs(root, data_file, tok_dir, init):
    """Data parallel 2 (Adam state sharded over the two ranks): 4 steps straight, and the same
    run cut after step 2's checkpoint and resumed."""
    layout = ["parallel.data_parallel_size=2", f"model.load={init}"]
    full, resumed = _run_then_resume(root, "dp2_", data_file, tok_dir, layout)


def _dp1_resume(root, data_file, tok_dir, init):
    from dpo_megatron.cli.train import train

    train(
        tiny_config(
            os.path.join(root, "dp1"),
            data_file,
            tok_dir,
            *COMMON,
            f"model.load={init}",
            "checkpoint.resume=" + os.path.join(root, "dp2_full", "checkpoints", "iter_0000002"),
        )
    )


def test_exact_resume_with_optimizer_sharded_over_dp2_and_resume_at_dp1(tp2pp2_runs):
    root, data_file, tok_dir, init, _ = tp2pp2_runs
    run_ranks(
        _dp2_runs, world_size=2, root=str(root), data_file=data_file, tok_dir=tok_dir, init=init
    )
    full, resumed = read_metrics(root / "dp2_full"), read_metrics(root / "dp2_resumed")
    for step in (3, 4):
        assert resumed[step]["loss"] == full[step]["loss"], step
        assert resumed[step]["grad_norm"] == full[step]["grad_norm"], step
    # Both shards of the DP 2 Adam state, gathered into one rank.
    run_ranks(
        _dp1_resume, world_size=1, root=str(root), data_file=data_file, tok_dir=tok_dir, init=init
    )
    dp1 = read_metrics(root / "dp1")
    for step in (3, 4):
        assert abs(dp1[step]["loss"] - full[step]["loss"]) <= 1e-6, step
