"""Generation at any layout with a KV cache.

Greedy completions equal ``transformers``' ``generate(do_sample=False)`` on the same weights, at
one rank and at TP 2 x PP 2 (prompts of different lengths batched together, left-padded), and
for a mixture of experts at TP 2 x PP 2 x EP 2 (sequence parallelism: decode steps of TP slots).
Sampled completions are the same for a seed at every layout and micro-batch size, and differ
for another seed. A completion ends at its first stop id (kept). A decode step through the
cache gives the logits of a full forward without it (Llama; Gemma 3's sliding windows with their
own RoPE; SmolLM3's NoPE layers). Top-p and the inverse-transform draw are checked by hand on a
small distribution.

The multi-rank cases share two worlds (1 rank and 4 ranks: the module fixture ``runs``).
"""

from __future__ import annotations

import math

import pytest
import torch

from dpo_megatron.generation.sampling import (
    SamplingParams,
    choose_tokens,
    completion_generator,
    nucleus_probs,
)
from tests.models.conversion_helpers import (
    ALL_TINY_CONFIGS,
    build_tiny_hf_model,
    save_tiny_hf_folder,
)
from tests.multirank import run_cases

PROMPT_LENGTHS = [5, 9, 3, 7]
MAX_NEW = 10
PAD_ID = 0


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def _shared_prompts(vocab: int) -> list[list[int]]:
    """Prompts whose prefill shares prefixes (``generation.prefix_tree``): a prompt, its
    duplicate, one that branches off it after 6 tokens, and its first 4 tokens alone."""
    first, second = _prompts(vocab)[:2]
    return [second, second, second[:6] + first, second[:4]]


# ---------------------------------------------------------------------------------------------
# sampling by hand


def test_top_p_keeps_the_tokens_whose_preceding_mass_is_below_p():
    logits = torch.tensor([[0.15, 0.5, 0.05, 0.3]], dtype=torch.float64).log()
    # decreasing order 0.5 (before 0), 0.3 (before 0.5), 0.15 (before 0.8), 0.05 (before 0.95)
    kept = nucleus_probs(logits, 1.0, 0.7)
    assert kept[0].tolist() == pytest.approx([0.0, 0.5 / 0.8, 0.0, 0.3 / 0.8], abs=1e-12)
    only_top = nucleus_probs(logits, 1.0, 0.5)  # 0.3's preceding mass is 0.5, not below 0.5
    assert only_top[0].tolist() == [0.0, 1.0, 0.0, 0.0]
    hot = nucleus_probs(logits, 2.0, 1.0)  # softmax(log p / 2) = sqrt(p) / sum sqrt(p)
    root = [math.sqrt(p) for p in (0.15, 0.5, 0.05, 0.3)]
    assert hot[0].tolist() == pytest.approx([r / sum(root) for r in root], abs=1e-12)


def _full_sort_nucleus(logits, temperature, top_p):
    """The nucleus by a stable sort of the whole vocabulary (the definition, written out)."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    ordered, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    before = torch.cumsum(ordered, dim=-1) - ordered
    kept = torch.where(before < top_p, ordered, torch.zeros_like(ordered))
    nucleus = torch.zeros_like(probs).scatter(-1, order, kept)
    return nucleus / nucleus.sum(dim=-1, keepdim=True)


@pytest.mark.parametrize("head", [2, 256])
def test_the_nucleus_of_the_sorted_head_is_the_full_sorts_bit_for_bit(monkeypatch, head):
    """Top-p from the head of the distribution (``topk``, grown until the nucleus ends inside
    it) keeps the tokens the full stable sort keeps, with the same values: ties at the edge
    (rounded logits, all equal), nuclei larger than the first head, vocabularies of 4 to 49k."""
    from dpo_megatron.generation import sampling

    monkeypatch.setattr(sampling, "HEAD", head)
    g = torch.Generator().manual_seed(0)
    for vocab, scale, tied in [
        (4, 1.0, False),
        (300, 3.0, True),
        (1000, 0.5, False),
        (49152, 3.0, True),
    ]:
        logits = torch.randn(3, vocab, generator=g) * scale
        if tied:
            logits = (logits * 2).round() / 2
        logits[2] = 0.0  # every token tied
        for temperature, top_p in ((0.8, 0.95), (1.0, 0.5), (1.3, 0.999999)):
            assert torch.equal(
                nucleus_probs(logits, temperature, top_p),
                _full_sort_nucleus(logits, temperature, top_p),
            ), (vocab, temperature, top_p)


def test_a_draw_is_the_inverse_transform_of_the_completion_stream():
    logits = torch.tensor([[0.15, 0.5, 0.05, 0.3], [0.15, 0.5, 0.05, 0.3]]).log()
    params = SamplingParams(temperature=1.0, top_p=0.7, max_new_tokens=1, seed=7)
    picked = []
    for _ in range(20):  # 20 draws of each stream, from two rows at once
        picked.append(
            choose_tokens(logits, params, [completion_generator(7, 0, s) for s in (0, 1)])
        )
    expected = []
    for s in (0, 1):
        u = torch.rand(1, generator=completion_generator(7, 0, s), dtype=torch.float64).item()
        expected.append(1 if u < 0.625 else 3)  # cumulative kept mass: id 1 0.625, id 3 1.0
    assert picked[0] == expected
    assert (
        completion_generator(7, 0, 0).initial_seed() != completion_generator(7, 0, 1).initial_seed()
    )
    assert (
        completion_generator(7, 0, 1).initial_seed() != completion_generator(7, 1, 0).initial_seed()
    )


def test_greedy_takes_the_argmax_and_the_lowest_id_of_a_tie():
    logits = torch.tensor([[0.0, 2.0, 2.0, -1.0], [5.0, 1.0, 4.0, 5.0]])
    params = SamplingParams(temperature=0, max_new_tokens=1)
    assert choose_tokens(logits, params, []) == [1, 0]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=-0.1, max_new_tokens=1), "temperature"),
        (dict(top_p=0.0, max_new_tokens=1), "top_p"),
        (dict(top_p=1.5, max_new_tokens=1), "top_p"),
        (dict(max_new_tokens=0), "max_new_tokens"),
    ],
)
def test_sampling_params_out_of_range_are_refused_by_name(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


# ---------------------------------------------------------------------------------------------
# the engine on ranks


def _chunks(hf_dir, tp=1, pp=1, ep=1, vpp=None, **model):
    """This rank's chunks of the model at ``hf_dir`` at the layout (``model``: ModelConfig
    fields other than the defaults here), and the model config."""
    from dpo_megatron.models import ModelConfig, build_model_chunks, load_hf_weights
    from dpo_megatron.models.conversion import model_config_from_hf
    from dpo_megatron.parallel import ParallelConfig, initialize_distributed, set_seed

    parallel = ParallelConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1 if ep > 1 else None,
        sequence_parallel=ep > 1 and tp > 1,
    )
    initialize_distributed(parallel)
    set_seed(1234)
    cfg = model_config_from_hf(
        hf_dir,
        ModelConfig(
            **{
                "params_dtype": "float32",
                "transformer_impl": "local",
                "pad_attention_heads": True,
                **model,
            }
        ),
    )
    chunks = build_model_chunks(cfg, parallel)
    load_hf_weights(chunks, cfg, hf_dir)
    return chunks, cfg


def _generate(hf_dir, runs, tp=1, pp=1, ep=1, vpp=None, shared=False):
    """``{name: completions}`` for each ``name: (SamplingParams kwargs, num_samples,
    micro_batch_size)`` of ``runs``, on one model built at the layout (``shared``: of
    :func:`_shared_prompts`)."""
    from dpo_megatron.generation import SamplingParams, generate

    chunks, cfg = _chunks(hf_dir, tp, pp, ep, vpp)
    prompts = (_shared_prompts if shared else _prompts)(cfg.vocab_size)
    return {
        name: generate(
            chunks,
            prompts,
            SamplingParams(**params),
            num_samples=samples,
            micro_batch_size=mbs,
            pad_id=PAD_ID,
            vocab_size=cfg.vocab_size,
        )
        for name, (params, samples, mbs) in runs.items()
    }


def _stops(hf_dir):
    """(completions without stop ids, the stop id, completions with it): the stop id is the
    third token of the first completion."""
    from dpo_megatron.generation import SamplingParams, generate

    chunks, cfg = _chunks(hf_dir)
    prompts = _prompts(cfg.vocab_size)

    def run(**extra):
        params = SamplingParams(**SAMPLED, **extra)
        return generate(
            chunks,
            prompts,
            params,
            num_samples=2,
            micro_batch_size=3,
            pad_id=PAD_ID,
            vocab_size=cfg.vocab_size,
        )

    full = run()
    stop = full[0][0][2]
    return full, stop, run(stop_ids=(stop,))


def _cache_vs_recompute(hf_dir):
    """Max |logit difference| between decode steps through the cache and full forwards without
    it, over rows of different lengths (left-padded prefill of their first 3..6 tokens, then one
    token per step)."""
    from dpo_megatron.models.kv_cache import KVCache

    chunks, cfg = _chunks(hf_dir)
    model = chunks[0].eval()
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(3, cfg.vocab_size, (n,), generator=g) for n in (9, 11, 8)]
    prefill = [3, 6, 4]
    width = max(prefill)
    steps = min(len(r) - p for r, p in zip(rows, prefill))
    cache = KVCache.create(len(rows), width + steps, torch.device("cpu"))
    tokens = torch.zeros(len(rows), width, dtype=torch.int64)
    positions = torch.zeros_like(tokens)
    real = torch.zeros(tokens.shape, dtype=torch.bool)
    for r, (row, p) in enumerate(zip(rows, prefill)):
        tokens[r, width - p :], positions[r, width - p :] = row[:p], torch.arange(p)
        real[r, width - p :] = True
    worst = 0.0
    with torch.no_grad():
        for step in range(steps + 1):
            if step:
                tokens = torch.stack([row[p + step - 1] for row, p in zip(rows, prefill)])[:, None]
                positions = torch.tensor([[p + step - 1] for p in prefill])
                real = torch.ones_like(tokens, dtype=torch.bool)
            cache.append(positions, real)
            n = tokens.shape[1]
            index = torch.arange(len(rows)) * n + n - 1
            cached = model(tokens, positions, output_index=index, kv_cache=cache)[0]
            for r, (row, p) in enumerate(zip(rows, prefill)):
                seen = row[: p + step][None]
                full = model(seen, torch.arange(seen.shape[1])[None])[0, -1]
                worst = max(worst, (cached[r] - full).abs().max().item())
    return worst


def _direct_vs_schedule(hf_dir, lora=False, **model):
    """The direct decode step against the schedule's on the same cache, greedy steps of rows
    of different lengths (each step's tokens chosen by the schedule): whether the logits are
    equal bit for bit, per step; or the one line saying why the direct step does not serve
    the model (``lora``: with LoRA adapters attached; ``model``: ModelConfig fields)."""
    from dpo_megatron.compat.onednn_inference_linear import packed_linears
    from dpo_megatron.generation import SamplingParams, engine
    from dpo_megatron.generation.direct_decode import DirectDecoder, unsupported
    from dpo_megatron.parallel.schedule import eval_mode

    chunks, cfg = _chunks(hf_dir, **model)
    if lora:
        from dpo_megatron.models.lora import attach_lora
        from dpo_megatron.models.lora_config import LoraConfig

        attach_lora(chunks, LoraConfig(enabled=True, rank=4), cfg, seed=0)
    prompts = _prompts(cfg.vocab_size)
    params = SamplingParams(temperature=0, max_new_tokens=MAX_NEW_DIRECT)
    mb = engine._MicroBatch([(i, 0) for i in range(len(prompts))], prompts, 1, params)
    equal = []
    with torch.no_grad(), eval_mode(chunks), packed_linears(chunks):
        reason = unsupported(chunks)
        if reason is not None:
            return reason
        direct = DirectDecoder(chunks[0])
        padded = chunks[0].vocab_valid_columns
        assert padded == (cfg.vocab_size if model.get("make_vocab_size_divisible_by") else None)
        feed = engine._prefill_feed(mb, prompts, PAD_ID, packed=True)
        engine._run(chunks, [mb], [feed], params, cfg.vocab_size)
        while mb.live():
            tokens, positions, index = engine._decode_feed(mb, 1, PAD_ID)
            mine = direct.logits([(tokens[:, 0], positions[:, 0], mb.cache)])[0].float()
            store = engine.run_schedule(
                engine._forward_step,
                chunks,
                [(tokens, positions, index, mb.cache)],
                len(prompts),
                1,
                True,
            )
            equal.append(torch.equal(mine, store[0]["logits"]))
            engine._run(chunks, [mb], [(tokens, positions, index)], params, cfg.vocab_size)
    return equal


def _direct_merged_vs_schedule(hf_dir):
    """Two micro-batches of 2 rows decoded by one direct step: per step, the products it made
    and the layers' count (4 per layer and the LM head, whatever the micro-batch count), and
    the largest |logit difference| from the schedule's step of each micro-batch alone."""
    from dpo_megatron.compat.onednn_inference_linear import packed_linears
    from dpo_megatron.generation import SamplingParams, direct_decode, engine
    from dpo_megatron.parallel.schedule import eval_mode

    chunks, cfg = _chunks(hf_dir)
    prompts = _prompts(cfg.vocab_size)
    params = SamplingParams(temperature=0, max_new_tokens=MAX_NEW_DIRECT)
    batches = [
        engine._MicroBatch([(i, 0), (i + 1, 0)], prompts, 1, params) for i in (0, len(prompts) - 2)
    ]
    products, worst = [], 0.0
    counted = direct_decode.packed_product

    def counting(*args):
        products[-1] += 1
        return counted(*args)

    with torch.no_grad(), eval_mode(chunks), packed_linears(chunks):
        direct = direct_decode.DirectDecoder(chunks[0])
        direct_decode.packed_product = counting
        try:
            for mb in batches:
                feed = engine._prefill_feed(mb, prompts, PAD_ID, packed=True)
                engine._run(chunks, [mb], [feed], params, cfg.vocab_size)
            while batches[0].live():
                feeds = [engine._decode_feed(mb, 1, PAD_ID) for mb in batches]
                products.append(0)
                mine = direct.logits(
                    [(t[:, 0], p[:, 0], mb.cache) for mb, (t, p, _) in zip(batches, feeds)]
                )
                for mb, feed, logits in zip(batches, feeds, mine):
                    store = engine.run_schedule(
                        engine._forward_step, chunks, [(*feed, mb.cache)], 2, 1, True
                    )
                    worst = max(worst, (logits.float() - store[0]["logits"]).abs().max().item())
                engine._run(chunks, batches, feeds, params, cfg.vocab_size)
        finally:
            direct_decode.packed_product = counted
    return products, 4 * cfg.num_layers + 1, worst


MOE = "qwen3_moe"
MAX_NEW_DIRECT = 6
CACHE_ARCHS = ["llama", "gemma3", "smollm3", "gpt_oss"]  # gpt-oss: sinks in the cache path
DIRECT_ARCHS = ["llama", "qwen2", "qwen3"]  # untied; biases, padded vocabulary; q/k norms
GREEDY = dict(temperature=0, max_new_tokens=MAX_NEW)
SAMPLED = dict(temperature=1.0, top_p=0.9, max_new_tokens=MAX_NEW, seed=0)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("generate")
    folders = {
        arch: save_tiny_hf_folder(arch, str(root / arch))
        for arch in ["llama", MOE, *CACHE_ARCHS[1:], "qwen3"]
    }
    # a vocabulary the engine pads (to a multiple of 128): the LM head masks the padding
    folders["qwen2"] = save_tiny_hf_folder("qwen2", str(root / "qwen2"), vocab_size=250)
    return folders


@pytest.fixture(scope="module")
def runs(folders):
    """Per case, rank 0's result (every rank returns the same completions: checked)."""
    llama = folders["llama"]
    sampled = {
        "greedy": (GREEDY, 1, 3),
        "seed0_mbs1": (SAMPLED, 2, 1),
        "seed0_mbs4": (SAMPLED, 2, 4),
        "seed1": ({**SAMPLED, "seed": 1}, 2, 4),
    }
    one = {
        "one": (_generate, dict(hf_dir=llama, runs=sampled)),
        "shared": (_generate, dict(hf_dir=llama, shared=True, runs={"greedy": (GREEDY, 1, 4)})),
        # sliding windows of 4 (shorter than the shared prefix) and attention sinks
        "shared_gpt_oss": (
            _generate,
            dict(hf_dir=folders["gpt_oss"], shared=True, runs={"greedy": (GREEDY, 1, 4)}),
        ),
        "stops": (_stops, dict(hf_dir=llama)),
        **{
            f"cache_{arch}": (_cache_vs_recompute, dict(hf_dir=folders[arch]))
            for arch in CACHE_ARCHS
        },
        **{
            f"direct_{arch}": (_direct_vs_schedule, dict(hf_dir=folders[arch]))
            for arch in ["llama", "qwen3", MOE, *CACHE_ARCHS[1:]]
        },
        # 250 tokens padded to 256 columns: the LM head masks the padding
        "direct_qwen2": (
            _direct_vs_schedule,
            dict(hf_dir=folders["qwen2"], make_vocab_size_divisible_by=128),
        ),
        "direct_llama_bf16": (_direct_vs_schedule, dict(hf_dir=llama, params_dtype="bfloat16")),
        "direct_lora": (_direct_vs_schedule, dict(hf_dir=llama, lora=True)),
        "direct_merged": (_direct_merged_vs_schedule, dict(hf_dir=llama)),
    }
    four = {
        "tp2pp2": (
            _generate,
            dict(
                hf_dir=llama,
                tp=2,
                pp=2,
                runs={"greedy": (GREEDY, 1, 2), "seed0_mbs2": (SAMPLED, 2, 2)},
            ),
        ),
        "shared_tp2pp2": (
            _generate,
            dict(hf_dir=llama, tp=2, pp=2, shared=True, runs={"greedy": (GREEDY, 1, 4)}),
        ),
        "dp4": (_generate, dict(hf_dir=llama, runs={"seed0_mbs1": (SAMPLED, 2, 1)})),
        # one micro-batch per rank: the interleaved schedule runs it twice (a padding copy)
        "vpp": (_generate, dict(hf_dir=llama, pp=2, vpp=2, runs={"seed0_mbs4": (SAMPLED, 2, 4)})),
        "moe": (
            _generate,
            dict(hf_dir=folders[MOE], tp=2, pp=2, ep=2, runs={"greedy": (GREEDY, 1, 2)}),
        ),
    }
    results = {**run_cases(1, one), **run_cases(4, four)}
    for name, per_rank in results.items():
        assert all(r == per_rank[0] for r in per_rank), name
    return {name: per_rank[0] for name, per_rank in results.items()}


def _hf_greedy(arch: str, prompts=_prompts) -> list[list[int]]:
    model = build_tiny_hf_model(arch)
    out = []
    for prompt in prompts(ALL_TINY_CONFIGS[arch]["vocab_size"]):
        ids = torch.tensor([prompt])
        full = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=MAX_NEW,
            pad_token_id=PAD_ID,
            eos_token_id=None,
        )
        out.append(full[0, len(prompt) :].tolist())
    return out


@pytest.mark.slow
@pytest.mark.parametrize("case", ["one", "tp2pp2", "moe"])
def test_greedy_equals_transformers_generate(runs, case):
    arch = MOE if case == "moe" else "llama"
    expected = _hf_greedy(arch)
    got = runs[case]["greedy"]
    assert [samples[0] for samples in got] == expected
    assert all(len(s) == 1 for s in got)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["shared", "shared_tp2pp2", "shared_gpt_oss"])
def test_prompts_that_share_prefixes_are_prefilled_once_and_decode_as_transformers(runs, case):
    """A prompt, its duplicate, one branching off it and its start, in one micro-batch: the
    prefill packs their 14 distinct tokens once (not 33), and the greedy completions are
    ``transformers``' of each prompt alone, at one rank and at TP 2 x PP 2, and for gpt-oss
    (sliding windows of 4 keys, shorter than the shared prefix, and attention sinks)."""
    from dpo_megatron.generation.prefix_tree import pack_prompts

    arch = "gpt_oss" if case == "shared_gpt_oss" else "llama"
    prompts = _shared_prompts(ALL_TINY_CONFIGS[arch]["vocab_size"])
    assert pack_prompts(prompts).tokens.numel() == 9 + 5 < sum(map(len, prompts)) == 9 + 9 + 11 + 4
    got = runs[case]["greedy"]
    assert [samples[0] for samples in got] == _hf_greedy(arch, _shared_prompts)


@pytest.mark.slow
def test_sampled_completions_depend_on_the_seed_only(runs):
    reference = runs["one"]["seed0_mbs1"]
    assert len(reference) == len(PROMPT_LENGTHS) and all(len(s) == 2 for s in reference)
    assert all(len(c) == MAX_NEW for s in reference for c in s)
    assert runs["one"]["seed0_mbs4"] == reference  # micro-batch size
    assert runs["tp2pp2"]["seed0_mbs2"] == reference  # TP 2 x PP 2
    assert runs["dp4"]["seed0_mbs1"] == reference  # DP 4
    assert runs["vpp"]["seed0_mbs4"] == reference  # PP 2 x VPP 2 x DP 2
    assert runs["one"]["seed1"] != reference  # another seed
    assert reference[0][0] != reference[0][1]  # two samples of one prompt differ


@pytest.mark.slow
def test_a_completion_ends_at_its_first_stop_id_which_it_keeps(runs):
    full, stop, cut = runs["stops"]
    stopped = 0
    for prompt_full, prompt_cut in zip(full, cut):
        for a, b in zip(prompt_full, prompt_cut):
            end = a.index(stop) + 1 if stop in a else len(a)
            assert b == a[:end]
            stopped += end < len(a)
    assert stopped >= 1 and cut[0][0] == full[0][0][:3]


def test_an_empty_batch_of_rows_chooses_nothing():
    params = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=1)
    assert choose_tokens(torch.zeros(0, 8), params, []) == []


@pytest.mark.slow
@pytest.mark.parametrize("arch", CACHE_ARCHS)
def test_cached_decode_equals_recomputation(runs, arch):
    assert runs[f"cache_{arch}"] < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("arch", [*DIRECT_ARCHS, "llama_bf16"])
def test_the_direct_decode_step_gives_the_schedules_logits_bit_for_bit(runs, arch):
    """A decode step computed directly from the layers (``generation.direct_decode``) gives
    the logits of megatron-core's forward through the schedule, bit for bit, in fp32 and bf16:
    untied and tied LM heads, linear biases (added in and after the product), query/key norms."""
    equal = runs[f"direct_{arch}"]
    assert equal == [True] * (MAX_NEW_DIRECT - 1), equal


@pytest.mark.slow
def test_a_direct_step_multiplies_the_rows_of_every_micro_batch_together(runs):
    """Two micro-batches in one direct decode step: each product is made once for both (4 per
    layer and the LM head), and each micro-batch's logits are the schedule's of it alone (up to
    the order of fp32 sums of a product of more rows)."""
    products, per_step, worst = runs["direct_merged"]
    assert products == [per_step] * (MAX_NEW_DIRECT - 1)
    assert worst < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize(
    ("arch", "reason"),
    [
        (MOE, "mixture of experts"),
        ("gemma3", "embedding scale"),
        ("smollm3", "sliding window"),
        ("gpt_oss", "mixture of experts"),
        ("lora", "LoRA adapters"),
    ],
)
def test_models_the_direct_decode_step_does_not_cover_decode_through_the_schedule(
    runs, arch, reason
):
    """Anything the direct loop does not compute is named (and decoded through the schedule:
    the greedy and cache tests above)."""
    assert reason in runs[f"direct_{arch}"]


def test_a_prompt_that_does_not_fit_the_positions_is_refused_by_index():
    """6 prompt tokens and 4 new ones take 6 + 4 - 1 = 9 positions (the last token generated is
    never fed back): one more than a model of 8 positions has, refused before any forward."""
    from types import SimpleNamespace

    from dpo_megatron.generation.engine import generate

    model = SimpleNamespace(max_sequence_length=8)
    params = SamplingParams(temperature=0.0, max_new_tokens=4)
    with pytest.raises(ValueError, match=r"prompt 1 has 6 tokens: .* needs 9 positions, .* 8 "):
        generate([model], [[5], [5] * 6], params, micro_batch_size=1, pad_id=0, vocab_size=16)
