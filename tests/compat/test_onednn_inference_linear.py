"""compat.onednn_inference_linear: within the block a model's linear layers (and a tied LM head)
multiply with oneDNN-packed weights under no grad, giving megatron-core's outputs up to the
order of the sums; with gradients on, or after the block, megatron-core's own product runs."""

import pytest
import torch
import torch.nn.functional as F

from dpo_megatron.compat import onednn_inference_linear as onednn
from tests.engine import TINY
from tests.multirank import run_ranks

pytestmark = pytest.mark.skipif(not onednn.available(), reason="no oneDNN packed linear ops")


def test_packed_product_is_the_linear_map():
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(48, 32, generator=g), torch.randn(48, generator=g)
    packed = onednn.pack(weight)
    for shape in ((1, 32), (8, 32), (3, 5, 32)):  # a decode row, a batch, [s, b, h]
        x = torch.randn(*shape, generator=g)
        torch.testing.assert_close(onednn.packed_product(x, packed), F.linear(x, weight))
        torch.testing.assert_close(
            onednn.packed_product(x, packed, bias), F.linear(x, weight, bias)
        )


def _model_outputs():
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from dpo_megatron.models import ModelConfig, build_model_chunks
    from dpo_megatron.parallel import ParallelConfig, initialize_distributed, set_seed

    initialize_distributed(ParallelConfig())
    set_seed(0)
    chunks = build_model_chunks(
        ModelConfig(**{**TINY, "tie_word_embeddings": True}), ParallelConfig()
    )
    model = chunks[0].eval()
    linears = [
        m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
    ]
    tokens = torch.randint(
        0, TINY["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(1)
    )
    positions = torch.arange(7).expand(2, 7)
    products = []
    product = onednn.packed_product

    def counted(*args, **kwargs):  # the packed products the block runs
        products.append(torch.is_grad_enabled())
        return product(*args, **kwargs)

    onednn.packed_product = counted
    with torch.no_grad():
        plain = model(tokens, positions)
        with onednn.packed_linears(chunks) as packed_count:
            with onednn.packed_linears(chunks) as nested_count:  # a caller's block around it
                packed = model(tokens, positions)
            # the packed copies stay for the outer block; another weight was never packed
            known = [
                onednn.packed_weight(m.weight) is not None for m in linears if m.weight is not None
            ]
            unknown = onednn.packed_weight(torch.zeros(3, 3))
            with torch.enable_grad():
                graded = model(tokens, positions)
            inside = all("_forward_impl" in m.__dict__ for m in linears)
        after = not any("_forward_impl" in m.__dict__ for m in linears)
        freed = all(onednn.packed_weight(m.weight) is None for m in linears)
        again = model(tokens, positions)
    onednn.packed_product = product
    return {
        "plain": plain,
        "packed": packed,
        "graded": graded.detach(),
        "again": again,
        "count": packed_count,
        "nested": nested_count,
        "linears": len(linears),
        "weights": sum(m.weight is not None for m in linears),
        "products": products,
        "inside": inside,
        "after": after,
        "known": known,
        "unknown": unknown,
        "freed": freed,
    }


def test_a_model_inside_the_block_gives_the_same_logits():
    r = run_ranks(_model_outputs, world_size=1)[0]
    # every linear's weight and the tied word embeddings, which the LM head multiplies by
    assert r["count"] == r["weights"] + 1 and r["nested"] == 0  # packed once
    assert r["inside"] and r["after"]
    assert r["known"] == [True] * r["weights"] and r["unknown"] is None and r["freed"]
    assert r["products"] == [False] * r["linears"]  # only the no-grad forward, every linear
    torch.testing.assert_close(r["packed"], r["plain"], rtol=1e-5, atol=1e-5)
    assert torch.equal(r["graded"], r["plain"])  # gradients on: megatron-core's own product
    assert torch.equal(r["again"], r["plain"])  # after the block: megatron-core's own product
