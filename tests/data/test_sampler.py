"""ItemSampler: determinism, disjoint DP shards, layout independence, exact resume."""

import numpy as np
import pytest

from dpo_megatron.data import ItemSampler


def _steps(sampler, n):
    return [sampler.next_step() for _ in range(n)]


def test_global_batches_follow_seeded_permutation_by_hand():
    s = ItemSampler(
        10,
        global_batch_size=4,
        micro_batch_size=2,
        data_parallel_rank=0,
        data_parallel_size=1,
        seed=7,
    )
    order0 = np.random.default_rng(7).permutation(10).tolist()
    order1 = np.random.default_rng(8).permutation(10).tolist()
    assert s.steps_per_epoch == 2  # drop_last: 10 // 4
    assert s.next_step() == [order0[0:2], order0[2:4]]
    assert s.next_step() == [order0[4:6], order0[6:8]]
    assert s.next_step() == [order1[0:2], order1[2:4]]  # new epoch, new permutation (seed + 1)
    assert order0 != order1


def test_dp_ranks_get_contiguous_disjoint_slices_and_layouts_agree():
    G = 8
    single = ItemSampler(20, G, 1, 0, 1, seed=3)
    ranks = [ItemSampler(20, G, 2, r, 2, seed=3) for r in range(2)]
    four = [ItemSampler(20, G, 1, r, 4, seed=3) for r in range(4)]
    for _ in range(5):  # crosses an epoch boundary (2 steps per epoch)
        whole = [m[0] for m in single.next_step()]
        per_rank = [r.next_step() for r in ranks]
        assert per_rank[0] == [whole[0:2], whole[2:4]]
        assert per_rank[1] == [whole[4:6], whole[6:8]]
        assert [i for r in four for m in r.next_step() for i in m] == whole
        assert len(set(whole)) == G


def test_resume_sees_exactly_the_unseen_pairs():
    ref = ItemSampler(30, 6, 3, 1, 2, seed=11)
    expected = _steps(ref, 12)
    run = ItemSampler(30, 6, 3, 1, 2, seed=11)
    first = _steps(run, 7)
    state = run.state_dict()
    assert state["epoch"] == 1 and state["step_in_epoch"] == 2
    resumed = ItemSampler(30, 6, 3, 1, 2, seed=11)
    resumed.load_state_dict(state)
    assert first + _steps(resumed, 5) == expected
    # resuming on another layout continues the same global order
    whole = ItemSampler(30, 6, 6, 0, 1, seed=11)
    whole.load_state_dict(state)
    assert len(whole.next_step()[0]) == 6


def test_no_shuffle_and_drop_last_false_wraps():
    s = ItemSampler(5, 2, 1, 0, 1, seed=0, shuffle=False, drop_last=False)
    assert s.steps_per_epoch == 3
    assert _steps(s, 4) == [[[0], [1]], [[2], [3]], [[4], [0]], [[0], [1]]]


def test_errors():
    with pytest.raises(
        ValueError, match="not divisible by micro_batch_size=2 x data_parallel_size=3"
    ):
        ItemSampler(100, 8, 2, 0, 3, seed=0)
    short = ItemSampler(3, 4, 1, 0, 1, seed=0)  # constructing is fine (e.g. a small eval split)
    assert short.steps_per_epoch == 0
    with pytest.raises(ValueError, match="3 items cannot fill one global batch of 4 items"):
        short.next_step()
    s = ItemSampler(10, 2, 1, 0, 1, seed=0)
    with pytest.raises(ValueError, match="sampler state has seed=1"):
        s.load_state_dict(ItemSampler(10, 2, 1, 0, 1, seed=1).state_dict())


def test_epoch_steps_are_what_next_step_returns_without_moving_the_sampler():
    """The precompute pass of the reference groups the pairs as training's first epoch does:
    ``epoch_steps`` gives each step's micro-batches of this rank, and leaves the state alone."""
    s = ItemSampler(22, 6, 3, 1, 2, seed=4)
    s.next_step()
    state = s.state_dict()
    plan = s.epoch_steps(0)
    assert s.state_dict() == state
    fresh = ItemSampler(22, 6, 3, 1, 2, seed=4)
    assert plan == _steps(fresh, 3) and len(plan) == s.steps_per_epoch == 3
    assert s.epoch_steps(1) == _steps(fresh, 3)
    assert ItemSampler(3, 4, 1, 0, 1, seed=0).epoch_steps(0) == []


def test_a_state_saved_under_the_old_key_num_pairs_resumes_at_its_step():
    """Checkpoints written before the sampler counted items of any kind store ``num_pairs``: a
    run resumed from one reads the same next batch as the uninterrupted run."""
    straight = ItemSampler(20, 4, 2, 0, 2, seed=3)
    for _ in range(3):
        straight.next_step()
    state = straight.state_dict()
    old = {("num_pairs" if k == "num_items" else k): v for k, v in state.items()}
    resumed = ItemSampler(20, 4, 2, 0, 2, seed=3)
    resumed.load_state_dict(old)
    assert resumed.state_dict() == state
    assert resumed.next_step() == straight.next_step()
    with pytest.raises(ValueError, match="num_items=21 but this run has num_items=20"):
        ItemSampler(20, 4, 2, 0, 2, seed=3).load_state_dict({**old, "num_pairs": 21})
