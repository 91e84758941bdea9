"""Online rounds on the real engine (tiny model, gloo): files and counts of two rounds at one
rank and at TP 2 x PP 2 (the reward model on its own layout), the policy moving, and a run
stopped between phases and resumed ending as an uninterrupted one."""

from __future__ import annotations

import json
import math
import os

import pytest

from tests.engine import TINY
from tests.multirank import run_cases, run_ranks

pytestmark = pytest.mark.slow

MODEL = {**TINY, "vocab_size": 512}  # the tiny tokenizer has 400 ids
PROMPTS = [
    {"prompt": "The sky is blue."},
    {"messages": [{"role": "user", "content": "What colour is the sky?"}]},
    {"prompt": "Hello! How are you?"},
    {"messages": [{"role": "user", "content": "Answer: yes or no."}]},
    {"prompt": "The grass is green."},
]


def _prepare(folder: str) -> None:
    """Prompts, the tiny tokenizer and the initial checkpoint (one rank)."""
    from dpo_megatron.checkpointing import save_model_checkpoint
    from dpo_megatron.models import ModelConfig, build_model_chunks
    from dpo_megatron.parallel import ParallelConfig, initialize_distributed, set_seed
    from tests.data.fixtures import tiny_hf_tokenizer

    with open(os.path.join(folder, "prompts.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in PROMPTS)
    tiny_hf_tokenizer().save_pretrained(os.path.join(folder, "tokenizer"))
    initialize_distributed(ParallelConfig())
    set_seed(3)
    model_cfg = ModelConfig(**MODEL)
    chunks = build_model_chunks(model_cfg, ParallelConfig())
    save_model_checkpoint(chunks, os.path.join(folder, "initial"), model_cfg)


def _config(
    folder,
    run,
    tp=1,
    pp=1,
    reference="round_start",
    resume="none",
    rm_pp=0,
    global_batch=2,
    rm_reads=None,
    missing_eos_penalty=0.0,
    sampling_tp=0,
    sampling_pp=0,
):
    from dpo_megatron.config import config_from_mapping

    online = {
        "rounds": 2,
        "prompts": os.path.join(folder, "prompts.jsonl"),
        "prompts_per_round": 3,
        "samples_per_prompt": 3,
        "sampling": {
            "max_new_tokens": 4,
            "seed": 11,
            "parallel": {
                "tensor_model_parallel_size": sampling_tp,
                "pipeline_model_parallel_size": sampling_pp,
            },
        },
        "min_margin": 1.0,
        "missing_eos_penalty": missing_eos_penalty,
        "reference": reference,
        "eval_prompts": 1,
    }
    if rm_pp:
        online["reward_model"] = {
            "path": os.path.join(folder, "initial"),
            "parallel": {"pipeline_model_parallel_size": rm_pp},
            **(rm_reads or {}),
        }
    else:
        online["judge"] = "tests.online.standins:char_judge"
    return config_from_mapping(
        {
            "run_dir": os.path.join(folder, run),
            "parallel": {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp},
            "model": {**MODEL, "load": os.path.join(folder, "initial")},
            "data": {"tokenizer": os.path.join(folder, "tokenizer"), "max_prompt_length": 64},
            "loss": {"name": "sigmoid", "beta": 0.1},
            "train": {
                "micro_batch_size": 1,
                "global_batch_size": global_batch,
                "train_iters": 2,
                "lr": 1e-2,
                "lr_decay_style": "constant",
                "eval_at_start": False,
            },
            "reference": {"mode": "model"},
            "checkpoint": {"resume": resume},
            "logging": {"tensorboard": False},
            "online": online,
        },
        check=False,
    )


def _sigterm_after(round_index: int, step: int):
    """Patch the Trainer so that rank 0 gets SIGTERM after ``step`` of round ``round_index``'s
    training (as from a scheduler: the ranks save and stop at that step). Returns the undo."""
    import signal

    from dpo_megatron.training.trainer import Trainer

    original = Trainer.train_step

    def train_step(self):
        out = original(self)
        here = self.cfg.run_dir.endswith(f"round_{round_index}")
        if here and self.counters.step == step and int(os.environ["RANK"]) == 0:
            signal.raise_signal(signal.SIGTERM)
        return out

    Trainer.train_step = train_step
    return lambda: setattr(Trainer, "train_step", original)


def _online(folder, run, stop_after=None, sigterm_at=None, generator="counting_generate", **config):
    """One online run (or part of one); returns the summaries (None when stopped) and the
    stand-ins' call counts of this run. ``sigterm_at``: (round, step) of a SIGTERM;
    ``generator``: the stand-in generation of ``tests.online.standins``."""
    from dpo_megatron.config import validate_online_config
    from dpo_megatron.online.adapters import use_generator, use_reward_model
    from dpo_megatron.online.rounds import StopAfter, run_online
    from tests.online import standins

    cfg = _config(folder, run, **config)
    validate_online_config(cfg, int(os.environ["WORLD_SIZE"]))
    before = dict(standins.CALLS)
    undo = _sigterm_after(*sigterm_at) if sigterm_at else (lambda: None)
    with (
        use_generator(getattr(standins, generator)),
        use_reward_model(standins.build_tiny_reward_model, standins.layout_checking_scorer),
    ):
        try:
            summaries = run_online(cfg, stop_after=stop_after)
        except StopAfter:
            summaries = None
        except SystemExit as e:  # RunInterrupted: saved at the signalled step
            assert sigterm_at and e.code == 143, e
            summaries = None
        finally:
            undo()
    calls = {k: v - before.get(k, 0) for k, v in standins.CALLS.items() if not k.endswith("layout")}
    return {
        "summaries": summaries,
        "calls": calls,
        "layout": standins.CALLS.get("score_layout"),
        "sampled_at": standins.CALLS.get("generate_layout"),
    }


def _mistral_reads() -> dict:
    from tests.scripts import load_script

    model = str(load_script("assets").ensure_sentencepiece_model())
    return {"tokenizer": model, "chat_template": "mistral"}


def _check_other_family_scores(folder, run):
    """Each round's scores are the stand-in scorer's (completion ids summed, mod 11) on the
    samples read with the reward model's own tokenizer from their prompt form and text, not on
    the policy's ids; the log names that tokenizer and says every sample was read so."""
    from dpo_megatron.online.adapters import reward_model_sequences, reward_reader
    from dpo_megatron.online.records import SampleRecord, read_records

    cfg = _config(folder, run, rm_pp=1, rm_reads=_mistral_reads())
    reader = reward_reader(cfg, None)
    log = open(f"{folder}/{run}/train.log").read()
    assert f"(its tokenizer: {reader.source})" in log
    for r in range(2):
        samples = read_records(f"{folder}/{run}/online/round_{r}/samples.jsonl", SampleRecord)
        forms = [PROMPTS[s.row].get("prompt") or PROMPTS[s.row]["messages"] for s in samples]
        encoded = reward_model_sequences(reader, forms, samples, "samples.jsonl")
        assert encoded.retokenized == len(samples) == 9
        assert max(map(max, encoded.sequences)) >= 512  # not the tiny tokenizer's ids
        scores = [x["score"] for x in _read(f"{folder}/{run}/online/round_{r}/scores.jsonl")]
        assert scores == [float(sum(q[c:]) % 11) for q, c in zip(encoded.sequences, encoded.starts)]
    for r in range(2):
        assert f"[online, round {r}] 9 of 9 sampled completions read from their text" in log


def _final_weights_equal(folder, run_a, run_b):
    """Whether the last round's final checkpoints of two runs hold the same weights."""
    import torch

    from dpo_megatron.models import ModelConfig, build_model_chunks
    from dpo_megatron.online.layouts import use_layout
    from dpo_megatron.parallel import ParallelConfig
    from dpo_megatron.training.run_models import load_weights

    use_layout(ParallelConfig())
    states = []
    for run in (run_a, run_b):
        chunks = build_model_chunks(ModelConfig(**MODEL), ParallelConfig())
        load_weights(chunks, ModelConfig(**MODEL), f"{folder}/{run}/online/round_1/checkpoints")
        states.append(chunks[0].state_dict())
    return all(
        torch.equal(states[0][k], states[1][k])
        for k in states[0]
        if isinstance(states[0][k], torch.Tensor)
    )


def _read(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _train_records(run_dir, r):
    keep = ("loss", "grad_norm", "rewards/accuracies", "rewards/margins", "logps/chosen")
    return [
        {k: rec[k] for k in keep}
        for rec in _read(f"{run_dir}/online/round_{r}/metrics.jsonl")
        if rec["split"] == "train"
    ]


def _pairs_by_hand(samples, ranked, n, min_margin):
    """(prompt, chosen, rejected) of each kept pair, ties and near-ties, from the samples' rows
    and the scores they are ranked by."""
    expected, ties, near = [], 0, 0
    for p in range(n):
        rows = [(s, v) for s, v in zip(samples, ranked) if s["prompt"] == p]
        best = max(rows, key=lambda x: x[1])  # first of equal
        worst = min(reversed(rows), key=lambda x: x[1])  # last of equal
        margin = best[1] - worst[1]
        if margin <= 0 or best[0]["completion_ids"] == worst[0]["completion_ids"]:
            ties += 1
        elif margin < min_margin:
            near += 1
        else:
            expected.append((p, best[0]["sample"], worst[0]["sample"]))
    return expected, ties, near


def _check_round_files(run_dir, r, k=3, n=3, min_margin=1.0, penalty=0.0):
    """Files and counts of round ``r`` against a recomputation by hand from its files (the
    tiny tokenizer's stop ids: EOS = pad = 2, ``online.missing_eos_penalty`` = ``penalty``)."""
    base = f"{run_dir}/online/round_{r}"
    samples, scores, pairs = (_read(f"{base}/{n_}.jsonl") for n_ in ("samples", "scores", "pairs"))
    summary = json.load(open(f"{base}/summary.json"))
    assert len(samples) == len(scores) == n * k
    assert [(s["prompt"], s["sample"]) for s in samples] == [
        (p, j) for p in range(n) for j in range(k)
    ]
    cut = [s["completion_ids"][-1] != 2 for s in samples]
    ranked = [sc["score"] - penalty * c for sc, c in zip(scores, cut)]
    expected, ties, near = _pairs_by_hand(samples, ranked, n, min_margin)
    assert [(q["prompt"], q["chosen_sample"], q["rejected_sample"]) for q in pairs] == expected
    assert summary["prompts"] == n and summary["samples"] == n * k
    assert summary["pairs_kept"] == len(pairs)
    assert summary["samples_without_eos"] == sum(cut)
    assert (summary["ties_dropped"], summary["near_ties_dropped"]) == (ties, near)
    assert summary["mean_score"] == pytest.approx(sum(x["score"] for x in scores) / len(scores))
    return summary, pairs


def _check_report(run_dir, evals, summaries):
    """The evaluation report against the evaluation files: means, the change since the start
    and the KL (mean log-ratio of the policy to the starting policy; 0 at the start) with
    intervals around them, in each round's summary.json and the run's online/summary.json;
    the plot written; the final policy the last round's last checkpoint."""
    report = json.load(open(f"{run_dir}/online/summary.json"))
    entries = report["evaluation"]
    assert [e["round"] for e in entries] == [-1, 0, 1]
    assert [s.eval.to_json() for s in summaries] == entries[1:]
    assert "logp" not in evals[0][0]  # the starting policy: KL 0 by definition
    assert entries[0]["kl_from_initial"] == {"mean": 0.0, "low": 0.0, "high": 0.0}
    start_mean = sum(x["score"] for x in evals[0]) / len(evals[0])
    for e, rows in zip(entries, evals):
        mean = sum(x["score"] for x in rows) / len(rows)
        assert (e["prompts"], e["samples_per_prompt"]) == (1, 3)
        assert e["score"]["mean"] == pytest.approx(mean)
        assert e["score"]["low"] <= mean <= e["score"]["high"]
        if e["round"] < 0:
            continue
        assert e["score_change"]["mean"] == pytest.approx(mean - start_mean)
        assert e["score_change"]["low"] <= e["score_change"]["mean"] <= e["score_change"]["high"]
        ratios = [x["logp"] - x["logp_initial"] for x in rows]
        assert all(x["logp"] < 0 and x["logp_initial"] < 0 for x in rows)
        assert any(abs(r) > 1e-3 for r in ratios)  # the policy moved (lr 1e-2)
        kl = e["kl_from_initial"]
        assert kl["mean"] == pytest.approx(sum(ratios) / len(ratios))
        assert min(ratios) <= kl["low"] <= kl["mean"] <= kl["high"] <= max(ratios)
    assert report["final_policy"] == f"{run_dir}/online/round_1/checkpoints/iter_0000002"
    assert report["plot"] == f"{run_dir}/online/evaluation.png"
    assert open(report["plot"], "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert [r["round"] for r in report["rounds"]] == [0, 1]
    log = open(f"{run_dir}/train.log").read()
    assert f"online: final policy {report['final_policy']} (continue: model.load=" in log
    assert f"checkpoints -> {run_dir}/online/round_<r>/checkpoints |" in log
    assert not os.path.exists(f"{run_dir}/checkpoints")


def test_two_rounds_one_rank_and_resume_between_phases(tmp_path):
    folder = str(tmp_path)
    run_ranks(_prepare, world_size=1, folder=folder)
    out = run_cases(
        1,
        {
            "straight": (_online, {"folder": folder, "run": "straight"}),
            "initial_ref": (_online, {"folder": folder, "run": "initref", "reference": "initial"}),
            # killed after round 0's scores and after round 1's pairs; resumed each time
            "part1": (_online, {"folder": folder, "run": "resumed", "stop_after": (0, "score")}),
            "part2": (
                _online,
                {"folder": folder, "run": "resumed", "resume": "auto", "stop_after": (1, "pairs")},
            ),
            "part3": (_online, {"folder": folder, "run": "resumed", "resume": "auto"}),
            "same_weights": (
                _final_weights_equal,
                {"folder": folder, "run_a": "straight", "run_b": "resumed"},
            ),
            # SIGTERM after step 1 of round 1's training: saved there, resumed from it
            "killed": (_online, {"folder": folder, "run": "killed", "sigterm_at": (1, 1)}),
            "continued": (_online, {"folder": folder, "run": "killed", "resume": "auto"}),
            "same_weights_killed": (
                _final_weights_equal,
                {"folder": folder, "run_a": "straight", "run_b": "killed"},
            ),
            # 3 prompts a round: never a global batch of 4 pairs, the policy never trains
            "untrained": (_online, {"folder": folder, "run": "untrained", "global_batch": 4}),
            "penalized": (
                _online,
                {
                    "folder": folder,
                    "run": "penalized",
                    "missing_eos_penalty": 6.0,
                    "generator": "eos_ending_generate",
                },
            ),
            # a reward model of another family: Mistral's SentencePiece and chat template
            "other_family": (
                _online,
                {"folder": folder, "run": "family", "rm_pp": 1, "rm_reads": _mistral_reads()},
            ),
        },
    )
    _check_other_family_scores(folder, "family")
    for r in range(2):  # the pairs ranked with the penalty, by hand
        summary, pairs = _check_round_files(f"{folder}/penalized", r, penalty=6.0)
        assert summary["samples_without_eos"] == 6  # samples 0 and 2 of each of 3 prompts
    base = f"{folder}/penalized/online/round_0"
    samples, scores = _read(f"{base}/samples.jsonl"), _read(f"{base}/scores.jsonl")
    unpenalized, _, _ = _pairs_by_hand(samples, [x["score"] for x in scores], 3, 1.0)
    kept = [
        (q["prompt"], q["chosen_sample"], q["rejected_sample"])
        for q in _read(f"{base}/pairs.jsonl")
    ]
    assert kept != unpenalized  # the penalty chose other pairs
    straight = f"{folder}/straight"
    for r in range(2):
        summary, pairs = _check_round_files(straight, r)
        assert pairs, f"round {r} kept no pair: the test needs some"
        records = _train_records(straight, r)
        assert len(records) == 2
        # reference = the round's starting policy: step 1 of every round is at ln 2
        assert records[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
        assert summary["train"]["step"] == 2 and summary["policy_end"].endswith(
            f"round_{r}/checkpoints"
        )
    # 2 rounds + 3 evaluations of the held-out prompt (before round 0, after each round)
    assert out["straight"][0]["calls"] == {"generate": 5, "judge": 5}
    evals = [_read(f"{straight}/online/eval_start.jsonl")] + [
        _read(f"{straight}/online/round_{r}/eval.jsonl") for r in range(2)
    ]
    held_row = evals[0][0]["row"]
    assert all(len(e) == 3 and {x["row"] for x in e} == {held_row} for e in evals)
    for r in range(2):  # never a round's prompt
        assert held_row not in {
            s["row"] for s in _read(f"{straight}/online/round_{r}/samples.jsonl")
        }
    means = [sum(x["score"] for x in e) / 3 for e in evals]
    summaries = out["straight"][0]["summaries"]
    assert [s.eval_mean_score_before for s in summaries] == pytest.approx(means[:2])
    assert [s.eval_mean_score for s in summaries] == pytest.approx(means[1:])
    _check_report(straight, evals, summaries)
    # reference = the initial weights: round 1 starts from a policy that moved in round 0
    initial_r1 = _train_records(f"{folder}/initref", 1)
    assert abs(initial_r1[0]["loss"] - math.log(2)) > 1e-4
    assert _train_records(f"{folder}/initref", 0) == _train_records(straight, 0)

    # resumed: no round sampled twice, the same pairs, metrics and weights as straight
    assert out["part1"][0]["calls"] == {"generate": 2, "judge": 2}  # start eval + round 0
    # round 0's train and eval, round 1's samples: nothing of round 0 sampled again
    assert out["part2"][0]["calls"] == {"generate": 2, "judge": 2}
    assert out["part3"][0]["calls"] == {"generate": 1, "judge": 1}  # round 1's eval
    resumed = f"{folder}/resumed"
    for r in range(2):
        for name in ("samples", "scores", "pairs", "eval"):
            a = open(f"{straight}/online/round_{r}/{name}.jsonl").read()
            assert a == open(f"{resumed}/online/round_{r}/{name}.jsonl").read(), (r, name)
        assert _train_records(resumed, r) == _train_records(straight, r)
    assert out["same_weights"] == [True]
    killed = f"{folder}/killed"
    assert out["killed"][0]["summaries"] is None
    assert out["continued"][0]["calls"] == {"generate": 1, "judge": 1}  # round 1's eval only
    assert os.path.isdir(f"{killed}/online/round_1/checkpoints/iter_0000001")
    for r in range(2):
        assert _train_records(killed, r) == _train_records(straight, r)
        pairs = open(f"{killed}/online/round_{r}/pairs.jsonl").read()
        assert pairs == open(f"{straight}/online/round_{r}/pairs.jsonl").read()
    assert out["same_weights_killed"] == [True]
    untrained = out["untrained"][0]["summaries"]
    assert [s.policy_end for s in untrained] == [f"{folder}/initial"] * 2
    assert all(s.train == {} for s in untrained)
    assert not os.path.exists(f"{folder}/untrained/online/round_0/checkpoints")
    report = json.load(open(f"{folder}/untrained/online/summary.json"))
    assert report["final_policy"] == f"{folder}/initial"
    for e in report["evaluation"]:  # the starting policy throughout: the same samples, KL 0
        assert e["score"] == report["evaluation"][0]["score"]
        assert e["kl_from_initial"] == {"mean": 0.0, "low": 0.0, "high": 0.0}
    state = json.load(open(f"{resumed}/online/state.json"))
    assert state["rounds"]["1"]["done"] == ["sample", "score", "pairs", "train", "eval"]


def test_two_rounds_at_tp2_pp2_with_the_reward_model_on_its_own_layout(tmp_path):
    """Two rounds with the policy at TP 2 x PP 2 and the scorer at PP 4 of the same 4 ranks; a
    run stopped by SIGTERM inside round 1's training (all ranks save at that step) and resumed
    ends with the uninterrupted run's pairs and training steps, without sampling round 1 again."""
    folder = str(tmp_path)
    run_ranks(_prepare, world_size=1, folder=folder)
    layout = {"folder": folder, "tp": 2, "pp": 2, "rm_pp": 4}
    cases = run_cases(
        4,
        {
            "straight": (_online, {**layout, "run": "tp2pp2"}),
            "killed": (_online, {**layout, "run": "killed", "sigterm_at": (1, 1)}),
            "continued": (_online, {**layout, "run": "killed", "resume": "auto"}),
            # the policy samples at TP 1 x PP 1 x DP 4 from checkpoints saved at TP 2 x PP 2
            "sampled_alone": (
                _online,
                {
                    **layout,
                    "run": "dp4",
                    "sampling_tp": 1,
                    "sampling_pp": 1,
                    "stop_after": (1, "sample"),
                },
            ),
        },
    )
    out = cases["straight"]
    # the scorer ran at TP 1 x PP 4 x DP 1 while the policy trains at TP 2 x PP 2
    assert [o["layout"] for o in out] == [(1, 4, 1)] * 4
    assert [o["sampled_at"] for o in out] == [(2, 2, 1)] * 4
    assert [o["sampled_at"] for o in cases["sampled_alone"]] == [(1, 1, 4)] * 4
    # the same samples at either layout (fp32: equal here, up to rounding in general), so the
    # same pairs and training; the evaluation's log-probabilities agree to rounding
    for name in ("round_0/samples", "round_0/scores", "round_0/pairs", "round_1/samples"):
        a = open(f"{folder}/tp2pp2/online/{name}.jsonl").read()
        assert a == open(f"{folder}/dp4/online/{name}.jsonl").read(), name
    assert _train_records(f"{folder}/dp4", 0) == _train_records(f"{folder}/tp2pp2", 0)
    for name in ("eval_start", "round_0/eval"):
        a, b = (_read(f"{folder}/{run}/online/{name}.jsonl") for run in ("tp2pp2", "dp4"))
        assert [r["completion_ids"] for r in a] == [r["completion_ids"] for r in b] != []
    # the log-probabilities (after round 0; the start has none) at TP 1 x PP 1 and TP 2 x PP 2
    a, b = (_read(f"{folder}/{run}/online/round_0/eval.jsonl") for run in ("tp2pp2", "dp4"))
    for key in ("logp", "logp_initial"):
        assert [r[key] for r in b] == pytest.approx([r[key] for r in a], rel=1e-5), key
    assert out[0]["calls"] == {"generate": 5, "judge": 0, "score": 5}
    summaries = out[0]["summaries"]
    assert [s.round for s in summaries] == [0, 1] and all(o["summaries"] == summaries for o in out)
    evals = [_read(f"{folder}/tp2pp2/online/eval_start.jsonl")] + [
        _read(f"{folder}/tp2pp2/online/round_{r}/eval.jsonl") for r in range(2)
    ]
    _check_report(f"{folder}/tp2pp2", evals, summaries)  # log-probabilities at TP 2 x PP 2
    for r in range(2):
        summary, pairs = _check_round_files(f"{folder}/tp2pp2", r)
        assert pairs
        records = _train_records(f"{folder}/tp2pp2", r)
        assert records[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
        assert os.path.isdir(f"{folder}/tp2pp2/online/round_{r}/checkpoints")
    # resumed inside round 1's training: only round 1's evaluation is sampled and scored again
    assert all(o["summaries"] is None for o in cases["killed"])
    assert cases["continued"][0]["calls"] == {"generate": 1, "judge": 0, "score": 1}
    assert os.path.isdir(f"{folder}/killed/online/round_1/checkpoints/iter_0000001")
    for r in range(2):
        assert _train_records(f"{folder}/killed", r) == _train_records(f"{folder}/tp2pp2", r)
        for name in ("samples", "scores", "pairs", "eval"):
            a = open(f"{folder}/tp2pp2/online/round_{r}/{name}.jsonl").read()
            assert a == open(f"{folder}/killed/online/round_{r}/{name}.jsonl").read(), (r, name)
