"""gpt-oss's config.json -> ModelConfig -> megatron-core's config, its stacked expert tensors seen
one expert at a time and stacked back, the attention sinks of the local kernels against
transformers' eager attention, and every setting or path that is not served refused by name at
config time (one process, no distributed world: seconds).

The model-level numbers (log-probs equal transformers' at every layout, padded, packed and
shared-prompt, export bit for bit) are in ``test_new_architectures`` and
``training/test_bf16_architectures``."""

from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest
import torch

from dpo_megatron.models.config import ModelConfig
from dpo_megatron.models.conversion import model_config_from_hf
from dpo_megatron.models.conversion.hf_config import hf_config_dict, infer_architecture
from dpo_megatron.models.transformer_config import build_transformer_config
from dpo_megatron.parallel import ParallelConfig
from tests.models.conversion_helpers import NEW_TINY_CONFIGS, build_tiny_hf_model
from tests.models.test_conversion_config import _new_config_folder, _write_config


@pytest.fixture
def cfg(tmp_path):
    return model_config_from_hf(
        _new_config_folder(tmp_path, "gpt_oss"), ModelConfig(params_dtype="float32")
    )


def test_fields_of_the_tiny_config(cfg):
    assert cfg.attention_sinks and cfg.add_bias_linear and cfg.add_qkv_bias
    assert cfg.activation == "clamped_swiglu" and cfg.swiglu_limit == 0.15
    assert (cfg.sliding_window, cfg.sliding_window_layers) == (4, [0, 2])  # HF's alternation
    assert (cfg.num_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size) == (4, 2, 32)
    assert cfg.moe_norm_topk_prob and cfg.moe_aux_loss_coeff == 0.01
    assert (cfg.rope_yarn_factor, cfg.rope_yarn_original_max_position_embeddings) == (8.0, 16)
    assert cfg.rope_yarn_truncate is False and cfg.rope_yarn_mscale_all_dim == 0.0
    assert not cfg.tie_word_embeddings and cfg.kv_channels == 16


def test_megatron_config_has_sinks_clamped_swiglu_and_the_yarn_scale(cfg):
    """transformers scales YaRN's cos / sin by m = 0.1 ln(factor) + 1 (no mscale keys); the
    engine folds m ** 2 into the softmax scale."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = build_transformer_config(cfg, ParallelConfig())
    hf = AutoConfig.for_model(**NEW_TINY_CONFIGS["gpt_oss"])
    _, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    assert config.softmax_scale == pytest.approx(attention_factor**2 / math.sqrt(16), rel=1e-12)
    assert config.softmax_type == "learnable" and config.add_bias_linear
    assert config.gated_linear_unit and config.glu_linear_offset == 1.0
    assert config.activation_func_clamp_value == 0.15 and not config.bias_activation_fusion
    assert config.window_size == (3, 0) and config.window_attn_skip_freq == [1, 0, 1, 0]


def test_yarn_table_equals_transformers(cfg, monkeypatch):
    """megatron-core's YaRN table (truncate false: unrounded ramp bounds) has transformers'
    frequencies."""
    # get_emb moves its frequencies to torch.cuda.current_device(): the CPU here.
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from dpo_megatron.models.gpt import yarn_rotary

    hf = AutoConfig.for_model(**NEW_TINY_CONFIGS["gpt_oss"])
    inv_freq, _ = ROPE_INIT_FUNCTIONS["yarn"](hf)
    angles, _ = yarn_rotary(cfg, 16, cpu_init=True).get_emb(5)
    want = torch.arange(5.0)[:, None] * inv_freq
    assert torch.allclose(angles[:, 0, 0, :8], want, rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("quantization_config", {"quant_method": "mxfp4"}, "quantization_config \\(mxfp4\\)"),
        ("swiglu_alpha", 1.5, "swiglu_alpha=1.5 is not supported"),
        ("attention_bias", False, "attention_bias=false"),
        ("rope_parameters", {"rope_type": "linear", "factor": 2.0}, "rope_type='linear'"),
    ],
)
def test_unserved_settings_are_refused_by_name(tmp_path, field, value, message):
    folder = _new_config_folder(tmp_path, "gpt_oss")
    with open(os.path.join(folder, "config.json")) as f:
        raw = json.load(f)
    raw[field] = value
    if field == "rope_parameters":
        raw[field]["rope_theta"] = 10000.0
    with pytest.raises(ValueError, match=message):
        model_config_from_hf(_write_config(tmp_path / "bad", **raw))


@pytest.mark.parametrize(
    ("model", "parallel", "message"),
    [
        (dict(local_attention="flex"), {}, "model.local_attention=flex"),
        (dict(local_attention="megatron"), {}, "model.local_attention=megatron .* no sliding"),
        (dict(sliding_window=None, sliding_window_layers=None, local_attention="flex"), {}, "flex"),
        (dict(num_experts=None), dict(context_parallel_size=2), "context_parallel_size"),
        (
            {},
            dict(
                tensor_model_parallel_size=2, expert_model_parallel_size=2, sequence_parallel=True
            ),
            "set parallel.expert_tensor_parallel_size=1",
        ),
        (
            {},
            dict(
                tensor_model_parallel_size=2,
                expert_tensor_parallel_size=1,
                sequence_parallel=True,
            ),
            "expert_model_parallel_size=1 x parallel.expert_tensor_parallel_size=1 is not a "
            "multiple of parallel.tensor_model_parallel_size=2",
        ),
        (
            dict(pad_attention_heads=True, pad_attention_heads_multiple=4),
            dict(tensor_model_parallel_size=4),
            "model.attention_sinks=true is not served with model.pad_attention_heads",
        ),
    ],
)
def test_paths_without_sinks_or_biased_experts_are_refused_at_config_time(
    cfg, model, parallel, message
):
    with pytest.raises(ValueError, match=message):
        build_transformer_config(dataclasses.replace(cfg, **model), ParallelConfig(**parallel))


def test_the_megatron_kernel_serves_sinks_without_windows(cfg):
    model = dataclasses.replace(
        cfg, sliding_window=None, sliding_window_layers=None, local_attention="megatron"
    )
    assert build_transformer_config(model, ParallelConfig()).softmax_type == "learnable"


def test_generated_config_derives_the_same_model(tmp_path, cfg):
    """Export without a source folder: the written config.json is gpt-oss's and derives the same
    ModelConfig."""
    standalone = ModelConfig(**{**cfg.__dict__, "hf_path": ""})
    written = hf_config_dict(standalone, "float32")
    assert written["architectures"] == ["GptOssForCausalLM"]
    assert infer_architecture(standalone).name == "gpt_oss"
    again = model_config_from_hf(_write_config(tmp_path / "out", **written), standalone)
    assert {**again.__dict__, "hf_path": ""} == standalone.__dict__


def test_stacked_experts_are_seen_one_by_one_and_stacked_back_bit_for_bit(tmp_path):
    from safetensors.torch import load_file

    from dpo_megatron.models.conversion.architectures.gpt_oss import (
        StackedExpertsView,
        pack_stacked_experts,
    )
    from dpo_megatron.models.conversion.hf_files import HFCheckpointReader

    model = build_tiny_hf_model("gpt_oss")
    model.save_pretrained(tmp_path)
    stored = load_file(str(tmp_path / "model.safetensors"))
    view = StackedExpertsView(HFCheckpointReader(str(tmp_path)))
    experts = model.model.layers[3].mlp.experts
    gate = view.read("model.layers.3.mlp.experts.1.gate_proj.weight")
    assert torch.equal(gate, experts.gate_up_proj[1][:, 0::2].t())
    assert torch.equal(
        view.read("model.layers.3.mlp.experts.1.up_proj.bias", 0, 8, 16),
        experts.gate_up_proj_bias[1][1::2][8:16],
    )
    assert torch.equal(
        view.read("model.layers.3.mlp.experts.2.down_proj.weight", 1, 0, 4),
        experts.down_proj[2].t()[:, :4],
    )
    config = model_config_from_hf(str(tmp_path))
    packed = dict(pack_stacked_experts(((n, view.read(n)) for n in view.names()), config))
    assert sorted(packed) == sorted(stored)
    for name, tensor in stored.items():
        assert torch.equal(packed[name], tensor), name


def test_sdpa_sinks_equal_transformers_eager_attention():
    """The sink as one more key (``models.attention.sink_attention``) against transformers'
    ``eager_attention_forward`` of gpt-oss: padded causal rows, a sliding window, and the
    gradient of the sinks."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    from dpo_megatron.models.attention import causal_window_mask, sink_attention

    torch.manual_seed(0)
    b, heads, groups, s, hn = 2, 4, 2, 9, 8
    q = torch.randn(b, heads, s, hn, requires_grad=True)
    k, v = torch.randn(b, groups, s, hn), torch.randn(b, groups, s, hn)
    sinks = torch.randn(heads, requires_grad=True)

    class Module(torch.nn.Module):
        num_key_value_groups = heads // groups
        training = False

    module = Module()
    module.sinks = sinks
    for window in (None, 3):
        visible = torch.ones(s, s, dtype=torch.bool).tril()
        if window is not None:
            visible = causal_window_mask(s, s, window - 1, q.device)
        additive = torch.zeros(s, s).masked_fill(~visible, float("-inf"))
        want, _ = eager_attention_forward(module, q, k, v, additive, scaling=hn**-0.5)
        got = sink_attention(
            q, k, v, None, sinks, is_causal=window is None, attn_mask=visible if window else None
        ).transpose(1, 2)
        assert torch.allclose(got, want, rtol=0, atol=1e-6), window
        grads = [torch.autograd.grad(t.square().sum(), (q, sinks)) for t in (got, want)]
        for g_got, g_want in zip(*grads):
            assert torch.allclose(g_got, g_want, rtol=0, atol=1e-5), window


def test_sinks_on_packed_and_shared_prompt_spans_equal_megatrons_learnable_softmax():
    """The ``sdpa`` kernel's packed route with sinks (spans as square rows, one call) against
    megatron-core's ``SoftmaxOne`` (the ``megatron`` kernel's learnable offset) over the dense
    visibility of the same packed and shared-prompt rows, forward and backward."""
    from megatron.core.fusions.fused_softmax import SoftmaxOne

    from dpo_megatron.models.attention import span_attention, visible_keys
    from tests.models.test_attention import DIM, GROUPS, HEADS, _layouts, _qkv, _real

    for name, layout in _layouts().items():
        rows, length = layout.segment_ids.shape
        q, k, v = _qkv(rows * length, grad=True)
        sinks = (0.5 * torch.randn(HEADS)).requires_grad_()
        got = span_attention(q, k, v, layout.spans, None, sinks=sinks)
        mask = visible_keys(layout.segment_ids, layout.branch_ids)  # [R, 1, L, L]
        qr, kr, vr = (t.reshape(rows, length, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
        kr, vr = (t.repeat_interleave(HEADS // GROUPS, dim=1) for t in (kr, vr))
        scores = (qr @ kr.transpose(-1, -2) * DIM**-0.5).masked_fill(~mask, float("-inf"))
        want = (SoftmaxOne(-1, sinks)(scores) @ vr).transpose(1, 2).reshape(-1, HEADS, DIM)
        real = _real(layout)
        assert torch.allclose(got[real], want[real], rtol=0, atol=1e-6), name
        grads = [torch.autograd.grad(t[real].square().sum(), (q, sinks)) for t in (got, want)]
        for g_got, g_want in zip(*grads):
            assert torch.allclose(g_got, g_want, rtol=0, atol=1e-5), name


def test_peft_export_targets_the_stacked_experts_with_gate_and_up_rows_interleaved(cfg):
    """Expert adapters export for PEFT on transformers' stacked parameters
    (``target_parameters``), an expert's B rows in the stored order: gate and up interleaved as
    the loader reads them (``gate_up_proj[e, :, 0::2]`` is the gate). PEFT's log-probs equal to
    the engine's are ``training/test_moe_dpo``'s."""
    from dpo_megatron.models.conversion.architectures import interleave_rows
    from dpo_megatron.models.conversion.export import peft_adapter_config
    from dpo_megatron.models.lora_config import LoraConfig

    targets = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    config = peft_adapter_config(cfg, LoraConfig(enabled=True, target_modules=targets))
    assert config["target_parameters"] == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    assert config["target_modules"] == [f"self_attn.{m}_proj" for m in "koqv"]
    assert config["lora_dropout"] == 0
    table = {t.megatron: t for t in infer_architecture(cfg).table(cfg)}
    experts = "decoder.layers.{i}.mlp.experts.local_experts.{e}."
    fc1, fc2 = (table[experts + f"linear_fc{n}.weight"] for n in (1, 2))
    assert fc1.hf_interleaved and not fc2.hf_interleaved
    gate, up = torch.arange(6.0).reshape(3, 2), -torch.arange(6.0).reshape(3, 2)
    rows = interleave_rows([gate, up])
    assert rows.shape == (6, 2)
    assert torch.equal(rows[0::2], gate) and torch.equal(rows[1::2], up)
