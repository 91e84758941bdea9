"""Shared-prompt pairs (``packing.share_prompt``): the layout by hand, the attention rule, and the
same log-probs / loss trajectory as the unshared path through the real trainer."""

import pytest
import torch

from dpo_megatron.data import PreferencePair, collate_pairs
from dpo_megatron.data.packing import (
    PackingConfig,
    SharedPromptPairs,
    pack_shared_prompt_pairs,
    shared_prompt_unit,
)
from dpo_megatron.models.attention import visible_keys
from tests.engine import (
    SHALLOW,
    assert_step_zero_is_exact,
    owns_results,
    step_record,
    tiny_pairs,
    tiny_trainer,
    train_step_against_reference,
    varied_lengths,
)
from tests.multirank import run_ranks
from tests.training.test_packing import assert_same_trajectory

# Pair A: prompt (10, 11), chosen (12, 2), rejected (13, 14, 2); pair B: prompt (20,),
# chosen (21, 2), rejected (22, 2).
PAIRS = [PreferencePair((10, 11), (12, 2), (13, 14, 2)), PreferencePair((20,), (21, 2), (22, 2))]


def test_unit_positions_and_branches():
    unit = shared_prompt_unit(0, 2, PAIRS[0])
    assert unit.tokens == [10, 11, 12, 2, 13, 14, 2]
    assert unit.position_ids == [0, 1, 2, 3, 2, 3, 4]  # rejected continues after the prompt
    assert unit.branch_ids == [0, 0, 1, 1, 2, 2, 2]
    assert unit.sequences == [(0, [0, 1, 2, 3]), (2, [0, 1, 4, 5, 6])]


def test_layout_by_hand():
    out, targets = pack_shared_prompt_pairs(PAIRS, pad_token_id=0, row_length=12)
    # FFD: A (7 tokens) then B (5) in one row of 12.
    assert out.tokens.tolist() == [[10, 11, 12, 2, 13, 14, 2, 20, 21, 2, 22, 2]]
    assert out.position_ids.tolist() == [[0, 1, 2, 3, 2, 3, 4, 0, 1, 2, 1, 2]]
    assert out.packed.branch_ids.tolist() == [[0, 0, 1, 1, 2, 2, 2, 0, 1, 1, 2, 2]]
    assert out.segment_ids.tolist() == [[0] * 7 + [1] * 5]
    # Per sequence (rows A+c, B+c, A+r, B+r): the padded path's tokens and order.
    padded, padded_targets = collate_pairs(PAIRS, pad_token_id=0, seq_length=5)
    assert torch.equal(targets.loss_mask, padded_targets.loss_mask)
    assert torch.equal(targets.score_index, padded_targets.score_index)
    assert torch.equal(out.target_ids, padded.target_ids)
    # The last prompt position scores both completions' first token: 1 (A) and 7 (B) twice.
    assert out.output_index.tolist() == [1, 2, 7, 8, 1, 4, 5, 7, 10]
    # Spans: [prompt | chosen] on itself; rejected on [prompt ; rejected].
    assert [(s.q_start, s.q_end, s.keys) for s in out.packed.spans] == [
        (0, 4, ((0, 4),)),
        (4, 7, ((0, 2), (4, 7))),
        (7, 10, ((7, 10),)),
        (10, 12, ((7, 8), (10, 12))),
    ]
    assert out.packed.cu_seqlens_q.tolist() == [0, 4, 7, 10, 12]
    assert out.packed.cu_seqlens_kv.tolist() == [0, 4, 9, 12, 15]
    assert out.packed.kv_index.tolist() == [0, 1, 2, 3, 0, 1, 4, 5, 6, 7, 8, 9, 7, 10, 11]
    assert (out.packed.max_seqlen_q, out.packed.max_seqlen_kv) == (4, 5)
    # The same spans as square causal rows of 5 slots: each span's keys, its queries in the last
    # slots (before them the span's first query as filler), filler after.
    rows = out.packed.rows
    assert rows.key_index.tolist() == [
        [0, 1, 2, 3, 0],
        [0, 1, 4, 5, 6],
        [7, 8, 9, 7, 7],
        [7, 10, 11, 7, 7],
    ]
    assert rows.query_index.tolist() == [
        [0, 1, 2, 3, 0],
        [4, 4, 4, 5, 6],
        [7, 8, 9, 7, 7],
        [10, 10, 11, 10, 10],
    ]
    # two buckets: rows 0-1 at 5 slots (outputs 0..9), rows 2-3 cut to 3 (outputs 10..15)
    assert [(r.tolist(), w) for r, w in rows.buckets] == [([0, 1], 5), ([2, 3], 3)]
    assert rows.output_index.tolist() == [0, 1, 2, 3, 7, 8, 9, 10, 11, 12, 14, 15]
    visible = visible_keys(out.segment_ids, out.packed.branch_ids)[0, 0]
    assert visible[5].tolist() == [True, True, False, False, True, True] + [False] * 6  # A+r
    assert visible[3].tolist() == [True] * 4 + [False] * 8  # A+c
    assert visible[11].tolist() == [False] * 7 + [True, False, False, True, True]  # B+r


def test_builder_counts_the_prompt_once():
    builder = SharedPromptPairs(0, 4, PackingConfig(enabled=True, share_prompt=True))
    step = builder.build(PAIRS, [[0, 1]])
    assert step.real_tokens == 4 + 5 + 2 * 3  # as TRL counts: the prompt in both sequences
    assert step.model_tokens == 7 + 5  # computed: each prompt once
    assert step.seq_length == 12 and tuple(step.micro_batches[0].tokens.shape) == (1, 12)


def test_share_prompt_needs_packing():
    # share_prompt alone turns packing on (auto); packing switched off by name is refused
    with pytest.raises(ValueError, match="packing.enabled=true"):
        PackingConfig(enabled=False, share_prompt=True).validate()


# ----------------------------------------------------------------------------------------------
# the real trainer


MODEL = SHALLOW


def _history(steps, **config):
    trainer = tiny_trainer(
        tiny_pairs(6, seed=5, lengths=varied_lengths),
        model={**MODEL, **config.pop("model", {})},
        seed=3,
        global_batch_size=6,
        steps=steps,
        lr=1e-2,
        loss={"name": "sigmoid", "beta": 0.5},
        **config,
    )
    history = [step_record(*train_step_against_reference(trainer))]
    history += [step_record(*trainer.train_step()) for _ in range(steps - 1)]
    for record in history:
        record["loss"] = record["metrics"]["loss"]
    return history


def _compare(steps=3, micro_batch_size=3, model=None, **config):
    """Packed without and with a shared prompt, from the same seed, same layout."""
    history = {
        share: _history(
            steps,
            micro_batch_size=micro_batch_size,
            packing=True,
            share_prompt=share,
            model=model or {},
            **config,
        )
        for share in (False, True)
    }
    return {"last": owns_results(), "history": history}


def test_shared_prompt_equals_unshared_fp32():
    result = run_ranks(_compare, world_size=1)[0]
    unshared, shared = result["history"][False], result["history"][True]
    assert shared[0]["shape"][1] < unshared[0]["shape"][1]  # fewer positions: prompts once
    assert_same_trajectory(unshared, shared)


# ----------------------------------------------------------------------------------------------
# the equality test has teeth: a wrong mask or a wrong position breaks it


def _corrupt(batch, how):
    """The shared-prompt micro-batch with one rule broken: the rejected tokens also see the
    chosen ones ('mask'), or the rejected positions continue after the chosen ones ('positions')."""
    import dataclasses

    from dpo_megatron.data.batch import AttentionSpan, PackedLayout

    layout = batch.packed
    if how == "mask":
        spans = [
            AttentionSpan(s.q_start, s.q_end, ((s.keys[0][0], s.q_end),)) if len(s.keys) == 2 else s
            for s in layout.spans
        ]
        layout = PackedLayout.from_spans(layout.segment_ids, None, spans)
        return dataclasses.replace(batch, packed=layout)
    positions = batch.position_ids.clone().reshape(-1)
    for s in layout.spans:
        if len(s.keys) == 2:  # rejected: prompt + chosen lengths = start - unit start
            positions[s.q_start : s.q_end] = torch.arange(s.q_end - s.q_start) + (
                s.q_start - s.keys[0][0]
            )
    return dataclasses.replace(batch, position_ids=positions.view_as(batch.position_ids))


def _logps_with(kernel, broken):
    from dpo_megatron.data.batch import StepBatch
    from dpo_megatron.training.step import step_forward_backward

    out = {}
    for share, how in [(False, None), (True, None)] + [(True, b) for b in broken]:
        trainer = tiny_trainer(
            tiny_pairs(4, seed=5, lengths=varied_lengths),
            model={**MODEL, "local_attention": kernel},
            seed=3,
            micro_batch_size=2,
            global_batch_size=4,
            packing=True,
            share_prompt=share,
        )
        batch = trainer.next_batch()
        if how:
            batch = StepBatch(
                [_corrupt(mb, how) for mb in batch.micro_batches],
                batch.targets,
                batch.seq_length,
                batch.real_tokens,
            )
        step = step_forward_backward(
            trainer.policy, trainer.reference, batch, trainer.loss_fn, forward_only=True
        )
        out[how or ("shared" if share else "unshared")] = step.per_item["logps/rejected"].tolist()
    return out


@pytest.mark.parametrize("kernel", ["sdpa", "megatron"])
def test_rejected_seeing_chosen_or_a_wrong_position_breaks_equality(kernel):
    out = run_ranks(_logps_with, world_size=1, kernel=kernel, broken=["mask", "positions"])[0]
    want = torch.tensor(out["unshared"])
    assert ((torch.tensor(out["shared"]) - want).abs() <= 1e-6 * want.abs()).all()
    for how in ("mask", "positions"):
        assert (torch.tensor(out[how]) - want).abs().max() > 1e-3, how


# ----------------------------------------------------------------------------------------------
# every layout, with and without recompute; the precompute pass and evaluation


RECOMPUTE = {
    None: {},
    "selective": dict(recompute_granularity="selective"),
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
}


def _layout_histories(tp, pp, vpp, sp, steps=2):
    """Unshared packing, then shared prompts without / with selective / with full recompute."""
    model = {**MODEL, "num_layers": 4}
    runs = [(False, None), (True, None), (True, "selective"), (True, "full")]
    history = {
        f"{'shared' if share else 'unshared'}/{rc}": _history(
            steps,
            tp=tp,
            pp=pp,
            vpp=vpp,
            sp=sp,
            micro_batch_size=1,
            packing=True,
            share_prompt=share,
            model={**model, **RECOMPUTE[rc]},
        )
        for share, rc in runs
    }
    return {"last": owns_results(), "history": history}


@pytest.mark.slow
@pytest.mark.parametrize(
    "tp, pp, vpp, sp",
    [
        (1, 1, None, False),
        (2, 1, None, True),
        (1, 2, None, False),
        (2, 2, None, False),
        (1, 2, 2, False),
    ],
    ids=["tp1", "tp2-sp", "pp2", "tp2-pp2", "pp2-vpp2"],
)
def test_shared_prompt_at_every_layout_with_recompute(tp, pp, vpp, sp):
    results = run_ranks(_layout_histories, world_size=tp * pp, tp=tp, pp=pp, vpp=vpp, sp=sp)
    history = next(r for r in results if r["last"])["history"]
    reference = history["unshared/None"]
    assert len(history) == 4
    for other in history.values():
        assert_same_trajectory(reference, other)
        # one pair per micro-batch: one packed row, the shape whose strides once sent the
        # frozen reference's linears down another matmul kernel than the policy's
        assert_step_zero_is_exact(other[0])


def _precomputed_and_eval(root):
    out = {}
    for share in (False, True):
        trainer = tiny_trainer(
            tiny_pairs(6, seed=5, lengths=varied_lengths),
            eval_pairs=tiny_pairs(4, seed=8, lengths=varied_lengths),
            model=MODEL,
            seed=3,
            micro_batch_size=2,
            global_batch_size=4,
            steps=2,
            lr=1e-2,
            packing=True,
            share_prompt=share,
            reference_mode="precomputed",
            cache_dir=f"{root}/{share}",
            loss={"name": "sigmoid", "beta": 0.5},
        )
        assert trainer.reference is None  # freed after the precompute pass
        losses = [trainer.train_step()[0].metrics["loss"] for _ in range(2)]
        out[share] = {
            "losses": losses,
            "eval": trainer.evaluator.run(trainer.policy, trainer.reference, trainer.loss_fn),
            "table": [p.reference_rejected_logps.tolist() for p in trainer.data.train],
        }
    return out


def test_precompute_pass_and_evaluation_with_shared_prompts(tmp_path):
    out = run_ranks(_precomputed_and_eval, world_size=1, root=str(tmp_path))[0]
    for a, b in zip(out[False]["table"], out[True]["table"]):  # the precomputed reference
        torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=1e-6, atol=1e-6)
    for a, b in zip(out[False]["losses"], out[True]["losses"]):
        assert abs(a - b) < 1e-5
    evaluation = out[False]["eval"]
    assert "logps/rejected" in evaluation
    # log-probs and loss within 1e-5 relative (the promise); a reward is beta (0.5) x a log-prob
    # difference, so a 1e-5 relative log-prob gap moves it by up to beta x 1e-5 x |log-prob|
    # (on an AVX-512 Xeon: logps/rejected -46.7042 against -46.7042, rewards/rejected 1.2e-5 apart)
    logps = max(abs(evaluation[k]) for k in ("logps/chosen", "logps/rejected"))
    for key, value in evaluation.items():
        tolerance = 1e-5 * (0.5 * logps if key.startswith("rewards/") else max(1.0, abs(value)))
        assert abs(out[True]["eval"][key] - value) <= tolerance, key


def _host_tensor_report(root):
    from dpo_megatron.training.trainer import Trainer
    from tests.host_tensors import HostTensorCheck
    from tests.training.test_device_boundary import _config

    reports = {}
    for name, extra in {"model": [], "precomputed": ["reference.mode=precomputed"]}.items():
        overrides = [
            "packing.enabled=true",
            "packing.share_prompt=true",
            "parallel.tensor_model_parallel_size=2",
            *extra,
        ]
        with HostTensorCheck() as check:
            Trainer(_config(root, f"shared_{name}", *overrides)).train()
        reports[name] = check.report()
    return reports


@pytest.mark.slow
def test_shared_prompt_run_leaves_no_tensor_on_the_host(tmp_path):
    """A whole shared-prompt run (reference model or precompute pass, evaluation, samples,
    checkpoint) at TP 2 makes every tensor on the device and moves every batch through the
    boundary (``tests/host_tensors.py``)."""
    for rank, reports in enumerate(
        run_ranks(_host_tensor_report, world_size=2, root=str(tmp_path))
    ):
        for name, report in reports.items():
            assert report == "", f"rank {rank}, {name}:\n{report}"
