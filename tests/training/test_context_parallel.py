"""Context parallelism: per-sequence log-probs, loss and gradient norm at CP 2 (and CP 4) equal
CP 1, alone and combined with TP, PP, DP, sequence parallelism, recompute and packing.

Every layout runs the real ``Trainer`` from one distributed checkpoint written at CP 1 (CP does
not change parameter shards, so the same checkpoint loads at every CP size). Pairs have odd
lengths, so rows are padded to whole 2 x CP chunks and chunks hold prompt, completion and padding
tokens in every mix.

The cases of one world size run in one rank-world, one after the other (``run_cases``): the
module fixture ``runs`` starts four worlds instead of one per case.
"""

import math

import pytest

from tests.engine import (
    assert_step_zero_is_exact,
    long_lengths,
    owns_results,
    step_record,
    tiny_pairs,
    tiny_trainer,
    train_step_against_reference,
)
from tests.multirank import run_cases

pytestmark = pytest.mark.slow

GLOBAL_PAIRS = 4


def _run_layout(ckpt_dir, steps=2, host_check=False, **layout):
    """``steps`` optimizer steps of the real trainer over the same pairs (optionally under
    ``HostTensorCheck``)."""
    import contextlib

    from megatron.core import parallel_state as ps

    from tests.host_tensors import HostTensorCheck

    check = HostTensorCheck() if host_check else contextlib.nullcontext()
    with check:
        trainer = tiny_trainer(
            tiny_pairs(GLOBAL_PAIRS, seed=5, lengths=long_lengths),
            load=ckpt_dir,
            global_batch_size=GLOBAL_PAIRS,
            steps=steps,
            lr=1e-3,
            seed=11,
            **layout,
        )
        history = [step_record(*train_step_against_reference(trainer))]
        history += [step_record(*trainer.train_step()) for _ in range(steps - 1)]
    trainer.close()
    return {
        "dp_rank": ps.get_data_parallel_rank(),
        "owner": owns_results(),
        "cp_rank": ps.get_context_parallel_rank(),
        "history": history,
        "host_report": check.report() if host_check else "",
    }


def _per_pair(results, step, key):
    """Per-pair values of every DP rank (CP rank 0 of each), in global pair order."""
    owners = sorted(
        (r for r in results if r["owner"] and r["cp_rank"] == 0), key=lambda r: r["dp_rank"]
    )
    return [v for r in owners for v in r["history"][step]["per_item"][key]]


def _rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def _assert_matches(results, baseline):
    step0 = results[0]["history"][0]["metrics"]
    assert abs(step0["loss"] - math.log(2)) < 1e-6  # policy == reference at step 0
    for r in results:  # bit for bit on every last-stage rank (each CP rank's sum included)
        if r["owner"]:
            assert_step_zero_is_exact(r["history"][0])
    for step in range(2):  # step 1 runs after one optimizer update
        got, want = results[0]["history"][step], baseline[0]["history"][step]
        for key in ("loss", "rewards/margins", "logps/chosen", "logps/rejected"):
            assert _rel(got["metrics"][key], want["metrics"][key]) < 1e-5, (step, key)
        assert _rel(got["grad_norm"], want["grad_norm"]) < 1e-5, step
        for key in ("logps/chosen", "logps/rejected", "loss"):
            for a, b in zip(
                _per_pair(results, step, key), _per_pair(baseline, step, key), strict=True
            ):
                assert _rel(a, b) < 1e-5, (step, key)
    # Every rank (each CP rank included) reports the same metrics.
    assert all(r["history"][1]["metrics"] == results[0]["history"][1]["metrics"] for r in results)


LAYOUTS = {  # name: (world size, layout)
    "cp2": (2, dict(cp=2)),
    "cp4": (4, dict(cp=4)),
    "cp2_tp2_sp": (4, dict(cp=2, tp=2, sp=True)),
    "cp2_pp2": (4, dict(cp=2, pp=2)),
    "cp2_pp2_vpp2": (4, dict(cp=2, pp=2, vpp=2, micro_batch_size=1)),
    "cp2_dp2": (4, dict(cp=2)),
    "cp2_recompute": (
        2,
        dict(
            cp=2,
            model={
                "recompute_granularity": "full",
                "recompute_method": "uniform",
                "recompute_num_layers": 1,
            },
        ),
    ),
}

PACKED = {  # name: (world size, layout); each unit padded to 2 x CP and cut unit by unit
    "packed_cp2": (2, dict(cp=2, packing=True)),
    "packed_cp2_tp2_sp": (4, dict(cp=2, tp=2, sp=True, packing=True)),
    "packed_rows_cp2": (2, dict(cp=2, packing=True, packing_row_length=32)),
    "shared_prompt_cp2": (2, dict(cp=2, packing=True, share_prompt=True)),
    "shared_prompt_cp4": (4, dict(cp=4, packing=True, share_prompt=True)),
    "shared_prompt_cp2_pp2": (4, dict(cp=2, pp=2, packing=True, share_prompt=True)),
    # the reference pass run once before training, under CP, then freed
    "precomputed_shared_prompt_cp2": (
        2,
        dict(cp=2, packing=True, share_prompt=True, reference_mode="precomputed"),
    ),
}

HOST_CHECK = dict(steps=1, host_check=True, cp=2, packing=True, share_prompt=True)

RESHARD = [(2, 1), (1, 2)]  # (CP of the save, CP of the resume)


def _checkpoint_run(ckpt_dir, run_dir, cp, resume="none"):
    """From the shared initial weights: without ``resume``, step 1, a checkpoint, step 2; with
    it, resume the step-1 checkpoint at this CP size and take step 2."""
    trainer = tiny_trainer(
        tiny_pairs(GLOBAL_PAIRS, seed=5, lengths=long_lengths),
        load=ckpt_dir,
        global_batch_size=GLOBAL_PAIRS,
        micro_batch_size=2,
        steps=2,
        lr=1e-3,
        seed=11,
        cp=cp,
        run_dir=run_dir,
        resume=resume,
        use_distributed_optimizer=True,
    )
    history = []
    if resume == "none":
        history.append(step_record(*trainer.train_step()))
        trainer.checkpointer.save(trainer.counters)
    history.append(step_record(*trainer.train_step()))
    out = {
        "history": history,
        "saved": trainer.checkpointer.latest(),
        "step": trainer.counters.step,
    }
    trainer.close()
    return out


@pytest.fixture(scope="module")
def runs(initial_checkpoint, tmp_path_factory):
    """Every case's per-rank results by name: ``baseline`` (CP 1 padded, micro-batches of 2),
    each name of LAYOUTS and PACKED, ``host_check``, and ``save_cp{s}_load_cp{l}/first`` and
    ``/resumed`` for each (s, l) of RESHARD. Four rank-worlds: CP 1 (baseline, the CP 1 saves),
    2, 4, and CP 1 again (the resumes of the CP 2 saves)."""
    root = tmp_path_factory.mktemp("cp_reshard")

    def reshard_dir(save_cp, load_cp, part):
        return str(root / f"save_cp{save_cp}_load_cp{load_cp}" / part)

    by_world: dict[int, dict] = {1: {}, 2: {}, 4: {}}
    ckpt = {"ckpt_dir": initial_checkpoint}
    by_world[1]["baseline"] = (_run_layout, dict(**ckpt, micro_batch_size=2))
    for name, (world, layout) in {**LAYOUTS, **PACKED}.items():
        by_world[world][name] = (_run_layout, {**ckpt, "micro_batch_size": 2, **layout})
    by_world[2]["host_check"] = (_run_layout, {**ckpt, "micro_batch_size": 2, **HOST_CHECK})
    for save_cp, load_cp in RESHARD:
        by_world[save_cp][f"save_cp{save_cp}_load_cp{load_cp}/first"] = (
            _checkpoint_run,
            dict(**ckpt, run_dir=reshard_dir(save_cp, load_cp, "first"), cp=save_cp),
        )
    resumes = {}
    for save_cp, load_cp in RESHARD:
        resumes[load_cp] = {
            f"save_cp{save_cp}_load_cp{load_cp}/resumed": (
                _checkpoint_run,
                dict(
                    **ckpt,
                    run_dir=reshard_dir(save_cp, load_cp, "resumed"),
                    cp=load_cp,
                    resume=reshard_dir(save_cp, load_cp, "first") + "/checkpoints/iter_0000001",
                ),
            )
        }
    by_world[2].update(resumes[2])  # its checkpoint is saved in world 1, which runs first

    out = {}
    for world, cases in [(1, by_world[1]), (2, by_world[2]), (4, by_world[4]), (1, resumes[1])]:
        out.update(run_cases(world, cases))
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_context_parallel_matches_cp1(runs, name):
    _assert_matches(runs[name], runs["baseline"])


@pytest.mark.parametrize("name", list(PACKED))
def test_packed_and_shared_prompt_context_parallel_match_padded_cp1(runs, name):
    _assert_matches(runs[name], runs["baseline"])


def test_context_parallel_leaves_no_tensor_on_the_host(runs):
    for rank, r in enumerate(runs["host_check"]):
        assert r["host_report"] == "", f"rank {rank}:\n{r['host_report']}"


@pytest.mark.parametrize("save_cp, load_cp", RESHARD)
def test_checkpoints_reshard_across_context_parallel_sizes(runs, save_cp, load_cp):
    """A checkpoint (weights + distributed-optimizer state) saved at one CP size resumes at
    another: step 2 after the resume equals step 2 of the uninterrupted run (1e-5)."""
    first = runs[f"save_cp{save_cp}_load_cp{load_cp}/first"]
    resumed = runs[f"save_cp{save_cp}_load_cp{load_cp}/resumed"]
    assert resumed[0]["step"] == 2
    # the checkpoint the resume was given
    assert first[0]["saved"].endswith(
        f"save_cp{save_cp}_load_cp{load_cp}/first/checkpoints/iter_0000001"
    )
    want, got = first[0]["history"][1], resumed[0]["history"][0]
    for key in ("loss", "logps/chosen", "logps/rejected", "rewards/margins"):
        assert _rel(got["metrics"][key], want["metrics"][key]) < 1e-5, key
    assert _rel(got["grad_norm"], want["grad_norm"]) < 1e-5
