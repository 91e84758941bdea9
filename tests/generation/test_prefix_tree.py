"""The prefill's tree of shared prompt prefixes by hand (generation/prefix_tree.py): the nodes,
the packed tokens and spans, where each row's slots read their keys, the dense visibility of the
spans, and the cache filled from shared tokens."""

import pytest
import torch

from dpo_megatron.data.batch import AttentionSpan
from dpo_megatron.generation.prefix_tree import PrefixNode, pack_prompts, prefix_tree
from dpo_megatron.models.attention import span_visible_keys, visible_keys
from dpo_megatron.models.kv_cache import KVCache

# a duplicate (row 2), a shared two-token prefix (row 1), an idle row and a tree of its own
PROMPTS = [[1, 2, 3], [1, 2, 4, 5], [1, 2, 3], None, [7]]


def test_the_tree_ends_a_node_where_its_rows_branch():
    assert prefix_tree(PROMPTS) == [
        PrefixNode(0, 2, (0, 1, 2), None, 0),
        PrefixNode(2, 3, (0, 2), 0, 2),
        PrefixNode(2, 4, (1,), 0, 3),
        PrefixNode(0, 1, (4,), None, 5),
    ]


def test_a_prompt_inside_another_ends_a_node_where_it_ends():
    """[5, 6] is the start of [5, 6, 7]: the shared node stops after 6 (row 0 ends there), and
    row 0's last token is the shared node's last."""
    assert prefix_tree([[5, 6], [5, 6, 7]]) == [
        PrefixNode(0, 2, (0, 1), None, 0),
        PrefixNode(2, 3, (1,), 0, 2),
    ]
    assert pack_prompts([[5, 6], [5, 6, 7]]).last.tolist() == [1, 2]


def test_each_token_is_packed_once_and_each_row_reads_its_path():
    packed = pack_prompts(PROMPTS)
    assert packed.tokens.tolist() == [1, 2, 3, 4, 5, 7]  # 6 of the 10 prompt tokens
    assert packed.positions.tolist() == [0, 1, 2, 2, 3, 0]
    assert packed.spans == [
        AttentionSpan(0, 2, ((0, 2),)),
        AttentionSpan(2, 3, ((0, 2), (2, 3))),
        AttentionSpan(3, 5, ((0, 2), (3, 5))),
        AttentionSpan(5, 6, ((5, 6),)),
    ]
    assert packed.unit_ids.tolist() == [0, 0, 0, 0, 0, 1]
    # rows 0, 1, 2, 4 (row 3 idle), each row's tokens in order
    assert packed.token_index.tolist() == [0, 1, 2, 0, 1, 3, 4, 0, 1, 2, 5]
    assert packed.last.tolist() == [2, 4, 2, 0, 5]


def test_prompts_that_share_nothing_pack_row_after_row():
    packed = pack_prompts([[3, 4], [5]])
    assert packed.token_index.tolist() == [0, 1, 2]
    assert packed.spans == [AttentionSpan(0, 2, ((0, 2),)), AttentionSpan(2, 3, ((2, 3),))]


def test_no_prompt_is_refused():
    with pytest.raises(ValueError, match="at least one non-empty prompt"):
        pack_prompts([None, []])


def test_the_spans_dense_visibility():
    """Query 3 (token 4 of row 1) sees the shared [1, 2] and itself, not its sibling 3; the
    second tree sees only itself. A shared-prompt DPO pair gives what its segment and branch
    ids give."""
    visible = span_visible_keys(pack_prompts(PROMPTS).spans, torch.device("cpu"))[0, 0]
    assert visible.int().tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],
        [1, 1, 0, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],
    ]
    pair = [AttentionSpan(0, 4, ((0, 4),)), AttentionSpan(4, 7, ((0, 2), (4, 7)))]
    segments = torch.zeros(1, 7, dtype=torch.int32)
    branches = torch.tensor([[0, 0, 1, 1, 2, 2, 2]])
    assert torch.equal(
        span_visible_keys(pair, torch.device("cpu")), visible_keys(segments, branches)
    )


def test_a_shared_token_fills_the_slot_of_each_of_its_rows():
    """Rows [1, 2, 3] and [1, 2] left-padded in 3 slots: the packed keys of 1, 2, 3 land in
    row 0's three slots and, for 1 and 2, in row 1's last two."""
    packed = pack_prompts([[1, 2, 3], [1, 2]])
    cache = KVCache.create(rows=2, capacity=3, device=torch.device("cpu"))
    real = torch.tensor([[True, True, True], [False, True, True]])
    positions = torch.tensor([[0, 1, 2], [0, 0, 1]])
    cache.append_packed(positions, real, packed=None, token_index=packed.token_index)
    owner = torch.nn.Identity()
    key = torch.tensor([10.0, 20.0, 30.0]).view(3, 1, 1)  # [T, groups, hn]
    cache.store_packed(owner, key, -key)
    keys, values = cache.row_major(owner)
    assert keys[:, 0, :, 0].tolist() == [[10.0, 20.0, 30.0], [0.0, 10.0, 20.0]]
    assert values[:, 0, :, 0].tolist() == [[-10.0, -20.0, -30.0], [0.0, -10.0, -20.0]]
    fresh = KVCache.create(rows=2, capacity=3, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="5 real slots, token_index of shape \\(3,\\)"):
        fresh.append_packed(positions, real, packed=None, token_index=torch.arange(3))


def test_a_deep_tree_packs_without_recursion():
    """1,500 rows, each the start of the next (one document cut at every token, a large GPU
    micro-batch): a chain of 1,500 nodes, deeper than Python's recursion limit."""
    prompts = [list(range(1, k + 1)) for k in range(1, 1501)]
    packed = pack_prompts(prompts)
    assert packed.tokens.tolist() == list(range(1, 1501))
    assert len(packed.spans) == 1500 and packed.spans[-1].keys[-1] == (1499, 1500)
    assert packed.last.tolist() == list(range(1500))
