"""The benchmark scripts: their arithmetic by hand, and tiny end-to-end runs (slow)."""

import importlib.util
import json
import math
import platform
import sys
from pathlib import Path

import pytest

from tests.scripts import load_script

REPO = Path(__file__).resolve().parents[1]


bench = load_script("bench_dpo")
objectives = load_script("bench_objectives")
gpu = load_script("gpu_bench")


def test_summarize_by_hand():
    steps = [  # step 0 is warm-up and left out
        {"wall_s": 9.0, "cpu_s": 9.0, "real_tokens": 1, "computed_tokens": 1, "loss": 0.7},
        {"wall_s": 2.0, "cpu_s": 1.0, "real_tokens": 300, "computed_tokens": 400, "loss": 0.6},
        {"wall_s": 4.0, "cpu_s": 2.0, "real_tokens": 300, "computed_tokens": 400, "loss": 0.5},
    ]
    s = bench.summarize(steps, warmup=1)
    assert s["timed_steps"] == 2
    assert s["step_time_median_s"] == 3.0
    assert s["real_tokens_per_s"] == 600 / 6.0
    assert s["real_tokens_per_cpu_s"] == 600 / 3.0
    assert s["padded_fraction"] == 0.25
    assert s["losses"] == [0.7, 0.6, 0.5]
    # shared prompts: 300 real tokens (prompts twice) in 250 positions holding a token, of 260 run
    shared = [dict(r, model_tokens=250, computed_tokens=260) for r in steps]
    s = bench.summarize(shared, warmup=1)
    assert abs(s["padded_fraction"] - 10 / 260) < 1e-12
    assert abs(s["model_tokens_per_real_token"] - 250 / 300) < 1e-12


def test_ratios_and_markdown():
    row = {
        "real_tokens_per_s": 30.0,
        "real_tokens_per_cpu_s": 40.0,
        "step_time_median_s": 2.0,
        "peak_rss_bytes": 2**30,
        "padded_fraction": 0.1,
        "precompute_s": 0.0,
        "step0": {"loss": 0.6931, "logps/chosen": -10.0},
        "losses": [0.6931],
    }
    trl = dict(
        row,
        real_tokens_per_s=20.0,
        real_tokens_per_cpu_s=10.0,
        step_time_median_s=4.0,
        peak_rss_bytes=2**31,
        step0={"loss": 0.6932, "logps/chosen": -10.0},
    )
    q = bench.ratios(row, trl)
    assert q["real_tokens_per_s"] == 1.5 and q["real_tokens_per_cpu_s"] == 4.0
    assert q["step_time_median"] == 0.5 and q["peak_rss"] == 0.5
    assert abs(q["step0_loss_abs_diff"] - 1e-4) < 1e-12
    text = bench.markdown({"results": {"m": {"trl": trl, "engine": row}}})
    assert "| engine | trl | 1.50x | 4.00x | 0.50x | 0.50x | 1.0e-04 |" in text


def test_shared_prompt_figures_by_hand():
    """Tokens computed per pair (a shared prompt once) and the shared-prompt runs against packing
    alone: 4 pairs, 3,000 real tokens per step; packing computes every real token (750 per
    pair), shared prompts 0.8 of them (600 per pair) at 1.2x the CPU rate."""
    row = {
        "real_tokens_per_s": 30.0,
        "real_tokens_per_cpu_s": 40.0,
        "step_time_median_s": 2.0,
        "peak_rss_bytes": 2**30,
        "padded_fraction": 0.1,
        "precompute_s": 0.0,
        "step0": {"loss": 0.6931, "logps/chosen": -10.0},
        "losses": [0.6931],
        "real_tokens_per_step": 3000.0,
        "model_tokens_per_real_token": 1.0,
    }
    shared = dict(row, real_tokens_per_cpu_s=48.0, model_tokens_per_real_token=0.8)
    assert bench.model_tokens_per_pair(row, 4) == 750.0
    assert bench.model_tokens_per_pair(shared, 4) == 600.0
    assert math.isnan(bench.model_tokens_per_pair(row, 0))
    text = bench.markdown(
        {
            "settings": {"pairs_per_step": 4},
            "results": {"m": {"engine+packing": row, "engine+shared": shared}},
        }
    )
    assert "| 0.0 | 750.0 | 1.000 |" in text and "| 0.0 | 600.0 | 0.800 |" in text
    assert (
        "engine+shared / engine+packing: real tok/s (CPU) 1.20x, model tokens per pair 0.800x"
    ) in text


def test_forward_flops_llama_1b_by_hand():
    # q, o: 2048^2 each; k, v: 2048 x 512 each; SwiGLU 3 x 2048 x 8192 -> 60,817,408 per layer.
    per_layer = 2 * 2048 * 2048 + 2 * 2048 * 512 + 3 * 2048 * 8192
    assert per_layer == 60_817_408
    weights = 16 * per_layer + 2048 * 128256  # + LM head (tied) = 1,235,746,816
    assert weights == 1_235_746_816
    got = gpu.forward_flops_per_token(16, 2048, 8192, 32, 8, 128256, context=0)
    assert got == 2 * weights
    with_attention = gpu.forward_flops_per_token(16, 2048, 8192, 32, 8, 128256, context=512)
    assert with_attention - got == 4 * 16 * 2048 * 512


def test_peak_lookup():
    # the whole table, exact per SKU: tests/test_gpu_check.py::test_peak_table_is_exact_per_sku
    assert gpu.peak_tflops("NVIDIA H200", 0) == (989.4, "H200 SXM")
    assert gpu.peak_tflops("NVIDIA A100-SXM4-80GB", 0) == (312.0, "A100 SXM")
    assert gpu.peak_tflops("anything", 123.0) == (123.0, "given: anything")
    assert gpu.peak_tflops("Unknown GPU", 0)[0] is None


def _tiny_hf_model(folder: Path) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.scripts import load_script

    assets = load_script("assets")  # builds a missing asset

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=2048,
        attention_dropout=0.0,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    for f in assets.ensure_smollm2().iterdir():  # the tokenizer files TRL loads
        if f.name.startswith("tokenizer") or f.suffix == ".jinja":
            (folder / f.name).write_bytes(f.read_bytes())
    return str(folder)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="pip install -e .[bench]")
def test_engine_and_trl_agree_on_a_tiny_model(tmp_path, monkeypatch):
    """Both engines on the same tiny Llama and the same real pairs: same loss at every step;
    neither run leaves its run folder behind."""
    path = _tiny_hf_model(tmp_path / "tiny")
    scratch = tmp_path / "tmp"  # the children's temporary folders
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    spec = {
        "steps": 3,
        "warmup": 1,
        "pairs_per_step": 2,
        "micro_batch_size": 2,
        "max_length": 256,
        "max_prompt_length": 128,
        "beta": 0.1,
        "lr": 1e-3,
        "seed": 1,
        "threads": 1,
        "recompute": "",
        "pairs": 6,
        "model": "tiny",
        "model_path": path,
    }
    trl = bench._child({**spec, "run": "trl"})
    engine = bench._child({**spec, "run": "engine+packing"})
    assert list(scratch.iterdir()) == []
    assert abs(trl["step0"]["loss"] - math.log(2)) < 1e-6
    assert abs(engine["step0"]["loss"] - math.log(2)) < 1e-6
    assert abs(engine["step0"]["logps/chosen"] - trl["step0"]["logps/chosen"]) < 1e-4 * abs(
        trl["step0"]["logps/chosen"]
    )
    for a, b in zip(engine["losses"], trl["losses"], strict=True):
        assert abs(a - b) < 1e-4
    assert engine["padded_fraction"] <= trl["padded_fraction"]
    # both with glibc's own malloc (the "+malloc" runs get the engine's opt-in tunables); the
    # engine returns its free heap pages between layers (at least once), TRL does not
    assert trl["host_malloc"] == "host malloc: the C library's default"
    if platform.libc_ver()[0] == "glibc":
        assert engine["heap_trims"] >= 1 and trl.get("heap_trims") is None
        assert engine["host_malloc"] == (
            "host malloc: trim (every block from the heap, free heap pages returned between "
            "layers; no glibc tunables)"
        )


def test_each_run_is_announced_before_its_silent_child_process(tmp_path, monkeypatch, capsys):
    """A run's child process prints nothing until it ends (minutes for TRL's on SmolLM2): the
    driver says which model and run it starts first."""

    class Started(Exception):
        pass

    def child(spec):
        assert capsys.readouterr().out.splitlines()[-1].split() == [
            "smollm2-4l",
            "engine",
            "running",
            "3",
            "steps",
            "...",
        ]
        raise Started

    monkeypatch.setattr(bench, "_child", child)
    monkeypatch.setattr(bench, "model_folder", lambda name: str(tmp_path))
    monkeypatch.setattr(bench, "bench_pairs", lambda *args: ([], 0))
    with pytest.raises(Started):
        bench.main(["--models", "smollm2-4l", "--engines", "engine", "--steps", "3"])


def test_pair_forward_flops_by_hand():
    shape = dict(
        num_layers=2,
        hidden_size=4,
        ffn_hidden_size=8,
        num_attention_heads=2,
        num_query_groups=2,
        vocab_size=10,
    )
    layers = gpu.forward_flops_per_token(2, 4, 8, 2, 2, vocab=0, context=0)
    assert layers == 2 * 2 * (2 * 16 + 2 * 16 + 3 * 32)
    # prompt 2, chosen 1, rejected 1: shared 4 tokens, 9 attention pairs; unshared 6 and 12.
    shared = gpu.pair_forward_flops(shape, 2, 1, 1, share_prompt=True)
    unshared = gpu.pair_forward_flops(shape, 2, 1, 1, share_prompt=False)
    head = 2 * 4 * 10 * 2
    assert shared == layers * 4 + head + 4 * 2 * 4 * 9
    assert unshared == layers * 6 + head + 4 * 2 * 4 * 12


def test_bench_engines_are_valid_configs(tmp_path):
    """Every setting of the bench's ENGINES table is a config the engine accepts."""
    spec = {
        "model_path": "",
        "recompute": "",
        "beta": 0.1,
        "lr": 1e-6,
        "steps": 1,
        "pairs_per_step": 4,
        "micro_batch_size": 4,
        "seed": 1,
        "local_attention": "sdpa",
    }
    for name in bench.ENGINES:
        spec = {**spec, "run": name, "model_path": str(_assets_smollm2())}
        cfg = bench.engine_config(spec, str(tmp_path))
        if name in bench.AUTO:  # the engine's defaults: decided at start-up (auto_settings)
            assert cfg.packing.enabled is None and cfg.packing.share_prompt is None
            assert cfg.reference.mode == "auto" and cfg.model.fused_lm_head is None
            continue
        assert cfg.packing.share_prompt == ("shared" in name)
        assert cfg.packing.enabled == ("shared" in name or "packing" in name)
        assert (cfg.reference.mode == "precomputed") == ("precomputed" in name)
        assert cfg.model.fused_lm_head == ("unfused" not in name)


def _assets_smollm2():
    from tests.scripts import load_script

    assets = load_script("assets")  # builds a missing asset

    return assets.ensure_smollm2()


@pytest.mark.slow
def test_gpu_bench_runs_the_shared_prompt_path_on_cpu(tmp_path):
    """``gpu_bench.py --share-prompt`` (the shared-prompt GPU figure) in its CPU smoke mode: the
    engine's shared-prompt path at step 0 (ln 2), fewer positions computed than real tokens."""
    import json
    import os
    import subprocess

    out = tmp_path / "shared.json"
    subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "gpu_bench.py"),
            "--allow-cpu",
            "--tiny",
            "--share-prompt",
            "--local-attention",
            "sdpa",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--out",
            str(out),
        ],
        check=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=600,
    )
    result = json.loads(out.read_text())
    assert abs(result["step0_loss"] - math.log(2)) < 1e-6
    assert 0.5 < result["model_tokens_per_real_token"] < 1.0  # each prompt computed once


@pytest.mark.slow
def test_gpu_bench_takes_a_context_parallel_size(tmp_path):
    """``gpu_bench.py --context-parallel-size 2`` under torchrun (CPU smoke mode, 2 gloo ranks):
    step-0 loss ln 2 with every sequence split over the two ranks; rank 0 writes the result."""
    import json
    import os
    import subprocess

    out = tmp_path / "cp.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            str(_free_port()),
            str(REPO / "scripts" / "gpu_bench.py"),
            "--allow-cpu",
            "--tiny",
            "--backend",
            "gloo",
            "--context-parallel-size",
            "2",
            "--max-length",
            "64",
            "--micro-batch-size",
            "2",
            "--global-batch-size",
            "2",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--out",
            str(out),
        ],
        check=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
        timeout=600,
    )
    result = json.loads(out.read_text())
    assert abs(result["step0_loss"] - math.log(2)) < 1e-6
    assert result["settings"]["context_parallel_size"] == 2
    assert 0.0 <= result["padded_fraction"] < 1.0


def _free_port() -> int:
    from dpo_megatron.parallel.layout import free_port

    return free_port()


def _run_result(tokens_per_cpu_s, tokens_per_s, rss_gib, **extra):
    return {
        "real_tokens_per_cpu_s": tokens_per_cpu_s,
        "real_tokens_per_s": tokens_per_s,
        "peak_rss_bytes": rss_gib * 2**30,
        **extra,
    }


def test_objective_ratios_by_hand():
    """Every objective against its peer in one report: tokens per CPU-second and per second,
    peak RSS, the step-0 losses (training) and identical completions (greedy generation only)."""
    report = {
        "results": {
            "m": {
                "kto": {
                    "trl": _run_result(50.0, 40.0, 4.0, step0={"loss": 0.5}, losses=[0.5, 0.4]),
                    "engine": _run_result(125.0, 60.0, 2.0, step0={"loss": 0.5}, losses=[0.5]),
                },
                "generation/greedy/batch8": {
                    "transformers": _run_result(20.0, 20.0, 1.0, completions=[[1, 2], [3, 4]]),
                    "engine": _run_result(45.0, 50.0, 1.5, completions=[[1, 2], [3, 5]]),
                },
                "generation/sampled/batch8": {
                    "transformers": _run_result(20.0, 20.0, 1.0, completions=[[1]]),
                    "engine": _run_result(30.0, 30.0, 1.0, completions=[[2]]),
                },
                "reward": {"trl": _run_result(1.0, 1.0, 1.0, step0={"loss": 0.7})},  # no engine
            }
        }
    }
    runs = report["results"]["m"]
    q = objectives.compare(runs["kto"]["engine"], runs["kto"]["trl"], "kto")
    assert q == {
        "tokens_per_cpu_s": 2.5,
        "tokens_per_s": 1.5,
        "peak_rss": 0.5,
        "step0_loss_abs_diff": 0.0,
    }
    greedy = runs["generation/greedy/batch8"]
    q = objectives.compare(greedy["engine"], greedy["transformers"], "generation/greedy/batch8")
    assert q["tokens_per_cpu_s"] == 2.25 and q["tokens_per_s"] == 2.5 and q["peak_rss"] == 1.5
    assert q["identical_completions"] == 1 and q["completions"] == 2
    sampled = runs["generation/sampled/batch8"]
    q = objectives.compare(sampled["engine"], sampled["transformers"], "generation/sampled/batch8")
    assert "identical_completions" not in q  # sampled streams differ between the two sides
    lines = objectives.ratio_lines(report)
    assert len(lines) == 3  # the reward model has no engine run: no ratio
    assert "kto" in lines[0] and "2.50x tokens per CPU-s" in lines[0]
    assert "step-0 loss 0.500000 vs 0.500000" in lines[0]
    assert "identical completions 1/2" in lines[1]
    assert "| kto | engine | 125.0 | 60.0 | 2.00 | 0.500000 | 0.500000 |" in (
        objectives.markdown(report)
    )


def test_objective_cases_run_the_peer_first_and_one_case_per_mode_and_batch():
    args = objectives.parse_args(
        ["--objectives", "kto,generation", "--modes", "greedy", "--batches", "1,32"]
    )
    got = [(key, run, part.get("prompts")) for key, run, part in objectives.cases(args)]
    assert got == [
        ("kto", "trl", None),
        ("kto", "engine", None),
        ("generation/greedy/batch1", "transformers", 16),
        ("generation/greedy/batch1", "engine", 16),
        ("generation/greedy/batch32", "transformers", 32),  # at least one whole batch
        ("generation/greedy/batch32", "engine", 32),
    ]
    with pytest.raises(SystemExit, match="unknown objective 'ppo'"):
        objectives.cases(objectives.parse_args(["--objectives", "ppo"]))
    sampled = objectives.parse_args(
        ["--objectives", "generation", "--modes", "sampled", "--batches", "2", "--samples", "4"]
    )
    assert [(key, part["samples"]) for key, _, part in objectives.cases(sampled)] == [
        ("generation/sampled/batch2x4", 4)
    ] * 2
    with pytest.raises(SystemExit, match="--samples above 1 needs --modes sampled"):
        objectives.cases(objectives.parse_args(["--objectives", "generation", "--samples", "2"]))
    with pytest.raises(SystemExit, match="--samples must be at least 1, got 0"):
        objectives.cases(
            objectives.parse_args(
                ["--objectives", "generation", "--modes", "sampled", "--samples", "0"]
            )
        )


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="pip install -e .[bench]")
def test_every_objective_runs_beside_its_peer_on_a_tiny_model(tmp_path, capsys, monkeypatch):
    """The objectives' bench on a tiny Llama: KTO and the reward model give TRL's losses at
    every step (step 0: 1/2 and ln 2), greedy generation transformers' completions; while a
    run goes, the driver says that it still does; no run leaves its run folder behind."""
    path = _tiny_hf_model(tmp_path / "tiny")
    scratch = tmp_path / "tmp"  # the children's temporary folders
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    spec = {
        "steps": 2,
        "warmup": 1,
        "pairs_per_step": 2,
        "micro_batch_size": 2,
        "pairs": 4,
        "max_length": 256,
        "max_prompt_length": 128,
        "beta": 0.1,
        "lr": 1e-3,
        "recompute": "",
        "seed": 1,
        "threads": 1,
        "model": "tiny",
        "model_path": path,
        "prompts": 3,
        "max_prompt_tokens": 24,
        "max_new_tokens": 4,
        "batch": 2,
        "temperature": 0.8,
        "top_p": 0.95,
    }

    def run(objective, name, **extra):
        job = {**spec, **extra, "objective": objective, "run": name}
        return bench._child(job, script=objectives.__file__, heartbeat_s=0.5)

    for objective, step0 in (("kto", 0.5), ("reward", math.log(2))):
        trl, engine = run(objective, "trl"), run(objective, "engine")
        assert abs(trl["step0"]["loss"] - step0) < 1e-6
        assert abs(engine["step0"]["loss"] - step0) < 1e-6
        for a, b in zip(engine["losses"], trl["losses"], strict=True):
            assert abs(a - b) < 1e-4, objective
    assert list(scratch.iterdir()) == []
    key = "generation/greedy/batch2"
    hf = run(key, "transformers", mode="greedy")
    engine = run(key, "engine", mode="greedy")
    q = objectives.compare(engine, hf, key)
    assert q["identical_completions"] == q["completions"] == 3
    assert all(len(c) == 4 for c in engine["completions"]) and engine["tokens"] == 12
    assert "trl (kto) on tiny: still running" in capsys.readouterr().out


def test_the_report_is_written_into_a_folder_that_does_not_exist_yet(tmp_path, monkeypatch):
    """A fresh checkout has no runs/: the documented `--out runs/bench.json --markdown
    runs/bench.md` must create the folder, not crash after the first run and lose it."""
    result = {
        **_run_result(110.2, 111.0, 6.31),
        "padded_fraction": 0.16,
        "step_time_median_s": 31.01,
        "step0": {"loss": math.log(2)},
    }
    monkeypatch.setattr(bench, "_child", lambda spec: result)
    monkeypatch.setattr(bench, "model_folder", lambda name: str(tmp_path))
    monkeypatch.setattr(bench, "bench_pairs", lambda *args: ([], 0))
    monkeypatch.setattr(bench, "markdown", lambda report: "the tables\n")
    out, md = tmp_path / "runs" / "bench.json", tmp_path / "runs" / "bench.md"
    argv = ["--models", "smollm2-4l", "--engines", "engine", "--steps", "2", "--out", str(out)]
    assert bench.main([*argv, "--markdown", str(md)]) == 0
    report = json.loads(out.read_text())
    assert report["results"]["smollm2-4l"]["engine"]["step0"]["loss"] == math.log(2)
    assert md.read_text() == "the tables\n"


def test_the_objectives_help_says_what_it_measures_and_names_the_objectives(capsys):
    """`bench_objectives.py --help` gives the docstring's whole first sentence (it ended at
    "KTO against", its first line) and lists the objectives --objectives takes."""
    with pytest.raises(SystemExit):
        objectives.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "against ``transformers``' ``generate``." in text
    assert "comma list of dpo, kto, reward, generation" in text


def test_the_memory_breakdown_is_written_into_a_folder_that_does_not_exist_yet(
    tmp_path, monkeypatch
):
    """memory_breakdown.py --out into a missing folder creates it (it crashed after the step it
    had measured)."""
    breakdown = load_script("memory_breakdown")
    monkeypatch.setattr(breakdown, "breakdown", lambda spec: {"peak_rss_bytes": 2**30})
    monkeypatch.setattr(breakdown, "table", lambda result: "the table")
    out = tmp_path / "runs" / "mem" / "breakdown.json"
    assert breakdown.main(["--model", "smollm2-4l", "--steps", "1", "--out", str(out)]) == 0
    assert json.loads(out.read_text()) == {"peak_rss_bytes": 2**30}


def _saved_by_kind(model: dict) -> tuple[dict, int]:
    """One tiny-model step under memory_breakdown's recorder: bytes saved per kind, positions."""
    from tests.engine import TINY, tiny_pairs, tiny_trainer

    dims = {**TINY, **model}
    recorder = load_script("memory_breakdown").SavedActivations(
        set(), dims["vocab_size"], dims["hidden_size"], dims["ffn_hidden_size"]
    )
    trainer = tiny_trainer(
        tiny_pairs(4), model=model, micro_batch_size=4, global_batch_size=4, steps=1
    )
    with recorder:
        _, batch = trainer.train_step()
    return recorder.by_kind, sum(mb.tokens.numel() for mb in batch.micro_batches)


@pytest.mark.slow
def test_the_memory_breakdown_sees_what_the_layers_keep_for_backward():
    """The layers' saved tensors are counted although the model's forward runs under the
    engine's own saved-tensor hooks (it saw only the logits): each layer keeps its two norms'
    inputs (hidden size) and its up projection's output (twice the FFN width; the SwiGLU
    product is made again in backward), fp32."""
    from tests.engine import TINY
    from tests.multirank import run_ranks

    ffn = 96  # twice it is not the vocabulary: the logits are a kind of their own
    by_kind, positions = run_ranks(_saved_by_kind, world_size=1, model={"ffn_hidden_size": ffn})[0]
    per_value = positions * 4  # bytes of one fp32 value at every position
    assert by_kind["MLP"] == TINY["num_layers"] * 2 * ffn * per_value
    hidden = by_kind["hidden-size (norms, residual, projections)"]
    assert hidden >= TINY["num_layers"] * 2 * TINY["hidden_size"] * per_value
