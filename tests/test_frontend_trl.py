"""A TRL DPOConfig YAML through the same translation layer: field by field, TRL's step count,
and its errors (tests/test_frontend_dpo_repo.py covers the reference repo's dialect)."""

import json

import pytest

from dpo_megatron.cli.dpo_repo import main
from dpo_megatron.frontends.dpo_repo import prepare_trl_command
from dpo_megatron.frontends.trl import (
    RENAMES,
    SPECIAL,
    UNSUPPORTED,
    known_fields,
    translate_trl,
    trl_steps,
)
from tests.data.fixtures import tiny_hf_tokenizer


def test_fields_translate():
    fields = {
        "beta": 0.05,
        "loss_type": ["sigmoid", "sft"],
        "loss_weights": [1.0, 0.2],
        "label_smoothing": 0.1,
        "max_length": 256,
        "truncation_mode": "keep_end",
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 4,
        "learning_rate": 5e-7,
        "lr_scheduler_type": "cosine",
        "num_train_epochs": 2,
        "precompute_ref_log_probs": True,
        "padding_free": True,
        "gradient_checkpointing": False,
        "bf16": True,
        "seed": 7,
        "output_dir": "runs/t",
    }
    o, notes, facts = translate_trl(fields, "cfg.yaml", devices=2)
    for want in [
        "loss.beta=0.05",
        "loss.name=[sigmoid,sft]",
        "loss.weights=[1.0,0.2]",
        "loss.label_smoothing=0.1",
        "data.max_length=256",
        "data.truncation_mode=keep_end",
        "train.micro_batch_size=2",
        "train.global_batch_size=16",  # 2 x 4 x 2 devices
        "parallel.data_parallel_size=2",
        "train.lr=5e-07",
        "train.lr_decay_style=cosine",
        "reference.mode=precomputed",
        "packing.enabled=true",
        "model.params_dtype=bfloat16",
        "train.seed=7",
        "run_dir=runs/t",
        "train.optimizer=adam",
    ]:
        assert want in o, want
    assert not any(x.startswith("model.recompute") for x in o)
    assert facts == {
        "max_steps": -1,
        "epochs": 2.0,
        "global_batch": 16,
        "warmup": 0,
        "eval_each_epoch": False,
    }
    # transformers' Trainer: ceil(epochs x ceil(pairs / global batch)); a warm-up < 1 is a ratio
    assert trl_steps(facts, 100) == (14, 0)  # ceil(100 / 16) = 7 per epoch
    assert trl_steps({**facts, "warmup": 0.1}, 100) == (14, 2)
    assert trl_steps({**facts, "max_steps": 5}, None) == (5, 0)


def test_every_key_is_written_once():
    """A TRL config that sets every field it may (the test lists them all: a new field joins it)
    translates to overrides that each set their key once: no field is both renamed and read by
    a rule, so the printed command does not carry ``train.micro_batch_size`` twice."""
    assert not set(RENAMES) & set(SPECIAL)
    fields = {
        "beta": 0.1,
        "label_smoothing": 0.0,
        "use_weighting": False,
        "ld_alpha": 0.5,
        "discopop_tau": 0.05,
        "loss_weights": [1.0],
        "max_length": 256,
        "max_prompt_length": 64,
        "truncation_mode": "keep_end",
        "dataset_num_proc": 2,
        "model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "dataset_name": "trl-lib/ultrafeedback_binarized",
        "dataset_train_split": "train",
        "output_dir": "runs/t",
        "learning_rate": 5e-7,
        "weight_decay": 0.0,
        "adam_beta1": 0.9,
        "adam_beta2": 0.999,
        "adam_epsilon": 1e-8,
        "max_grad_norm": 1.0,
        "seed": 7,
        "per_device_train_batch_size": 2,
        "save_steps": 10,
        "logging_steps": 5,
        "save_total_limit": 2,
        "pad_to_multiple_of": 8,
        "precompute_ref_batch_size": 4,
        "router_aux_loss_coef": 0.01,
        "loss_type": "sigmoid",
        "rpo_alpha": None,
        "gradient_accumulation_steps": 4,
        "num_train_epochs": 1,
        "max_steps": 20,
        "lr_scheduler_type": "cosine",
        "warmup_steps": 0,
        "warmup_ratio": 0.1,
        "precompute_ref_log_probs": True,
        "padding_free": True,
        "gradient_checkpointing": True,
        "bf16": True,
        "optim": "adamw_torch",
        "disable_dropout": True,
        "pad_token": "<|im_end|>",
        "report_to": ["tensorboard"],
        "use_peft": True,
        "lora_r": 8,
        "lora_alpha": 16,
        "lora_dropout": 0.0,
        "lora_target_modules": ["q_proj", "v_proj"],
        "eval_strategy": "steps",
        "eval_steps": 10,
        "per_device_eval_batch_size": 4,
        "dataset_test_split": "test",
        **UNSUPPORTED,  # at TRL's defaults, the only values accepted
    }
    assert sorted(fields) == sorted(known_fields())
    overrides, _, _ = translate_trl(fields, "cfg.yaml", devices=2)
    keys = [o.partition("=")[0] for o in overrides]
    assert sorted(k for k in set(keys) if keys.count(k) > 1) == []
    assert "train.micro_batch_size=2" in overrides
    assert "train.global_batch_size=16" in overrides  # 2 x 4 x 2 devices


def test_unknown_and_unsupported_fields():
    with pytest.raises(
        ValueError,
        match=r"cfg.yaml: unknown TRL DPOConfig field\(s\) "
        r"\['betta'\]; known: beta, label_smoothing",
    ):
        translate_trl({"betta": 0.1}, "cfg.yaml", 1)
    with pytest.raises(ValueError, match="sync_ref_model=True is not supported"):
        translate_trl({"sync_ref_model": True}, "cfg.yaml", 1)
    assert translate_trl({"sync_ref_model": False}, "cfg.yaml", 1)[0]
    with pytest.raises(ValueError, match="trust_remote_code=True is not supported"):
        translate_trl({"trust_remote_code": True}, "cfg.yaml", 1)
    _, notes, _ = translate_trl({"pad_token": "<|im_end|>"}, "cfg.yaml", 1)
    assert any("pad_token='<|im_end|>': padding is never attended to or scored" in n for n in notes)


def test_a_null_field_and_the_moe_aux_coefficient_load_as_our_keys():
    """A YAML null becomes the config's null (it was the text None, which no key takes), and
    TRL's router_aux_loss_coef (None: the model config's) is model.moe_aux_loss_coeff (the
    same rule)."""
    from dpo_megatron.config import load_config

    overrides, _, _ = translate_trl({"router_aux_loss_coef": None}, "cfg.yaml", 1)
    assert (
        load_config(
            None, [*overrides, "data.path=d.jsonl", "data.tokenizer=t"]
        ).model.moe_aux_loss_coeff
        is None
    )
    overrides, _, _ = translate_trl({"router_aux_loss_coef": 0.02}, "cfg.yaml", 1)
    assert (
        load_config(
            None, [*overrides, "data.path=d.jsonl", "data.tokenizer=t"]
        ).model.moe_aux_loss_coeff
        == 0.02
    )


def test_trl_sigmoid_norm_is_the_length_normalised_loss():
    overrides, _, _ = translate_trl({"loss_type": ["sigmoid_norm"]}, "cfg.yaml", 1)
    assert "loss.name=sigmoid_norm" in overrides


def test_trl_yaml_prints_the_command(tmp_path, capsys):
    tok_dir = tmp_path / "tok"
    tiny_hf_tokenizer().save_pretrained(str(tok_dir))
    data = tmp_path / "pairs.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": "Hello?", "chosen": " yes.", "rejected": " no."}) + "\n"
            for _ in range(10)
        )
    )
    cfg = tmp_path / "dpo.yaml"
    cfg.write_text(
        f"dataset_name: {data}\nbeta: 0.2\nper_device_train_batch_size: 2\n"
        f"gradient_accumulation_steps: 2\nnum_train_epochs: 1\nwarmup_steps: 0.5\n"
        f"output_dir: {tmp_path}/run\n"
    )
    extra = [f"data.tokenizer={tok_dir}", "data.cache_dir=none", "data.verbose=false"]
    t = prepare_trl_command(str(cfg), extra, devices=1)
    # 10 pairs / global batch 4 -> 3 steps; warm-up ratio 0.5 -> 2 steps
    assert t.overrides[-2:] == ["train.lr_warmup_iters=2", "train.train_iters=3"]
    assert t.command()[:4] == [
        "bash",
        "scripts/pretrain_dpo.sh",
        "--config",
        "configs/from_trl_base.yaml",
    ]
    assert t.run_dir == f"{tmp_path}/run"
    assert main(["--dry-run", "--trl", str(cfg), *extra]) == 0
    out = capsys.readouterr().out
    assert "bash scripts/pretrain_dpo.sh --config configs/from_trl_base.yaml" in out
    assert "loss.beta=0.2" in out
    # eval_strategy=epoch: an evaluation after each epoch's last step (3 steps per epoch here)
    cfg.write_text(
        cfg.read_text().replace("num_train_epochs: 1", "num_train_epochs: 2")
        + "eval_strategy: epoch\nmax_steps: 4\n"
    )
    t = prepare_trl_command(str(cfg), extra, devices=1)
    assert t.overrides[-3:] == [
        "train.eval_interval=3",
        "train.lr_warmup_iters=2",
        "train.train_iters=4",
    ]


def test_peft_fields_become_lora():
    """TRL's ModelConfig LoRA fields (``trl dpo --config`` reads them from the same YAML)."""
    fields = {
        "use_peft": True,
        "lora_r": 8,
        "lora_alpha": 16,
        "lora_dropout": 0.1,
        "lora_target_modules": ["q_proj", "v_proj", "o_proj", "down_proj"],
    }
    o, notes, _ = translate_trl(fields, "cfg.yaml", 1)
    assert o[-5:] == [
        "lora.enabled=true",
        "lora.rank=8",
        "lora.alpha=16",
        "lora.dropout=0.1",
        "lora.target_modules=[linear_qkv,linear_proj,linear_fc2]",
    ]
    assert any("linear_qkv fuses q_proj, k_proj, v_proj" in n for n in notes)
    # TRL's defaults: r 16, alpha 32, dropout 0.05, PEFT's Llama targets q_proj and v_proj
    assert translate_trl({"use_peft": True}, "c", 1)[0][-5:] == [
        "lora.enabled=true",
        "lora.rank=16",
        "lora.alpha=32",
        "lora.dropout=0.05",
        "lora.target_modules=[linear_qkv]",
    ]
    assert (
        translate_trl({"use_peft": True, "lora_target_modules": "all-linear"}, "c", 1)[0][-1]
        == "lora.target_modules=[linear_qkv,linear_proj,linear_fc1,linear_fc2]"
    )
    o, notes, _ = translate_trl({"lora_r": 8}, "c", 1)  # without use_peft TRL trains fully
    assert not any(x.startswith("lora.") for x in o) and "use_peft is not true" in notes[-1]
    with pytest.raises(
        ValueError,
        match=r"lora_target_modules \['c_attn'\]: translated are "
        r"all-linear and q_proj",
    ):
        translate_trl({"use_peft": True, "lora_target_modules": ["c_attn"]}, "c", 1)


def test_eval_strategy_evaluates_on_the_test_split_of_dataset_name():
    """``trl dpo``: with eval_strategy steps / epoch the eval set is dataset_name's
    dataset_test_split, evaluated whole every eval_steps (default: logging_steps)."""
    base = {"dataset_name": "trl-lib/ultrafeedback_binarized", "logging_steps": 5}
    o, notes, facts = translate_trl(
        {
            **base,
            "eval_strategy": "steps",
            "eval_steps": 50,
            "per_device_eval_batch_size": 4,
            "dataset_test_split": "validation",
        },
        "cfg.yaml",
        2,
    )
    assert {
        "data.eval_datasets=[trl-lib/ultrafeedback_binarized]",
        "data.eval_split=validation",
        "train.eval_global_batch_size=8",
        "train.eval_iters=0",
        "train.eval_interval=50",
    } <= set(o)
    assert not facts["eval_each_epoch"]
    o, _, _ = translate_trl({**base, "eval_strategy": "steps"}, "cfg.yaml", 1)
    assert {
        "data.eval_split=test",
        "train.eval_global_batch_size=8",
        "train.eval_interval=5",
    } <= set(o)  # the defaults: test, 8, logging_steps
    o, _, facts = translate_trl({**base, "eval_strategy": "epoch"}, "cfg.yaml", 1)
    assert facts["eval_each_epoch"] and not any(x.startswith("train.eval_interval") for x in o)
    o, notes, _ = translate_trl({**base, "eval_steps": 50}, "cfg.yaml", 1)  # strategy 'no'
    assert not any(x.startswith(("data.eval", "train.eval")) for x in o)
    assert "eval_steps ignored: eval_strategy is 'no' (as in TRL)" in notes
    with pytest.raises(ValueError, match="eval_strategy='best'; translated: no, steps, epoch"):
        translate_trl({**base, "eval_strategy": "best"}, "cfg.yaml", 1)
    with pytest.raises(ValueError, match="test split of dataset_name, which is not set"):
        translate_trl({"eval_strategy": "steps"}, "cfg.yaml", 1)


def test_max_length_truncates_as_trl_does():
    """``max_length`` with TRL's default ``keep_start``: each prompt + completion keeps its
    first max_length tokens (TRL's ``DataCollatorForPreference``, called here on the same ids)
    and a pair whose prompt alone fills max_length is dropped, as TRL's DPOTrainer drops it
    before training; no prompt is cut on its own. ``keep_end`` (TRL keeps each sequence's end,
    dropping nothing) cuts long prompts here instead of dropping their pairs."""
    import inspect
    import os

    pytest.importorskip("trl")
    from trl.trainer.dpo_trainer import DataCollatorForPreference, DPOTrainer

    from dpo_megatron.config import load_config
    from dpo_megatron.data.formats import Filtered
    from dpo_megatron.data.lengths import fit_lengths
    from dpo_megatron.frontends.common import ROOT
    from dpo_megatron.frontends.trl import TRL_BASE_CONFIG

    assert 'len(example["prompt_ids"]) < args.max_length' in inspect.getsource(DPOTrainer)
    overrides, notes, _ = translate_trl({"max_length": 8}, "cfg.yaml", 1)
    data = load_config(
        os.path.join(ROOT, TRL_BASE_CONFIG),
        [*overrides, "data.path=unused.jsonl", "data.tokenizer=x"],
    ).data
    assert (data.max_length, data.max_prompt_length, data.truncation_mode) == (8, 0, "keep_start")
    collator = DataCollatorForPreference(pad_token_id=0, max_length=8)
    for n_prompt, n_chosen, n_rejected in [(3, 2, 4), (5, 6, 1), (7, 3, 3), (8, 1, 2), (12, 2, 2)]:
        prompt = list(range(100, 100 + n_prompt))
        chosen, rejected = list(range(200, 200 + n_chosen)), list(range(300, 300 + n_rejected))
        if n_prompt >= 8:  # TRL's DPOTrainer filters the pair out
            with pytest.raises(Filtered, match="prompt_too_long"):
                fit_lengths(prompt, chosen, rejected, data)
            continue
        p, c, r = fit_lengths(prompt, chosen, rejected, data)
        batch = collator([{"prompt_ids": prompt, "chosen_ids": chosen, "rejected_ids": rejected}])
        for row, completion in ((0, c), (1, r)):
            length = int(batch["attention_mask"][row].sum())
            assert batch["input_ids"][row][:length].tolist() == p + completion
            assert batch["completion_mask"][row][:length].tolist() == [0] * len(p) + [1] * len(
                completion
            )

    overrides, notes, _ = translate_trl(
        {"max_length": 320, "truncation_mode": "keep_end"}, "cfg.yaml", 1
    )
    assert (
        "data.max_prompt_length=160" in overrides and "data.truncation_mode=keep_end" in overrides
    )
    assert any(
        n.startswith("truncation_mode=keep_end: TRL keeps each sequence's last 320") for n in notes
    )


def test_every_field_of_the_installed_dpoconfig_is_known():
    """Each field DPOConfig adds to transformers' TrainingArguments is translated, or accepted at
    TRL's default: a TRL user's YAML never stops on 'unknown field' for a real DPOConfig field
    (five were, pad_token and trust_remote_code among them)."""
    import dataclasses

    trl = pytest.importorskip("trl")
    from transformers import TrainingArguments

    own = {f.name for f in dataclasses.fields(trl.DPOConfig)}
    own -= {f.name for f in dataclasses.fields(TrainingArguments)}
    assert sorted(own - set(known_fields())) == []
