"""GPTModel construction: attention-head layout, vocabulary padding, config validation."""

import pytest

from dpo_megatron.models import ModelConfig
from dpo_megatron.models.transformer_config import (
    attention_heads,
    build_transformer_config,
    padded_vocab_size,
)
from dpo_megatron.parallel import ParallelConfig


def test_smollm2_heads_pad_independently_of_tp():
    cfg = ModelConfig(
        hidden_size=576, num_attention_heads=9, num_query_groups=3, pad_attention_heads=True
    )
    # The same padded shapes at every TP size, so checkpoints load at any layout.
    for tp in (1, 2, 4):
        assert attention_heads(cfg, tp) == (12, 4, 64)  # one zero group of 3 query heads
    with pytest.raises(ValueError, match="pad_attention_heads_multiple"):
        attention_heads(cfg, 3)
    cfg.pad_attention_heads_multiple = 3
    assert attention_heads(cfg, 3) == (9, 3, 64)  # already a multiple: no padding


def test_heads_not_divisible_by_tp_is_an_error_without_padding():
    cfg = ModelConfig(hidden_size=576, num_attention_heads=9, num_query_groups=3)
    with pytest.raises(ValueError, match="pad_attention_heads"):
        attention_heads(cfg, 2)


def test_layers_not_divisible_by_pp():
    with pytest.raises(ValueError, match="layers"):
        build_transformer_config(
            ModelConfig(num_layers=3), ParallelConfig(pipeline_model_parallel_size=2)
        )


def test_transformer_config_fields():
    cfg = ModelConfig(
        num_layers=4,
        hidden_size=64,
        ffn_hidden_size=96,
        num_attention_heads=4,
        num_query_groups=2,
        norm_epsilon=1e-6,
    )
    tc = build_transformer_config(cfg, ParallelConfig())
    assert (tc.num_attention_heads, tc.num_query_groups, tc.kv_channels) == (4, 2, 16)
    assert tc.gated_linear_unit and tc.layernorm_epsilon == 1e-6
    assert tc.hidden_dropout == 0.0 and tc.attention_dropout == 0.0
    assert tc.calculate_per_token_loss


@pytest.mark.parametrize(
    "vocab, mult, tp, expected",
    [(49152, 1, 2, 49152), (50257, 1, 2, 50258), (50257, 128, 2, 50432), (100, 1, 1, 100)],
)
def test_padded_vocab_size(vocab, mult, tp, expected):
    assert padded_vocab_size(vocab, mult, tp) == expected


def _padded_vocab_logits(tp):
    import torch

    from dpo_megatron.models import build_model_chunks
    from dpo_megatron.parallel import initialize_distributed, set_seed

    parallel = ParallelConfig(tensor_model_parallel_size=tp)
    initialize_distributed(parallel)
    set_seed(0)
    cfg = ModelConfig(
        num_layers=1,
        hidden_size=32,
        ffn_hidden_size=64,
        num_attention_heads=2,
        vocab_size=250,
        make_vocab_size_divisible_by=64,
    )
    chunk = build_model_chunks(cfg, parallel)[0]
    tokens = torch.randint(0, 250, (2, 6))
    logits = chunk(tokens, torch.arange(6).expand(2, 6), attention_mask=None)
    logits.logsumexp(-1).sum().backward()  # -inf columns must not poison the gradient
    finite_grads = all(
        torch.isfinite(p.grad).all() for p in chunk.parameters() if p.grad is not None
    )
    return logits.detach(), finite_grads


@pytest.mark.slow
def test_vocab_padding_columns_get_minus_inf_logits():
    import torch

    from tests.multirank import run_ranks

    ((single, ok1),) = run_ranks(_padded_vocab_logits, world_size=1, tp=1)
    assert single.shape[-1] == 256 and ok1
    assert torch.isinf(single[..., 250:]).all() and torch.isfinite(single[..., :250]).all()
    shards = run_ranks(_padded_vocab_logits, world_size=2, tp=2)  # 2 x 128: pad on rank 1 only
    assert torch.isfinite(shards[0][0]).all() and shards[0][1] and shards[1][1]
    assert torch.isinf(shards[1][0][..., 250 - 128 :]).all()
    assert torch.isfinite(shards[1][0][..., : 250 - 128]).all()


def _head_against_logits(tp, tie):
    """The same chunk scored twice: logits then log-probs, and the log-prob head (target_ids)."""
    import torch

    from dpo_megatron.models import build_model_chunks
    from dpo_megatron.models.logprobs import vocab_parallel_token_logps
    from dpo_megatron.parallel import initialize_distributed, set_seed

    parallel = ParallelConfig(tensor_model_parallel_size=tp)
    initialize_distributed(parallel)
    set_seed(0)
    cfg = ModelConfig(
        num_layers=1,
        hidden_size=32,
        ffn_hidden_size=64,
        num_attention_heads=2,
        vocab_size=250,
        make_vocab_size_divisible_by=64,
        tie_word_embeddings=tie,
    )
    chunk = build_model_chunks(cfg, parallel)[0]
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 250, (2, 6), generator=g)
    index = torch.tensor([1, 2, 3, 3, 7, 8, 11])  # a repeated position, as shared prompts have
    targets = torch.randint(0, 250, (7,), generator=g)
    weights = torch.arange(1.0, 8.0)
    results = []
    for head in ("logits", "fused", "unfused"):  # unfused: model.fused_lm_head=false
        chunk.zero_grad(set_to_none=True)
        chunk.fused_lm_head = head == "fused"
        out = chunk(
            tokens,
            torch.arange(6).expand(2, 6),
            output_index=index,
            target_ids=None if head == "logits" else targets,
        )
        logps = vocab_parallel_token_logps(out[0], targets) if head == "logits" else out.token_logps
        (logps * weights).sum().backward()
        results.append(
            (
                logps.detach(),
                {n: p.grad.clone() for n, p in chunk.named_parameters() if p.grad is not None},
            )
        )
    return results


@pytest.mark.slow
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_log_prob_head_equals_logits_then_log_probs(tie):
    """The chunked head (no [n, V/TP] logits) and model.fused_lm_head=false against the output
    layer's logits, at TP 1 and at TP 2 where rank 1's shard ends in 6 padding columns: the same
    log-probs and gradients (bit for bit unfused)."""
    import torch

    from tests.multirank import run_ranks

    (single,) = run_ranks(_head_against_logits, world_size=1, tp=1, tie=tie)
    for rank_results in [single] + list(
        run_ranks(_head_against_logits, world_size=2, tp=2, tie=tie)
    ):
        (logps, grads), (head_logps, head_grads), (unfused, unfused_grads) = rank_results
        torch.testing.assert_close(head_logps, logps, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(head_logps, single[0][0], rtol=1e-6, atol=1e-6)
        assert torch.equal(unfused, logps)  # the same ops as the logits path
        assert grads.keys() == head_grads.keys() == unfused_grads.keys()
        for name in grads:
            torch.testing.assert_close(head_grads[name], grads[name], rtol=1e-5, atol=1e-7)
            assert torch.equal(unfused_grads[name], grads[name])


def _build_parallel_residual_with_norm_recompute():
    from dpo_megatron.models import build_model_chunks
    from dpo_megatron.parallel import initialize_distributed

    initialize_distributed(ParallelConfig())
    cfg = ModelConfig(
        num_layers=1,
        hidden_size=32,
        ffn_hidden_size=64,
        num_attention_heads=2,
        vocab_size=64,
        parallel_residual=True,
        normalization="LayerNorm",
        recompute_granularity="selective",
        recompute_modules=["layernorm"],
    )
    try:
        build_model_chunks(cfg, ParallelConfig())
    except ValueError as e:
        return str(e)
    return "built"


def test_parallel_residual_refuses_selective_recompute_of_the_norms():
    from tests.multirank import run_ranks

    (message,) = run_ranks(_build_parallel_residual_with_norm_recompute, world_size=1)
    assert "not wired for GPT-NeoX's parallel residual" in message, message
