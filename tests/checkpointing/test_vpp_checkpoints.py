"""Interleaved pipeline (PP 2 x VPP 2, two model chunks per rank) training checkpoints, with the
distributed optimizer and without: a run through ``scripts/pretrain_dpo.sh`` saves after every
step, resuming it at VPP 2 repeats the uninterrupted run exactly, and its checkpoints reshard to
the non-interleaved PP 2 layout and back.

The first save is the one that guards the chunks' keys: the chunks' local keys collide, so
merging their sharded state dicts into one flat dict before the optimizer maps its parameters
ends the run at once (``Model param ... not in model_sharded_state_dict``).

Two rank-worlds of 2 ranks: the launcher's run, then one world for every resume (the layout is
switched inside it). All runs start from one tiny random Llama folder (4 layers: one per chunk),
so policy and reference are the same model at every layout.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tests.multirank import run_ranks
from tests.scripts import run_script
from tests.training.test_lifecycle import (
    assert_same_tensors,
    fixture_data_overrides,
    model_tensors,
    read_metrics,
    write_fixture,
)

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VPP = ["parallel.virtual_pipeline_model_parallel_size=2"]
NO_DIST_OPT = ["train.use_distributed_optimizer=false"]


def _args(data_file, tok_dir, hf_dir):
    """The overrides every run shares (4 steps at PP 2, a checkpoint after each)."""
    return [
        *fixture_data_overrides(data_file, tok_dir),
        f"model.hf_path={hf_dir}",
        "train.micro_batch_size=1",
        "train.global_batch_size=4",
        "train.lr=1e-3",
        "train.lr_decay_style=cosine",
        "train.lr_warmup_iters=1",
        "train.weight_decay=0.01",
        "train.train_iters=4",
        "logging.tensorboard=false",
        "checkpoint.save_interval=1",
        "checkpoint.keep_last_n=0",
        "parallel.pipeline_model_parallel_size=2",
    ]


def _ckpt(root, run, step):
    return os.path.join(root, run, "checkpoints", f"iter_{step:07d}")


def _cut_back(root, run, resumed, step):
    """A copy of ``run`` as if it had been stopped after ``step``'s checkpoint (rank 0); its
    later metrics records are removed too, so the resumed run's are the only ones."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        shutil.copytree(os.path.join(root, run), os.path.join(root, resumed))
        for later in range(step + 1, 5):
            shutil.rmtree(_ckpt(root, resumed, later))
        with open(os.path.join(root, resumed, "metrics.jsonl")) as f:
            kept = [line for line in f if json.loads(line)["step"] <= step]
        with open(os.path.join(root, resumed, "metrics.jsonl"), "w") as f:
            f.writelines(kept)
    dist.barrier()


def _resumes(root, config_file, args):
    """Every resume, in one 2-rank world: at VPP 2 (exact), VPP 2 -> PP 2 and PP 2 -> VPP 2,
    with the distributed optimizer (from the launcher's run ``dist_full``) and without (its
    own uninterrupted run ``plain_full`` first)."""
    from megatron.core import parallel_state as ps

    from dpo_megatron.cli.train import train
    from dpo_megatron.config import load_config
    from dpo_megatron.parallel import ParallelConfig, initialize_distributed

    initialize_distributed(
        ParallelConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    )

    def run(name, *extra):
        train(load_config(config_file, [*args, f"run_dir={os.path.join(root, name)}", *extra]))

    def switch_layout():  # the next train() builds the groups of its own layout
        ps.destroy_model_parallel()

    _cut_back(root, "dist_full", "dist_resumed", 2)
    run("dist_resumed", *VPP, "checkpoint.resume=auto")
    run("plain_full", *VPP, *NO_DIST_OPT)
    _cut_back(root, "plain_full", "plain_resumed", 2)
    run("plain_resumed", *VPP, *NO_DIST_OPT, "checkpoint.resume=auto")
    switch_layout()
    run("dist_pp", f"checkpoint.resume={_ckpt(root, 'dist_full', 2)}")
    run("plain_pp", *NO_DIST_OPT, f"checkpoint.resume={_ckpt(root, 'plain_full', 2)}")
    switch_layout()
    run("dist_vpp_from_pp", *VPP, f"checkpoint.resume={_ckpt(root, 'dist_pp', 3)}")
    run("plain_vpp_from_pp", *VPP, *NO_DIST_OPT, f"checkpoint.resume={_ckpt(root, 'plain_pp', 3)}")


@pytest.fixture(scope="module")
def vpp_runs(tmp_path_factory):
    """The launcher's VPP run (distributed optimizer), then every resume; returns the root."""
    from tests.models.conversion_helpers import save_tiny_hf_folder

    root = tmp_path_factory.mktemp("vpp")
    data_file, tok_dir = write_fixture(root / "data")
    hf_dir = save_tiny_hf_folder("llama", str(root / "hf"), vocab_size=400)
    config_file = root / "tiny.yaml"
    config_file.write_text("loss:\n  name: sigmoid\n  beta: 0.1\n")
    args = _args(data_file, tok_dir, hf_dir)
    out = run_script(
        "scripts/pretrain_dpo.sh",
        "--config",
        str(config_file),
        *args,
        *VPP,
        f"run_dir={root / 'dist_full'}",
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    run_ranks(_resumes, world_size=2, root=str(root), config_file=str(config_file), args=args)
    return root


def _layout(root, run, step):
    with open(os.path.join(_ckpt(root, run, step), "train_state.json")) as f:
        return json.load(f)["layout"]


@pytest.mark.parametrize("optimizer", ["dist", "plain"])
def test_vpp_run_saves_and_resumes_exactly(vpp_runs, optimizer):
    """A VPP run cut after step 2 and resumed at VPP 2 gives the uninterrupted run's loss and
    grad norm at steps 3 and 4 exactly, and bit-identical final weights."""
    full = read_metrics(vpp_runs / f"{optimizer}_full")
    resumed = read_metrics(vpp_runs / f"{optimizer}_resumed")
    assert sorted(full) == sorted(resumed) == [1, 2, 3, 4]
    for step in (3, 4):
        assert resumed[step]["loss"] == full[step]["loss"], step
        assert resumed[step]["grad_norm"] == full[step]["grad_norm"], step
    assert full[4]["loss"] < full[1]["loss"]  # it did train
    layout = _layout(vpp_runs, f"{optimizer}_full", 4)
    assert layout["virtual_pipeline_model_parallel_size"] == 2
    assert layout["use_distributed_optimizer"] == (optimizer == "dist")
    assert_same_tensors(
        model_tensors(_ckpt(vpp_runs, f"{optimizer}_full", 4)),
        model_tensors(_ckpt(vpp_runs, f"{optimizer}_resumed", 4)),
    )


@pytest.mark.parametrize("optimizer", ["dist", "plain"])
def test_vpp_checkpoint_reshards_to_pp_and_back(vpp_runs, optimizer):
    """The VPP 2 run's step-2 checkpoint resumed at PP 2 without interleaving (each rank then
    holds other layers: weights and Adam state resharded), and that run's step-3 checkpoint
    resumed at VPP 2 again: both follow the uninterrupted VPP run to float32 round-off."""
    full = read_metrics(vpp_runs / f"{optimizer}_full")
    pp = read_metrics(vpp_runs / f"{optimizer}_pp")
    back = read_metrics(vpp_runs / f"{optimizer}_vpp_from_pp")
    assert sorted(pp) == [3, 4] and sorted(back) == [4]
    for step in (3, 4):
        assert abs(pp[step]["loss"] - full[step]["loss"]) <= 1e-6, step
        assert abs(pp[step]["grad_norm"] - full[step]["grad_norm"]) <= 1e-6, step
    assert abs(back[4]["loss"] - full[4]["loss"]) <= 1e-6
    assert abs(back[4]["grad_norm"] - full[4]["grad_norm"]) <= 1e-6
    assert _layout(vpp_runs, f"{optimizer}_pp", 4)["virtual_pipeline_model_parallel_size"] is None
    assert (
        _layout(vpp_runs, f"{optimizer}_vpp_from_pp", 4)["virtual_pipeline_model_parallel_size"]
        == 2
    )
