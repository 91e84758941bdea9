"""The generation cache's visibility rule and storage by hand (models/kv_cache.py): a left-padded
row, then a decode slot, with and without a sliding window."""

import torch

from dpo_megatron.models.kv_cache import KVCache


def test_padding_is_never_a_key_and_the_window_counts_positions():
    cache = KVCache.create(rows=1, capacity=4, device=torch.device("cpu"))
    cache.append(torch.tensor([[0, 0, 1]]), torch.tensor([[False, True, True]]))
    assert cache.visible()[0, 0].tolist() == [
        [True, False, False],  # the padding query sees only itself (a finite output)
        [False, True, False],
        [False, True, True],
    ]
    cache.append(torch.tensor([[2]]), torch.tensor([[True]]))
    assert cache.visible()[0, 0].tolist() == [[False, True, True, True]]
    assert cache.visible(window=1)[0, 0].tolist() == [[False, False, True, True]]


def test_each_owner_keeps_its_slots():
    cache = KVCache.create(rows=2, capacity=3, device=torch.device("cpu"))
    first, second = torch.nn.Identity(), torch.nn.Identity()
    key = torch.arange(2 * 2 * 1 * 1, dtype=torch.float32).view(2, 2, 1, 1)  # [n, R, g, hn]
    cache.append(torch.zeros(2, 2, dtype=torch.int64), torch.ones(2, 2, dtype=torch.bool))
    keys, values = cache.update(first, key, -key)
    cache.update(second, key + 100, key)
    assert keys.shape == (2, 2, 1, 1) and torch.equal(values, -key)
    cache.append(torch.ones(2, 1, dtype=torch.int64), torch.ones(2, 1, dtype=torch.bool))
    keys, _ = cache.update(first, torch.full((1, 2, 1, 1), 7.0), torch.zeros(1, 2, 1, 1))
    assert keys[:, :, 0, 0].tolist() == [[0.0, 1.0], [2.0, 3.0], [7.0, 7.0]]
    # stored [R, groups, capacity, hn]: row r's slots side by side
    assert cache.entries[second][0][:, 0, :2, 0].tolist() == [[100.0, 102.0], [101.0, 103.0]]
    rows, _ = cache.row_major(first)
    assert rows.shape == (2, 1, 3, 1) and rows[:, 0, :, 0].tolist() == [[0, 2, 7], [1, 3, 7]]


def test_a_packed_prefill_fills_the_real_slots_row_by_row():
    """Two rows of 1 and 2 prompt tokens in 2 slots: the packed tokens [a, b, c] land in row 0's
    last slot and row 1's two slots; the padding slot keeps a zero key that no query sees."""
    cache = KVCache.create(rows=2, capacity=3, device=torch.device("cpu"))
    real = torch.tensor([[False, True], [True, True]])
    cache.append_packed(torch.tensor([[0, 0], [0, 1]]), real, packed=None)
    owner = torch.nn.Identity()
    key = torch.tensor([1.0, 2.0, 3.0]).view(3, 1, 1)  # [T, groups, hn]
    cache.store_packed(owner, key, -key)
    keys, values = cache.row_major(owner)
    assert keys[:, 0, :, 0].tolist() == [[0.0, 1.0], [2.0, 3.0]]
    assert values[:, 0, :, 0].tolist() == [[0.0, -1.0], [-2.0, -3.0]]
    cache.append(torch.tensor([[1], [2]]), torch.tensor([[True], [True]]))
    assert cache.packed is None  # a decode step attends to the slots
    assert cache.visible()[:, 0, 0].tolist() == [[False, True, True], [True, True, True]]
