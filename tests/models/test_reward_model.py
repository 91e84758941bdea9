"""Reward models against transformers' ``*ForSequenceClassification``, at
TP 2 x PP 2 and at one rank (TP 1 x PP 1, data parallel 4), in one world of 4 gloo ranks:

* an HF reward model imported at each layout scores padded, packed and shared-prompt rows as
  transformers does (1e-5 relative, fp32), sequence parallelism included (Llama, Qwen2, the
  SmolLM2 layout); every other family imports, scores and exports at one rank;
* a reward model trained two steps (Bradley-Terry loss) from an HF reward model gives the same
  losses, metrics and gradient norms at TP 2 x PP 2 as at one rank; exported, transformers
  loads it and scores as the engine does;
* started from a causal LM's folder, the LM head is dropped and the zero head gives exactly
  ln 2 at step 0.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from tests.engine import owns_results, step_record, tiny_pairs, tiny_trainer
from tests.models.conversion_helpers import ALL_TINY_CONFIGS, save_tiny_hf_folder
from tests.multirank import run_cases

pytestmark = pytest.mark.slow

PAD = 0  # never drawn by tiny_pairs (ids 3..vocab-1, EOS 2)
FAMILIES = ("llama", "qwen2", "smollm2")  # untied; q/k/v biases; tied with padded KV heads
OTHER_FAMILIES = ("mistral", "qwen3", "mixtral", "gpt2", "gpt_neox", "olmo3", "gemma3", "smollm3")
"""Checked at one layout: import, scores and export -> transformers."""
REL = 1e-5


def _reward_folder(family: str, out_dir: str, seed: int = 0) -> str:
    """A random HF ``*ForSequenceClassification`` (num_labels=1, pad 0) of the tiny family
    config, norms and score perturbed so that every tensor matters."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    kwargs = {**ALL_TINY_CONFIGS[family], "pad_token_id": PAD}
    model_type = kwargs.pop("model_type")
    config = AutoConfig.for_model(model_type, num_labels=1, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
        model.score.weight.normal_(0.0, 0.5)
    model.save_pretrained(out_dir)
    return out_dir


def _hf_scores(folder: str, sequences) -> list[float]:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return [model.eval()(input_ids=torch.tensor([s])).logits[0, 0].item() for s in sequences]


def _pairs():
    """Four pairs; the first chosen completion ends with a pad id, which the reward position
    skips as transformers does."""
    from dataclasses import replace

    pairs = tiny_pairs(4, seed=11, vocab=128)
    pairs[0] = replace(pairs[0], chosen_ids=(*pairs[0].chosen_ids, PAD))
    return pairs


def _sequences(pairs):
    """(prompt + completion ids, completion start) of the 2B sequences, chosen then rejected."""
    rows = [(p.prompt_ids, p.chosen_ids) for p in pairs]
    rows += [(p.prompt_ids, p.rejected_ids) for p in pairs]
    return [list(p) + list(c) for p, c in rows], [len(p) for p, _ in rows]


def _parallel(tp: int, pp: int, sp: bool = False):
    from dpo_megatron.parallel import ParallelConfig, initialize_distributed, set_seed

    parallel = ParallelConfig(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=sp
    )
    initialize_distributed(parallel)
    set_seed(5)
    return parallel


def _import_and_score(folders: dict, tp: int, pp: int, sp: bool = False) -> dict:
    """Per family: padded scores (``score_sequences``, every rank) and, on the reporting rank,
    the packed and shared-prompt rows' rewards in per-sequence order."""
    from dpo_megatron.data.config import PackingConfig
    from dpo_megatron.data.packing import PackedPairs, SharedPromptPairs
    from dpo_megatron.models import ModelConfig
    from dpo_megatron.reward.scoring import build_reward_chunks, score_sequences
    from dpo_megatron.training.step import reward_scores

    parallel = _parallel(tp, pp, sp)
    pairs = _pairs()
    sequences, starts = _sequences(pairs)
    base = ModelConfig(params_dtype="float32", transformer_impl="local", pad_attention_heads=True)
    out = {}
    for family, folder in folders.items():
        chunks, cfg = build_reward_chunks(folder, parallel, base)
        result = {
            "head": cfg.head,
            "padded": score_sequences(chunks, sequences, starts, micro_batch_size=3, pad_id=PAD),
        }
        for name, builder in (
            ("packed", PackedPairs(PAD, 8, PackingConfig(enabled=True), kind="reward")),
            (
                "shared",
                SharedPromptPairs(
                    PAD, 8, PackingConfig(enabled=True, share_prompt=True), kind="reward"
                ),
            ),
        ):
            values = reward_scores(chunks, builder.build(pairs, [[0, 1], [2, 3]]).to_device())
            if owns_results():  # micro-batch k: chosen of pairs 2k, 2k+1, then their rejected
                chosen = [v for mb in values for v in mb[:2].tolist()]
                rejected = [v for mb in values for v in mb[2:].tolist()]
                result[name] = chosen + rejected
        out[family] = result
    return out


def _completion_logps(folder: str, tp: int, pp: int) -> list[float]:
    """``completion_logps`` of the causal LM in the HF ``folder`` at TP x PP (DP: the rest)."""
    from dpo_megatron.models import ModelConfig, build_model_chunks
    from dpo_megatron.models.conversion import load_hf_weights, model_config_from_hf
    from dpo_megatron.reward.scoring import completion_logps

    parallel = _parallel(tp, pp)
    cfg = model_config_from_hf(
        folder, ModelConfig(params_dtype="float32", transformer_impl="local")
    )
    chunks = build_model_chunks(cfg, parallel)
    load_hf_weights(chunks, cfg, folder)
    for chunk in chunks:
        chunk.eval()
    sequences, starts = _sequences(_pairs())
    return completion_logps(chunks, sequences, starts, micro_batch_size=3, pad_id=PAD)


def _round_trip(folders: dict, export_root: str) -> dict:
    """At one rank's layout (TP 1 x PP 1): each family's reward model imported, scored and
    exported to ``export_root/<family>``."""
    from dpo_megatron.models import ModelConfig
    from dpo_megatron.models.conversion import export_hf
    from dpo_megatron.reward.scoring import build_reward_chunks, score_sequences

    parallel = _parallel(1, 1)
    sequences, starts = _sequences(_pairs())
    base = ModelConfig(params_dtype="float32", transformer_impl="local")
    out = {}
    for family, folder in folders.items():
        chunks, cfg = build_reward_chunks(folder, parallel, base)
        out[family] = score_sequences(chunks, sequences, starts, micro_batch_size=4, pad_id=PAD)
        export_hf(chunks, cfg, os.path.join(export_root, family), dtype="float32")
    return out


def _train(
    folder: str,
    tp: int,
    pp: int,
    export_dir: str = "",
    steps: int = 2,
    run_dir: str = "",
    resume: str = "none",
) -> dict:
    """``steps`` Bradley-Terry steps from ``folder``, an evaluation, and with ``export_dir`` the
    model exported as an HF folder plus its own scores of the pairs' sequences. With
    ``run_dir`` (and no resume) a checkpoint is saved after the first step and the scores of
    its weights kept; ``resume="auto"`` continues that checkpoint, and its weights are also read
    back through ``build_reward_chunks`` and scored."""
    from dpo_megatron.models.conversion import export_hf
    from dpo_megatron.reward.scoring import build_reward_chunks, score_sequences

    pairs = _pairs()
    sequences, starts = _sequences(pairs)
    trainer = tiny_trainer(
        pairs,
        pairs,
        pad_token_id=PAD,
        tp=tp,
        pp=pp,
        micro_batch_size=1,
        global_batch_size=4,
        steps=steps,
        lr=1e-3,
        loss={"name": "bradley_terry", "center_rewards_coefficient": 0.01},
        model={"hf_path": folder, "pad_attention_heads": True},
        run_dir=run_dir or None,
        resume=resume,
    )
    result = {}
    if resume == "auto":
        chunks, _ = build_reward_chunks(os.path.join(run_dir, "checkpoints"), trainer.cfg.parallel)
        result["loaded_scores"] = score_sequences(
            chunks, sequences, starts, micro_batch_size=2, pad_id=PAD
        )
    steps_out = []
    for step in range(trainer.counters.step, steps):
        steps_out.append(step_record(*trainer.train_step()))
        if run_dir and resume != "auto" and step == 0:
            trainer.checkpointer.save(trainer.counters)
            result["saved_scores"] = score_sequences(
                trainer.policy, sequences, starts, micro_batch_size=2, pad_id=PAD
            )
    result |= {
        "head": trainer.model_config.head,
        "reference": trainer.reference is None,
        "steps": [{k: s[k] for k in ("metrics", "grad_norm")} for s in steps_out],
        "eval": trainer.evaluator.run(trainer.policy, trainer.reference, trainer.loss_fn),
    }
    if export_dir:
        export_hf(
            [c.module for c in trainer.policy],
            trainer.model_config,
            export_dir,
            dtype="float32",
            pad_token_id=PAD,
        )
        # What export sends to rank 0 owns its storage (replicated tensors were views of the
        # distributed optimizer's whole parameter buffer: 16 GB on rank 0 for SmolLM2 in fp32).
        from dpo_megatron.models.conversion.export import stage_hf_tensors

        tensors = stage_hf_tensors(
            [c.module for c in trainer.policy], trainer.model_config, torch.float32
        )
        result["storage_ratio"] = max(
            t.untyped_storage().nbytes() / (t.numel() * t.element_size()) for _, t in tensors
        )
        result["scores"] = score_sequences(
            trainer.policy, sequences, starts, micro_batch_size=2, pad_id=PAD
        )
    trainer.close()
    return result


def _head_lr_steps(folder: str, tp: int, pp: int) -> dict:
    """Two steps at ``train.lr=1e-5`` with ``train.reward_head_lr=1e-3``: how far the head and
    the body moved at each (largest change of one weight on this rank)."""
    from dpo_megatron.models.reward_head import reward_head
    from dpo_megatron.training.optim import current_lr

    trainer = tiny_trainer(
        _pairs(),
        pad_token_id=PAD,
        tp=tp,
        pp=pp,
        micro_batch_size=1,
        global_batch_size=4,
        steps=2,
        lr=1e-5,
        lr_decay_style="constant",
        reward_head_lr=1e-3,
        loss={"name": "bradley_terry"},
        model={"hf_path": folder, "pad_attention_heads": True},
    )
    chunk = trainer.policy[-1].module
    head = reward_head(chunk)
    body = [p for n, p in chunk.named_parameters() if "reward_head" not in n]

    def weights():
        return (head.weight.detach().clone() if head is not None else None), [
            p.detach().clone() for p in body
        ]

    moves = []
    for _ in range(2):
        head_before, body_before = weights()
        trainer.train_step()
        head_after, body_after = weights()
        moves.append(
            {
                "head": None if head is None else (head_after - head_before).abs().max().item(),
                "body": max((a - b).abs().max().item() for a, b in zip(body_after, body_before)),
            }
        )
    lr = current_lr(trainer.optimizer)
    trainer.close()
    return {"moves": moves, "lr": lr}


def _save_causal_checkpoint(ckpt_dir: str) -> None:
    """A random causal LM's checkpoint (the engine tests' tiny model) with its model config, as
    an SFT run leaves one."""
    from dpo_megatron.checkpointing import save_model_checkpoint
    from dpo_megatron.models import ModelConfig, build_model_chunks
    from tests.engine import TINY

    parallel = _parallel(1, 1)
    cfg = ModelConfig(**{**TINY, "vocab_size": 128})
    save_model_checkpoint(build_model_chunks(cfg, parallel), ckpt_dir, cfg)


MARGINS = (0.0, 1.0, 2.0, 0.5)


def _from_causal_checkpoint(ckpt_dir: str) -> dict:
    """One reward-model step at TP 2 x PP 2 from a causal LM's checkpoint (``model.load``), on
    pairs that carry margins (:data:`MARGINS`)."""
    from dataclasses import replace

    trainer = tiny_trainer(
        [replace(p, margin=m) for p, m in zip(_pairs(), MARGINS)],
        pad_token_id=PAD,
        tp=2,
        pp=2,
        global_batch_size=4,
        steps=1,
        loss={"name": "bradley_terry"},
        load=ckpt_dir,
    )
    import dataclasses

    from dpo_megatron.checkpointing import load_model_checkpoint
    from dpo_megatron.models import build_model_chunks

    causal_cfg = dataclasses.replace(trainer.model_config, head="lm")
    causal = build_model_chunks(causal_cfg, trainer.cfg.parallel)
    load_model_checkpoint(causal, ckpt_dir)
    expected = causal[0].state_dict()
    got = trainer.policy[0].module.state_dict()
    trunk = [
        k
        for k, v in expected.items()
        if isinstance(v, torch.Tensor) and not k.startswith("output_layer")
    ]
    out = {
        "same_trunk": bool(trunk) and all(torch.equal(expected[k], got[k]) for k in trunk),
        "keys": sorted(got),
        "metrics": trainer.train_step()[0].metrics,
        "head": trainer.model_config.head,
    }
    trainer.close()
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rm")
    folders = {f: _reward_folder(f, str(tmp / f"{f}_rm")) for f in FAMILIES + OTHER_FAMILIES}
    main = {f: folders[f] for f in FAMILIES}
    others = {f: folders[f] for f in OTHER_FAMILIES}
    causal = save_tiny_hf_folder("llama", str(tmp / "llama_lm"))
    export, run = str(tmp / "exported"), str(tmp / "run")
    cases = {
        "score_tp2pp2": (_import_and_score, dict(folders=main, tp=2, pp=2)),
        "score_tp2pp2_sp": (_import_and_score, dict(folders=main, tp=2, pp=2, sp=True)),
        "score_1rank": (_import_and_score, dict(folders=main, tp=1, pp=1)),
        "round_trip": (_round_trip, dict(folders=others, export_root=str(tmp / "round_trip"))),
        "train_tp2pp2": (
            _train,
            dict(folder=folders["qwen2"], tp=2, pp=2, export_dir=export, steps=3, run_dir=run),
        ),
        "train_1rank": (_train, dict(folder=folders["qwen2"], tp=1, pp=1, steps=3)),
        "resume_1rank": (
            _train,
            dict(folder=folders["qwen2"], tp=1, pp=1, steps=3, run_dir=run, resume="auto"),
        ),
        "from_causal_lm": (_train, dict(folder=causal, tp=2, pp=2, steps=1)),
        "logps_tp2pp2": (_completion_logps, dict(folder=causal, tp=2, pp=2)),
        "logps_dp4": (_completion_logps, dict(folder=causal, tp=1, pp=1)),
        "head_lr": (_head_lr_steps, dict(folder=causal, tp=2, pp=2)),
        "causal_checkpoint": (_save_causal_checkpoint, dict(ckpt_dir=str(tmp / "lm_ckpt"))),
        "from_causal_checkpoint": (_from_causal_checkpoint, dict(ckpt_dir=str(tmp / "lm_ckpt"))),
    }
    runs = run_cases(4, cases)
    return {
        "folders": folders,
        "causal": causal,
        "export": export,
        "round_trip": str(tmp / "round_trip"),
        "runs": runs,
    }


def _reporting(results: list) -> dict:
    """The result of a rank that holds the packed rows' rewards (last stage, TP rank 0)."""
    return next(r for r in results if all("packed" in v for v in r.values()))


@pytest.mark.parametrize("case", ["score_tp2pp2", "score_tp2pp2_sp", "score_1rank"])
def test_hf_reward_models_score_as_transformers(world, case):
    sequences, _ = _sequences(_pairs())
    results = world["runs"][case]
    for family in FAMILIES:
        expected = _hf_scores(world["folders"][family], sequences)
        assert all(r[family]["head"] == "reward" for r in results)
        # every rank returns the full list, in input order
        assert all(r[family]["padded"] == results[0][family]["padded"] for r in results)
        got = _reporting(results)[family]
        for form in ("padded", "packed", "shared"):
            assert got[form] == pytest.approx(expected, rel=REL, abs=1e-6), (family, form)


@pytest.mark.parametrize("case", ["logps_tp2pp2", "logps_dp4"])
def test_completion_logps_are_transformers_log_probabilities(world, case):
    """log p(completion | prompt) of a causal LM, every rank the full list in input order, as
    transformers' log-softmax summed over the completion tokens (fp32, 1e-5 relative)."""
    from transformers import AutoModelForCausalLM

    sequences, starts = _sequences(_pairs())
    model = AutoModelForCausalLM.from_pretrained(world["causal"], dtype=torch.float32).eval()
    expected = []
    with torch.no_grad():
        for ids, start in zip(sequences, starts):
            logps = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0], -1)
            targets = torch.tensor(ids[start:])
            expected.append(
                logps[start - 1 : len(ids) - 1].gather(1, targets[:, None]).sum().item()
            )
    results = world["runs"][case]
    assert all(r == results[0] for r in results)
    assert results[0] == pytest.approx(expected, rel=REL)


def test_every_family_imports_and_exports_for_transformers(world):
    sequences, _ = _sequences(_pairs())
    scores = world["runs"]["round_trip"][0]
    for family in OTHER_FAMILIES:
        expected = _hf_scores(world["folders"][family], sequences)
        assert scores[family] == pytest.approx(expected, rel=REL, abs=1e-6), family
        exported = os.path.join(world["round_trip"], family)
        assert _hf_scores(exported, sequences) == pytest.approx(expected, rel=REL, abs=1e-6)


def test_training_step_equals_one_rank_and_exports_for_transformers(world):
    tp2pp2, one = world["runs"]["train_tp2pp2"][0], world["runs"]["train_1rank"][0]
    assert tp2pp2["head"] == "reward" and tp2pp2["reference"]  # no reference model built
    for a, b in zip(tp2pp2["steps"], one["steps"]):
        assert a["metrics"] == pytest.approx(b["metrics"], rel=1e-5, abs=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    assert set(tp2pp2["steps"][0]["metrics"]) >= {
        "loss",
        "rewards/accuracies",
        "rewards/margins",
        "rewards/chosen",
        "rewards/rejected",
    }
    # After three Adam updates the layouts' fp32 rounding differences have grown a little.
    assert tp2pp2["eval"] == pytest.approx(one["eval"], rel=1e-4, abs=1e-6)
    assert tp2pp2["steps"][1]["metrics"]["loss"] != tp2pp2["steps"][0]["metrics"]["loss"]
    assert all(r["storage_ratio"] == 1.0 for r in world["runs"]["train_tp2pp2"])
    # exported: transformers loads a Qwen2ForSequenceClassification and scores as we do
    import json

    with open(os.path.join(world["export"], "config.json")) as f:
        config = json.load(f)
    assert config["architectures"] == ["Qwen2ForSequenceClassification"]
    assert config["num_labels"] == 1 and config["pad_token_id"] == PAD
    sequences, _ = _sequences(_pairs())
    assert _hf_scores(world["export"], sequences) == pytest.approx(
        tp2pp2["scores"], rel=REL, abs=1e-6
    )


def test_a_checkpoint_resumes_at_another_layout_and_scores(world):
    """Saved after step 1 at TP 2 x PP 2, resumed at one rank: steps 2 and 3 as the
    uninterrupted run's; the checkpoint read by ``build_reward_chunks`` scores as the saving
    model did."""
    whole, resumed = world["runs"]["train_tp2pp2"][0], world["runs"]["resume_1rank"][0]
    assert resumed["loaded_scores"] == pytest.approx(whole["saved_scores"], rel=REL, abs=1e-6)
    assert len(resumed["steps"]) == 2
    for a, b in zip(whole["steps"][1:], resumed["steps"]):
        assert a["metrics"] == pytest.approx(b["metrics"], rel=1e-4, abs=1e-6)


def test_a_causal_lm_starts_a_reward_model_at_ln2(world):
    run = world["runs"]["from_causal_lm"][0]
    assert run["head"] == "reward"
    metrics = run["steps"][0]["metrics"]
    assert metrics["loss"] == pytest.approx(math.log(2.0), abs=1e-7)
    assert metrics["rewards/accuracies"] == 0.0 and metrics["rewards/margins"] == 0.0


def test_a_causal_lm_checkpoint_starts_a_reward_model_with_the_data_margins(world):
    for run in world["runs"]["from_causal_checkpoint"]:
        assert run["same_trunk"]  # every weight but the LM head, which it has not
        assert not any(k.startswith("output_layer") for k in run["keys"])
    run = world["runs"]["from_causal_checkpoint"][0]
    assert run["head"] == "reward"
    # zero rewards: each pair's loss is -log sigmoid(0 - 0 - m) = log(1 + e^m)
    expected = sum(math.log1p(math.exp(m)) for m in MARGINS) / len(MARGINS)
    assert run["metrics"]["loss"] == pytest.approx(expected, abs=1e-6)


def test_the_reward_head_has_its_own_learning_rate(world):
    """``train.reward_head_lr=1e-3`` beside ``train.lr=1e-5`` (TP 2 x PP 2). Step 1: Adam's
    first update moves every weight with a gradient by exactly its learning rate (m/sqrt(v) =
    sign(g) after bias correction), so the zero head moves by 1e-3, and the body not at all (a
    zero head passes no gradient back). Step 2: the body moves at its own rate, below 1e-5
    (m/sqrt(v) = 0.1 / sqrt(0.001) x sqrt(1 - 0.999^2) / (1 - 0.9^2) = 0.744 after a zero
    first gradient), the head again by about 1e-3."""
    results = world["runs"]["head_lr"]
    last = [r for r in results if r["moves"][0]["head"] is not None]
    assert len(last) == 2  # the last stage's two TP ranks hold the (replicated) head
    for r in last:
        first, second = r["moves"]
        assert first["head"] == pytest.approx(1e-3, rel=1e-4)
        assert 1e-4 < second["head"] < 2e-3  # Adam's later steps: about lr, not exactly
    for r in results:
        assert r["lr"] == pytest.approx(1e-5)  # the body's rate, as logged
        first, second = r["moves"]
        assert first["body"] == 0.0
        assert second["body"] == pytest.approx(1e-5 * 0.744, rel=1e-2)
