"""utils.saved_activations: a marked tensor is saved as its recipe and made again in backward,
every other saved tensor is kept as it is, and gradients are bit for bit the same."""

import torch

from dpo_megatron.utils.saved_activations import recomputable, recompute_marked


def _step(mark: bool):
    """x -> h = x * 3 (marked: remade from x) -> h @ w: the gradients and how often h was made
    again."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 4, generator=g, requires_grad=True)
    w = torch.randn(4, 3, generator=g, requires_grad=True)
    made = []

    def remake():
        made.append(1)
        return x.detach() * 3

    with recompute_marked():
        h = x * 3
        if mark:
            recomputable(h, remake)
        out = h @ w
    assert not made  # nothing is made again before backward
    gx, gw = torch.autograd.grad(out, (x, w), torch.ones(5, 3))
    return gx, gw, len(made)


def test_a_marked_tensor_is_made_again_in_backward_with_the_same_gradients():
    gx, gw, made = _step(mark=True)
    rx, rw, plain = _step(mark=False)
    assert (made, plain) == (1, 0)  # the product's weight gradient read the remade h once
    assert torch.equal(gx, rx) and torch.equal(gw, rw)


def test_the_marked_tensor_is_not_kept_and_nothing_changes_without_gradients():
    x = torch.randn(3, 2, requires_grad=True)
    w = torch.randn(2, 2, requires_grad=True)
    with recompute_marked():
        h = recomputable(x * 2, lambda: x.detach() * 2)
        out = h @ w
    # mm keeps its two operands: h only as the recipe, w as itself
    kept = [out.grad_fn._saved_self, out.grad_fn._saved_mat2]  # unpacked on access
    assert torch.equal(kept[0], h.detach()) and kept[0].data_ptr() != h.data_ptr()
    assert kept[1].data_ptr() == w.data_ptr()
    with torch.no_grad(), recompute_marked():
        assert (recomputable(x * 2, lambda: x) @ w).grad_fn is None


def test_a_view_of_a_marked_tensor_is_the_same_view_of_the_remade_one():
    """An alias (what an autograd function returning its input hands on) and a reshape."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 4, generator=g, requires_grad=True)
    w = torch.randn(4, 5, generator=g, requires_grad=True)
    grads = []
    for mark in (True, False):
        with recompute_marked():
            h = x * 3
            if mark:
                recomputable(h, lambda: x.detach() * 3)
            out = h.view_as(h).reshape(6, 4)[1:] @ w  # a view of a view, offset by a row
        if mark:
            saved = out.grad_fn._saved_self
            assert saved.data_ptr() != h.data_ptr() and torch.equal(saved, h.reshape(6, 4)[1:])
        grads.append(torch.autograd.grad(out, (x, w), torch.ones(5, 5)))
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
