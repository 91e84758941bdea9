"""The context-parallel batch split (``data.context_split``) and the CP config rules: single
process, hand-checked positions."""

import pytest
import torch

from dpo_megatron.config import load_config, world_size_for
from dpo_megatron.data.builders import make_batch_builder
from dpo_megatron.data.context_split import local_positions, split_micro_batch
from dpo_megatron.data.packing import PackingConfig
from dpo_megatron.parallel.context import chunk_positions
from tests.engine import TINY, model_overrides, random_pairs, tiny_pairs


def test_chunk_positions_are_megatron_cores_load_balanced_layout():
    assert chunk_positions(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert chunk_positions(8, 1, 2).tolist() == [2, 3, 4, 5]
    assert chunk_positions(8, 3, 4).tolist() == [3, 4]
    assert chunk_positions(5, 0, 1).tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="pad it to a multiple of 4"):
        chunk_positions(6, 0, 2)


@pytest.mark.parametrize("kind", ["padded", "packed", "shared_prompt"])
@pytest.mark.parametrize("cp", [2, 4])
def test_ranks_share_every_token_once_with_its_label_and_position(kind, cp):
    packing = PackingConfig(enabled=kind != "padded", share_prompt=kind == "shared_prompt")
    full_builder = make_batch_builder(packing, pad_token_id=0, multiple=2 * cp)
    if kind != "padded":  # the CP builder pads each packed unit to 2 x CP; so does this one
        full_builder.unit_multiple = 2 * cp
    full_step = full_builder.build(tiny_pairs(3, seed=1), [[0, 1, 2]])
    full, full_targets = full_step.micro_batches[0], full_step.targets[0]
    rows, length = full.tokens.shape
    seen = torch.zeros(rows, length, dtype=torch.int64)
    scored = []
    for rank in range(cp):
        step = make_batch_builder(
            packing, pad_token_id=0, multiple=2 * cp, context_parallel=(rank, cp)
        ).build(tiny_pairs(3, seed=1), [[0, 1, 2]])
        part, part_targets = step.micro_batches[0], step.targets[0]
        assert step.seq_length == length  # the schedule divides by CP itself
        assert part.tokens.shape == (rows, length // cp)
        keep = local_positions(full, rank, cp)
        seen.scatter_add_(1, keep, torch.ones_like(keep))
        for name in ("tokens", "position_ids"):
            assert torch.equal(getattr(part, name), getattr(full, name).gather(1, keep))
        if kind != "padded":
            assert torch.equal(part.packed.segment_ids, full.packed.segment_ids.gather(1, keep))
        # Each scored token keeps its label, its model input and its per-sequence slot.
        for k_local, slot in enumerate(part_targets.score_index.tolist()):
            k = full_targets.score_index.tolist().index(slot)
            assert part.target_ids[k_local] == full.target_ids[k]
            assert (
                part.tokens.reshape(-1)[part.output_index[k_local]]
                == full.tokens.reshape(-1)[full.output_index[k]]
            )
            assert (
                part.position_ids.reshape(-1)[part.output_index[k_local]]
                == full.position_ids.reshape(-1)[full.output_index[k]]
            )
            scored.append(slot)
        # The per-sequence layout is kept whole.
        assert torch.equal(part_targets.loss_mask, full_targets.loss_mask)
    assert bool((seen == 1).all())  # every position on exactly one rank
    assert sorted(scored) == sorted(full_targets.score_index.tolist())


def test_padded_split_of_one_row_by_hand():
    from dpo_megatron.data.batch import MicroBatch
    from dpo_megatron.losses.targets import SFTTargets

    tokens = torch.arange(8).view(1, 8)
    batch = MicroBatch(
        tokens=tokens,
        position_ids=tokens.clone(),
        output_index=torch.tensor([1, 2, 6]),
        target_ids=torch.tensor([101, 102, 106]),
        num_items=1,
        padding_mask=torch.arange(8)[None, :] >= 7,
    )
    targets = SFTTargets(torch.ones(1, 8), torch.tensor([1, 2, 6]))
    rank1, targets1 = split_micro_batch(batch, targets, 1, 2)
    assert rank1.tokens.tolist() == [[2, 3, 4, 5]]
    assert rank1.position_ids.tolist() == [[2, 3, 4, 5]]  # RoPE angles follow the chunks
    assert rank1.output_index.tolist() == [0] and targets1.score_index.tolist() == [2]
    assert rank1.target_ids.tolist() == [102]
    assert rank1.padding_mask.tolist() == [[False] * 4]
    rank0, targets0 = split_micro_batch(batch, targets, 0, 2)
    assert rank0.tokens.tolist() == [[0, 1, 6, 7]]
    assert rank0.output_index.tolist() == [1, 2] and targets0.score_index.tolist() == [1, 6]
    assert torch.equal(targets0.loss_mask, targets.loss_mask)  # the per-sequence layout: whole
    assert rank0.padding_mask.tolist() == [[False, False, False, True]]


def test_units_are_padded_to_whole_chunks_after_their_last_position():
    from dpo_megatron.data.packing import pad_unit, shared_prompt_unit

    pair = random_pairs(1, seed=2, lengths=lambda i: (2, 1, 2))[0]  # p=2, c=2, r=3 with EOS
    unit = pad_unit(shared_prompt_unit(0, 1, pair), 4, pad_token_id=0)
    assert len(unit) == 8 and unit.tokens[-1] == 0
    assert unit.position_ids == [0, 1, 2, 3, 2, 3, 4, 5]  # the pad comes after position 4
    assert unit.branch_ids == [0, 0, 1, 1, 2, 2, 2, 0]
    assert unit.spans[-1].padding and unit.spans[-1].q_start == 7
    step = make_batch_builder(
        PackingConfig(enabled=True), pad_token_id=0, multiple=4, context_parallel=(0, 2)
    ).inner.build(tiny_pairs(3, seed=1), [[0, 1, 2]])
    for row in step.micro_batches[0].packed.segment_ids:
        ids, counts = torch.unique_consecutive(row, return_counts=True)
        assert all(c % 4 == 0 for c in counts.tolist()), counts


BASE = ["data.tokenizer=t", "data.path=d.json"]


def test_world_size_counts_context_parallel_ranks():
    cfg = load_config(
        None,
        [
            *BASE,
            "parallel.context_parallel_size=2",
            "parallel.tensor_model_parallel_size=2",
            "parallel.data_parallel_size=2",
        ],
    )
    assert world_size_for(cfg) == 8
    assert cfg.parallel.sequence_granule() == 4


@pytest.mark.parametrize(
    "overrides, match",
    [
        (
            ["packing.enabled=true", "packing.row_length=1002"],
            r"packing.row_length=1002 .* multiple of 4 \(e.g. 1004\)",
        ),
        (  # packing left at auto (the default), which packs: the same rule
            ["packing.row_length=1002"],
            r"packing.row_length=1002 .* multiple of 4 \(e.g. 1004\)",
        ),
        (
            [
                "packing.enabled=true",
                "packing.row_length=1004",
                "parallel.sequence_parallel=true",
                "parallel.tensor_model_parallel_size=2",
            ],
            r"tensor_model_parallel_size=2 \(sequence parallelism\) = 8 .* multiple of 8 \(e.g. "
            r"1008\)",
        ),
        (["model.local_attention=megatron"], "set model.local_attention=sdpa"),
        (["train.sample_during_eval=true"], "set train.sample_during_eval=false"),
        (["parallel.context_parallel_size=0"], r"context_parallel_size=0 must be >= 1"),
    ],
)
def test_context_parallel_config_errors_name_the_fix(overrides, match):
    with pytest.raises(ValueError, match=match):
        load_config(None, [*BASE, "parallel.context_parallel_size=2", *overrides])


def test_a_row_length_with_packing_off_is_not_refused():
    """Only packed rows are cut into context-parallel chunks: packing.row_length is not read
    when packing is set off."""
    cfg = load_config(
        None,
        [*BASE, "parallel.context_parallel_size=2", "packing.enabled=false"]
        + ["packing.share_prompt=false", "packing.row_length=1002"],
    )
    assert cfg.packing.row_length == 1002


def test_world_size_not_divisible_names_context_parallel_size():
    from dpo_megatron.parallel import ParallelConfig

    with pytest.raises(ValueError, match=r"context_parallel_size \(2\) = 4"):
        ParallelConfig(tensor_model_parallel_size=2, context_parallel_size=2).validate(6)


def test_the_launchers_pre_check_counts_context_parallel_ranks_and_refuses_moe_in_one_line(
    tmp_path, capsys
):
    """CONTEXT_PARALLEL.md's launch: the pre-check names TP 2 x CP 2 = 4 ranks for the launcher
    to start, and refuses a mixture-of-experts model at CP 2 in one line before any rank starts."""
    import json

    from dpo_megatron.cli.check import main

    data = tmp_path / "pairs.jsonl"
    data.write_text(json.dumps({"prompt": "Hi", "chosen": " yes", "rejected": " no"}) + "\n")
    model = model_overrides(TINY)
    base = ["data.tokenizer=t", f"data.path={data}", *model, "parallel.context_parallel_size=2"]
    main([*base, "parallel.tensor_model_parallel_size=2", "--without-weights"])
    assert capsys.readouterr().out.splitlines()[-1] == "4"
    with pytest.raises(SystemExit) as e:
        main([*base, "model.num_experts=4", "model.moe_router_topk=2", "--without-weights"])
    assert str(e.value) == (
        "config error: model.num_experts=4 with parallel.context_parallel_size=2: "
        "mixture-of-experts models do not run under context parallelism yet; set "
        "parallel.context_parallel_size=1 (expert parallelism still applies)"
    )


def test_mixture_of_experts_under_context_parallelism_is_refused_before_launch():
    """The CP split does not cut the routers' padding mask: MoE at CP > 1 fails in the layout
    check (the launcher's pre-check) with the fix named."""
    from dpo_megatron.models import ModelConfig, build_transformer_config
    from dpo_megatron.parallel import ParallelConfig

    model = ModelConfig(
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=128,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=256,
        num_experts=4,
        moe_router_topk=2,
    )
    with pytest.raises(ValueError, match="context_parallel_size=1"):
        build_transformer_config(model, ParallelConfig(context_parallel_size=2))
