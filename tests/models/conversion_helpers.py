"""Helpers for conversion tests: tiny random HF models built from a config (no download), and a
forward pass through megatron-core's pipeline schedule that returns the gathered logits."""

from __future__ import annotations

import os

import torch

FAMILIES = [
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "mixtral",
    "gpt_neox",
    "gpt2",
    "smollm3",
    "olmo3",
    "gemma3",
    "deepseek_v3",
    "gpt_oss",
]
"""Every architecture family the engine maps, by the name :func:`save_tiny_hf_folder` and
:func:`build_tiny_hf_model` take: the families the bf16 and GPU-shaped build tests cover."""

# Tiny configs, one per architecture; 4 layers so that PP 2 gives 2 layers per stage and the
# interleaved schedule (PP 2 x VPP 2) has one layer per chunk.
TINY_CONFIGS: dict[str, dict] = {
    "llama": dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=16384,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    # SmolLM2's head layout (9 query / 3 key-value heads): TP 2 needs zero-head padding.
    "smollm2": dict(
        model_type="llama",
        hidden_size=72,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=256,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    ),
    # Llama-2 style linear RoPE scaling (position interpolation).
    "llama2": dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=128,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    ),
    "mistral": dict(
        model_type="mistral",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=128,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        sliding_window=None,
        tie_word_embeddings=False,
    ),
    "qwen2": dict(
        model_type="qwen2",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=160,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    ),
    "gpt2": dict(
        model_type="gpt2",
        n_embd=64,
        n_layer=4,
        n_head=4,
        vocab_size=128,
        n_positions=64,
        tie_word_embeddings=True,
    ),
}

# The MoE and GPT-NeoX architectures, kept apart so the per-architecture layout tests of the tables
# above do not grow (each of these is tested at all layouts in one launch: test_new_architectures).
NEW_TINY_CONFIGS: dict[str, dict] = {
    # Qwen3: q/k RMSNorm, head_dim 32 != hidden / heads = 16, tied like the small Qwen3s.
    "qwen3": dict(
        model_type="qwen3",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=128,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    # Qwen3-MoE: 4 experts of width 32, top-2 renormalised, untied.
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        router_aux_loss_coef=0.01,
        vocab_size=128,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    ),
    # Mixtral: 4 experts of width 48, top-2.
    "mixtral": dict(
        model_type="mixtral",
        hidden_size=64,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        router_aux_loss_coef=0.02,
        vocab_size=128,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
    # Pythia: parallel residual, a quarter of each head rotated, LayerNorm + biases, exact GELU.
    "gpt_neox": dict(
        model_type="gpt_neox",
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        vocab_size=128,
        max_position_embeddings=512,
        rotary_pct=0.25,
        rotary_emb_base=10000,
        use_parallel_residual=True,
        hidden_act="gelu",
        layer_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
    # Llama-3.2 (tied, llama3 RoPE scaling factor 32) and Qwen2.5 (q/k/v biases, tied): through
    # the existing Llama / Qwen2 tables.
    "llama32": dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    "qwen25": dict(
        model_type="qwen2",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=160,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
    # SmolLM3: the Llama layer with NoPE layers (no_rope_layer_interval 2: layers 1 and 3, one on
    # each pipeline stage at PP 2), tied; HF windows the NoPE layers with use_sliding_window: a
    # window of 4, shorter than the test sequences (up to 10 tokens).
    "smollm3": dict(
        model_type="smollm3",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        no_rope_layer_interval=2,
        use_sliding_window=True,
        sliding_window=4,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 2000000.0},
    ),
    # OLMo 3: post-norms, q/k norms over the whole projection, sliding window 4 in layers 0-2
    # (layer 3 full: HF's default pattern), untied.
    "olmo3": dict(
        model_type="olmo3",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        sliding_window=4,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    ),
    # Gemma 3 (text): windows of 4 in layers 0-2 with their own RoPE theta, layer 3 global with
    # linear scaling 8 (the 4B+ Gemma 3s), head_dim 32 != hidden / heads, softmax scale from
    # query_pre_attn_scalar 24, tied.
    "gemma3": dict(
        model_type="gemma3_text",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=128,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        sliding_window=4,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        query_pre_attn_scalar=24,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=True,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    ),
    # DeepSeek-V3: multi-latent attention (query latent 48, key/value latent 32, heads of 16
    # nope + 8 rope query/key and 16 value dimensions), layer 0 dense (one on each side of the
    # PP 2 stage boundary: layer 1 is MoE), 8 routed experts of width 32 in 4 groups (top-2
    # groups, top-4 experts), one shared expert, sigmoid scores with a (perturbed) score bias,
    # routed scaling 2.5, untied.
    "deepseek_v3": dict(
        model_type="deepseek_v3",
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=8,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        vocab_size=128,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    # gpt-oss: attention sinks, q/k/v/o biases, windows of 4 in layers 0 and 2 (HF's alternating
    # default), YaRN as gpt-oss states it (truncate false; factor 8 over 16 original positions,
    # so the ramp bends the 16 head dimensions' frequencies), 4 experts of width 32 with
    # biases, top-2 of a biased router, the clamped SwiGLU with a limit (0.15) the tiny
    # activations reach, untied.
    "gpt_oss": dict(
        model_type="gpt_oss",
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=128,
        max_position_embeddings=128,  # factor 8 x the original 16
        rms_norm_eps=1e-5,
        sliding_window=4,
        swiglu_limit=0.15,
        router_aux_loss_coef=0.01,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 16,
        },
    ),
}
VARIANT_TINY_CONFIGS: dict[str, dict] = {
    # Qwen3 untied (the 4B and larger Qwen3s): the same table, a separate output layer.
    "qwen3_untied": {**NEW_TINY_CONFIGS["qwen3"], "tie_word_embeddings": False},
    # Llama-3.1 (untied, llama3 RoPE scaling factor 8): the Llama table.
    "llama31": {
        **NEW_TINY_CONFIGS["llama32"],
        "tie_word_embeddings": False,
        "rope_parameters": {**NEW_TINY_CONFIGS["llama32"]["rope_parameters"], "factor": 8.0},
    },
    # DeepSeek-V3 with YaRN RoPE as DeepSeek-V3 configs state it (factor 32 = 512 / 16, mscale and
    # mscale_all_dim 1: the cos / sin scale is 1, the softmax scale m(32, 1) ** 2).
    "deepseek_v3_yarn": {
        **NEW_TINY_CONFIGS["deepseek_v3"],
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 32.0,
            "original_max_position_embeddings": 16,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    },
}
"""Variants of the architectures above, checked at one layout (TP 2 x PP 2)."""
ALL_TINY_CONFIGS = {**TINY_CONFIGS, **NEW_TINY_CONFIGS, **VARIANT_TINY_CONFIGS}


def build_tiny_hf_model(arch: str, seed: int = 0, **overrides):
    """A randomly initialised transformers model of architecture ``arch`` (key of
    :data:`TINY_CONFIGS` or :data:`NEW_TINY_CONFIGS`), fp32, eval mode. Biases and norm weights
    are randomised too, so a mapping mistake on any tensor changes the outputs."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = dict(ALL_TINY_CONFIGS[arch])
    kwargs.update(overrides)
    model_type = kwargs.pop("model_type")
    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norms are 1 / biases 0 at init: perturb so they are tested
                p.add_(0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3: a weight kept as buffer
                b.add_(0.1 * torch.randn_like(b))
    return model.eval()


def save_tiny_hf_folder(
    arch: str,
    out_dir: str,
    seed: int = 0,
    max_shard_size: str = "5GB",
    safe_serialization: bool = True,
    **overrides,
) -> str:
    """Save :func:`build_tiny_hf_model` to ``out_dir`` and return it."""
    model = build_tiny_hf_model(arch, seed, **overrides)
    kwargs = {"max_shard_size": max_shard_size}
    if not safe_serialization:
        kwargs["safe_serialization"] = False
    try:
        model.save_pretrained(out_dir, **kwargs)
    except TypeError:  # transformers 5 dropped safe_serialization: write .bin by hand
        model.save_pretrained(out_dir, max_shard_size=max_shard_size)
    if not safe_serialization and not os.path.exists(os.path.join(out_dir, "pytorch_model.bin")):
        _safetensors_to_bin(out_dir)
    return out_dir


def _safetensors_to_bin(folder: str) -> None:
    """Rewrite a single-file safetensors folder as ``pytorch_model.bin`` (older HF format)."""
    from safetensors.torch import load_file

    path = os.path.join(folder, "model.safetensors")
    torch.save(load_file(path), os.path.join(folder, "pytorch_model.bin"))
    os.remove(path)


def hf_logps(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Per-token log-probs of ``input_ids[:, 1:]`` under the transformers model, [b, s-1]
    (nats), with padding masked out of attention."""
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.float()
    return token_logps(logits, input_ids)


def completion_logps(model, pairs) -> dict[str, list[float]]:
    """transformers' summed completion log-probs (nats) of each pair's chosen and rejected sides
    under ``model`` (prompt + completion as one unpadded row each)."""
    sums = {"chosen": [], "rejected": []}
    for pair in pairs:
        for side in sums:
            completion = list(getattr(pair, f"{side}_ids"))
            ids = torch.tensor([list(pair.prompt_ids) + completion])
            per_token = hf_logps(model, ids, torch.ones_like(ids))[0]
            sums[side].append(per_token[-len(completion) :].sum().item())
    return sums


def token_logps(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """log softmax(logits[:, t]) at token input_ids[:, t+1]: [b, s, V], [b, s] -> [b, s-1]."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)


def imported_chunks(hf_dir: str, tp: int, pp: int, vpp=None, seed: int = 1234):
    """(chunks, cfg): the model of ``hf_dir`` built at TP x PP (x VPP) in fp32 with the local
    spec and padded heads, its weights imported from the folder. Collective."""
    from dpo_megatron.models import ModelConfig, build_model_chunks, load_hf_weights
    from dpo_megatron.models.conversion import model_config_from_hf
    from dpo_megatron.parallel import ParallelConfig, initialize_distributed, set_seed

    parallel = ParallelConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
    )
    initialize_distributed(parallel)
    set_seed(seed)
    cfg = model_config_from_hf(
        hf_dir,
        ModelConfig(params_dtype="float32", transformer_impl="local", pad_attention_heads=True),
    )
    chunks = build_model_chunks(cfg, parallel)
    load_hf_weights(chunks, cfg, hf_dir)
    return chunks, cfg


def layout_of_segments(segment_ids: torch.Tensor):
    """The ``PackedLayout`` of rows whose sequences are the runs of equal ``segment_ids`` [R, L]
    (each run one causal sequence; a negative id marks a row's unused tail)."""
    from dpo_megatron.data.batch import AttentionSpan, PackedLayout

    rows, length = segment_ids.shape
    spans = []
    for r in range(rows):
        start = 0
        while start < length:
            end = start
            while end < length and segment_ids[r, end] == segment_ids[r, start]:
                end += 1
            flat = (r * length + start, r * length + end)
            spans.append(AttentionSpan(*flat, (flat,), padding=bool(segment_ids[r, start] < 0)))
            start = end
    return PackedLayout.from_spans(segment_ids, None, spans)


def pipeline_logits(
    chunks: list,
    input_ids: torch.Tensor,
    num_microbatches: int = 1,
    position_ids: torch.Tensor | None = None,
    segment_ids: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Forward ``input_ids`` [b, s] through megatron-core's pipeline schedule (forward only).

    The batch is split into ``num_microbatches`` equal micro-batches (the interleaved schedule
    needs a multiple of the pipeline size). ``position_ids`` / ``segment_ids`` [b, s] describe
    packed rows (positions restarting at each sequence; default: one sequence per row, positions
    0..s-1). Returns the logits gathered over the TP group, [b, s, padded_vocab], on last-stage
    ranks; None on the others.
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    b, s = input_ids.shape
    mbs = b // num_microbatches
    if position_ids is None:
        position_ids = torch.arange(s).unsqueeze(0).expand(b, s)
    micro = [
        (
            input_ids[i * mbs : (i + 1) * mbs],
            position_ids[i * mbs : (i + 1) * mbs],
            None
            if segment_ids is None
            else layout_of_segments(segment_ids[i * mbs : (i + 1) * mbs]),
        )
        for i in range(num_microbatches)
    ]

    def forward_step(data_iterator, model):
        tokens, positions, layout = next(data_iterator)
        output = model(tokens, positions, None, packed=layout)

        def collect(output_tensor, non_loss_data=True):
            return gather_from_tensor_model_parallel_region(output_tensor).detach()

        return output, collect

    iterators = [iter(micro) for _ in chunks]
    with torch.no_grad():
        outputs = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iterators if len(chunks) > 1 else iterators[0],
            model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=num_microbatches,
            seq_length=s,
            micro_batch_size=mbs,
            forward_only=True,
            collect_non_loss_data=True,
        )
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return None
    return torch.cat(list(outputs), dim=0)
