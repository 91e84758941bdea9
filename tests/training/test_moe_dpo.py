"""DPO on the new architectures through the real ``Trainer``: ln 2 at step 0, the same numbers at
TP 2 x PP 2 (mixture of experts: also with expert parallel 2) as on one rank, exact resume, MoE
checkpoints that reshard between EP 1 and EP 2, and the load-balancing loss against
transformers.

Every run starts from the same tiny random transformers folder (``model.hf_path``), so policy
and reference are the same model at every layout. The runs of one layout family share one
launch: megatron-core's parallel state is rebuilt between them (:func:`run_plans`).
"""

from __future__ import annotations

import math
import os

import pytest

from tests.engine import tiny_pairs, tiny_trainer
from tests.models.conversion_helpers import save_tiny_hf_folder
from tests.multirank import run_ranks
from tests.training.test_lifecycle import read_metrics

VOCAB = 128  # the tiny HF configs' vocabulary
STEPS = 4
MOE_KEYS = ("moe/load_balancing_loss", "moe/aux_loss")


def run_plans(root: str, plans: list[dict]) -> None:
    """Train each plan in turn on these ranks: ``name`` (run folder under ``root``), ``hf_dir``
    (the tiny transformers folder to start from), ``tp``, ``pp``, ``ep``, ``etp``, ``resume``
    ('none' or a plan name whose step-2 checkpoint to resume). 8 pairs per step in micro-batches
    of 2, a checkpoint at step 2 of the plans that another resumes (no other save), metrics in
    ``<root>/<name>/metrics.jsonl``."""
    from megatron.core import parallel_state as ps

    from dpo_megatron.models.conversion import model_config_from_hf

    sources = {plan["resume"] for plan in plans if plan.get("resume", "none") != "none"}
    for plan in plans:
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()  # the next plan may use another layout
        hf_dir = plan["hf_dir"]
        moe = bool(model_config_from_hf(hf_dir).num_experts)
        resume = plan.get("resume", "none")
        if resume != "none":
            resume = os.path.join(root, resume, "checkpoints", "iter_0000002")
        tp = plan.get("tp", 1)
        trainer = tiny_trainer(
            tiny_pairs(8, vocab=VOCAB),
            tp=tp,
            pp=plan.get("pp", 1),
            ep=plan.get("ep", 1),
            etp=plan.get("etp"),
            sp=moe and tp > 1,
            micro_batch_size=2,
            global_batch_size=8,
            steps=STEPS,
            lr=1e-3,
            seed=11,
            run_dir=os.path.join(root, plan["name"]),
            resume=resume,
            model={"hf_path": hf_dir, "params_dtype": "float32", "transformer_impl": "local"},
        )
        # Only the step-2 checkpoints that a later plan resumes are read: the others (every
        # plan's last step, always saved) would cost a collective save each for nothing.
        trainer.checkpointer.due = lambda step, last_step, keep=plan["name"] in sources: (
            keep and step == 2
        )
        trainer.train()


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _assert_same(got: dict, want: dict, steps, tol: float, what: str) -> None:
    for step in steps:
        for key in ("loss", "grad_norm", "rewards/margins", "logps/chosen") + tuple(
            k for k in MOE_KEYS if k in want[step]
        ):
            assert _rel(got[step][key], want[step][key]) <= tol, (what, step, key)


def _starts_at_ln2(metrics: dict, moe: bool) -> None:
    """Step 1 (policy == reference, routing alike): preference loss exactly ln 2, zero margins;
    the load-balancing term is reported beside it, not inside it."""
    first = metrics[1]
    assert abs(first["loss"] - math.log(2)) < 1e-6
    assert first["rewards/margins"] == 0 and first["rewards/chosen"] == 0
    if moe:
        assert first["moe/aux_loss"] > 0 and first["moe/load_balancing_loss"] >= 1.0
    else:
        assert not any(k in first for k in MOE_KEYS)
    assert metrics[STEPS]["loss"] < first["loss"]  # it trains


TP2PP2 = dict(tp=2, pp=2)
EP1, EP2 = dict(**TP2PP2, ep=1), dict(**TP2PP2, ep=2, etp=1)
DENSE_PLANS = [{"name": "tp2pp2", **TP2PP2}, {"name": "resumed", **TP2PP2, "resume": "tp2pp2"}]
PLANS = {  # architecture: its 4-rank plans (each also runs on one rank as "single")
    "qwen3": DENSE_PLANS,
    "gpt_neox": DENSE_PLANS,
    "qwen3_moe": [
        {"name": "ep1", **EP1},
        {"name": "ep1_resumed", **EP1, "resume": "ep1"},
        {"name": "ep2", **EP2},
        {"name": "ep2_from_ep1", **EP2, "resume": "ep1"},
        {"name": "ep1_from_ep2", **EP1, "resume": "ep2"},
        {"name": "etp2", "tp": 2, "ep": 2, "etp": 2},
    ],
    "mixtral": [{"name": "ep2", **EP2}],
    "gpt_oss": [{"name": "ep2", **EP2}],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``{arch: {plan name: metrics by step}}`` for every plan of PLANS and ``single`` (one
    rank): one launch of 1 rank and one of 4 ranks for all architectures."""
    root = tmp_path_factory.mktemp("moe_dpo")
    single, four = [], []
    for arch, plans in PLANS.items():
        hf_dir = save_tiny_hf_folder(arch, str(root / "hf" / arch))
        single.append({"name": f"{arch}/single", "hf_dir": hf_dir})
        for plan in plans:
            four.append({**plan, "name": f"{arch}/{plan['name']}", "hf_dir": hf_dir})
            if "resume" in plan:
                four[-1]["resume"] = f"{arch}/{plan['resume']}"
    run_ranks(run_plans, world_size=1, root=str(root), plans=single)
    run_ranks(run_plans, world_size=4, timeout=3600, root=str(root), plans=four)
    return {
        arch: {
            name: read_metrics(root / arch / name)
            for name in ["single"] + [p["name"] for p in plans]
        }
        for arch, plans in PLANS.items()
    }


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3", "gpt_neox"])
def test_dense_dpo_at_tp2_pp2_matches_one_rank_and_resumes_exactly(runs, arch):
    runs = runs[arch]
    for name in ("single", "tp2pp2"):
        _starts_at_ln2(runs[name], moe=False)
    _assert_same(runs["tp2pp2"], runs["single"], range(1, STEPS + 1), 1e-5, "TP 2 x PP 2")
    assert sorted(runs["resumed"]) == [3, 4]
    _assert_same(runs["resumed"], runs["tp2pp2"], (3, 4), 1e-6, "exact resume")


@pytest.mark.slow
def test_moe_dpo_at_tp2_pp2_ep2_matches_one_rank_resumes_and_reshards(runs):
    """Qwen3-MoE at TP 2 x PP 2 (sequence parallel) with EP 1 and with EP 2 (experts split over
    the two TP ranks of each stage, expert TP 1), and TP 2 x EP 2 with each expert split over 2
    ranks (expert TP 2, data parallel 2): all equal the single-rank run; resume at the same
    layout is exact; a step-2 checkpoint of EP 1 resumes at EP 2 and the other way round."""
    runs = runs["qwen3_moe"]
    for name in ("single", "ep1", "ep2", "etp2"):
        _starts_at_ln2(runs[name], moe=True)
    every_step = range(1, STEPS + 1)
    _assert_same(runs["ep1"], runs["single"], every_step, 1e-5, "TP 2 x PP 2")
    _assert_same(runs["ep2"], runs["single"], every_step, 1e-5, "TP 2 x PP 2 x EP 2")
    _assert_same(runs["etp2"], runs["single"], every_step, 1e-5, "TP 2 x EP 2 x expert TP 2")
    _assert_same(runs["ep1_resumed"], runs["ep1"], (3, 4), 1e-6, "exact resume")
    _assert_same(runs["ep2_from_ep1"], runs["ep1"], (3, 4), 1e-5, "EP 1 -> EP 2 checkpoint")
    _assert_same(runs["ep1_from_ep2"], runs["ep2"], (3, 4), 1e-5, "EP 2 -> EP 1 checkpoint")


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["mixtral", "gpt_oss"])
def test_mixtral_and_gpt_oss_dpo_at_tp2_pp2_ep2_match_one_rank(runs, arch):
    """Mixtral (no QK norm, its own router and expert naming) and gpt-oss (attention sinks,
    biases, windows, YaRN, clamped SwiGLU experts: their gradients split over TP, PP and EP)
    through the same MoE layers: at TP 2 x PP 2 x EP 2 each equals the single-rank run at every
    step. Resume and resharding are the layers' and the checkpoint's, not the architecture's:
    the Qwen3-MoE test above covers them."""
    runs = runs[arch]
    for name in ("single", "ep2"):
        _starts_at_ln2(runs[name], moe=True)
    _assert_same(runs["ep2"], runs["single"], range(1, STEPS + 1), 1e-5, "TP 2 x PP 2 x EP 2")


def _host_checked_runs(hf_dir, root):
    """TP 2 x EP 2 (expert TP 1) on 2 ranks, both dispatchers, padded and packed, each under
    ``HostTensorCheck``: (report, step losses) per run."""
    from tests.host_tensors import HostTensorCheck

    out = {}
    for dispatcher in ("alltoall", "allgather"):
        for packing in (False, True):
            name = f"{dispatcher}_{'packed' if packing else 'padded'}"
            with HostTensorCheck() as check:
                trainer = tiny_trainer(
                    tiny_pairs(8, vocab=VOCAB),
                    tp=2,
                    sp=True,
                    ep=2,
                    etp=1,
                    micro_batch_size=2,
                    global_batch_size=8,
                    steps=2,
                    packing=packing,
                    run_dir=f"{root}/{name}",
                    model={
                        "hf_path": hf_dir,
                        "params_dtype": "float32",
                        "transformer_impl": "local",
                        "moe_token_dispatcher": dispatcher,
                    },
                )
                losses = [trainer.train_step()[0].metrics["loss"] for _ in range(2)]
            out[name] = (check.report(), losses)
    return out


@pytest.mark.slow
def test_moe_steps_leave_no_tensor_on_the_host_with_either_dispatcher(tmp_path):
    """Routing, dispatch (all-to-all and all-gather), experts and the load-balancing read-out
    make their tensors on the device; packed rows give the padded rows' losses."""
    hf_dir = save_tiny_hf_folder("qwen3_moe", str(tmp_path / "hf"))
    for rank, runs in enumerate(
        run_ranks(_host_checked_runs, world_size=2, hf_dir=hf_dir, root=str(tmp_path))
    ):
        for name, (report, _) in runs.items():
            assert report == "", f"rank {rank}, {name}:\n{report}"
        reference = runs["alltoall_padded"][1]
        assert abs(reference[0] - math.log(2)) < 1e-6
        for name, (_, losses) in runs.items():
            assert all(abs(a - b) <= 1e-6 for a, b in zip(losses, reference)), name
