"""Real weights and real data: SmolLM2-135M-Instruct on dpo_en_demo pairs at TP 2 x PP 2.

Checks the whole engine path against Hugging Face ``transformers`` on the same token ids, and that
a few DPO steps move the policy the right way.
"""

import pytest
import torch

from tests.multirank import run_ranks

pytestmark = pytest.mark.slow
NUM_PAIRS = 2


def _real_pairs():
    from tests.scripts import load_script

    assets = load_script("assets")  # builds a missing asset
    from dpo_megatron.data import DataConfig, load_preference_pairs, load_tokenizer

    tokenizer = load_tokenizer(str(assets.ensure_smollm2()))
    cfg = DataConfig(
        path=str(assets.ensure_dpo_en_demo()),
        format="sharegpt",
        max_length=128,
        max_prompt_length=64,
    )
    return tokenizer, load_preference_pairs(cfg, tokenizer).train[:NUM_PAIRS]


def _engine(hf_path, pairs, pad_id, steps, export_dir):
    from dpo_megatron.models.conversion import export_hf
    from tests.engine import step_record, tiny_trainer

    # The real trainer at TP 2 x PP 2 on the real weights; global batch = both pairs, so every
    # step sees the same batch (one pair per micro-batch) and its margin must grow.
    trainer = tiny_trainer(
        pairs,
        pad_token_id=pad_id,
        tp=2,
        pp=2,
        seed=0,
        lr=1e-5,
        steps=steps,
        micro_batch_size=1,
        global_batch_size=len(pairs),
        model={"hf_path": hf_path, "pad_attention_heads": True},
    )
    history = [step_record(*trainer.train_step()) for _ in range(steps)]
    policy, model_cfg = trainer.policy, trainer.model_config
    export_hf(
        [c.module for c in policy], model_cfg, export_dir, dtype="bfloat16", tokenizer_dir=hf_path
    )
    return history


def _hf_logps(hf_path, pairs, pad_id):
    from transformers import AutoModelForCausalLM

    from dpo_megatron.data import collate_pairs

    model = AutoModelForCausalLM.from_pretrained(hf_path, dtype=torch.float32).eval()
    longest = max(len(p.prompt_ids) + max(len(p.chosen_ids), len(p.rejected_ids)) for p in pairs)
    batch, targets = collate_pairs(pairs, pad_id, longest)
    with torch.no_grad():
        logits = model(batch.tokens).logits
    labels = torch.nn.functional.pad(batch.tokens[:, 1:], (0, 1), value=pad_id)  # next tokens
    token_logps = torch.log_softmax(logits.float(), -1).gather(-1, labels[..., None]).squeeze(-1)
    return (token_logps * targets.loss_mask).sum(-1).double()


def test_tp2_pp2_matches_transformers_and_training_raises_margins(tmp_path):
    from tests.scripts import load_script

    assets = load_script("assets")  # builds a missing asset

    hf_path = str(assets.ensure_smollm2())
    tokenizer, pairs = _real_pairs()
    assert len(pairs) == NUM_PAIRS
    pad_id = tokenizer.pad_token_id
    export_dir = str(tmp_path / "hf")
    results = run_ranks(
        _engine,
        world_size=4,
        hf_path=hf_path,
        pairs=pairs,
        pad_id=pad_id,
        steps=3,
        export_dir=export_dir,
    )
    history = next(r for r in results if r[0]["per_item"])
    step0 = history[0]
    engine = torch.tensor(
        step0["per_item"]["logps/chosen"] + step0["per_item"]["logps/rejected"], dtype=torch.float64
    )
    expected = _hf_logps(hf_path, pairs, pad_id)
    # Sums of ~100 real completion tokens (nats): relative error < 1e-4.
    torch.testing.assert_close(engine, expected, rtol=1e-4, atol=0)
    assert abs(step0["metrics"]["loss"] - 0.6931471805599453) < 1e-5
    margins = [h["metrics"]["rewards/margins"] for h in history]
    assert margins[0] == 0.0
    assert all(b > a for a, b in zip(margins, margins[1:])), margins
    assert history[-1]["metrics"]["loss"] < 0.6931471805599453
    _check_export_generates(export_dir, hf_path)


def _check_export_generates(export_dir, hf_path):
    """The trained policy, exported at TP 2 x PP 2 (zero heads dropped), loads in transformers
    with no missing or unexpected keys, differs from the start, and still answers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, info = AutoModelForCausalLM.from_pretrained(export_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.config.num_key_value_heads == 3  # padding removed
    original = AutoModelForCausalLM.from_pretrained(hf_path)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(
        model.state_dict()[name].float(), original.state_dict()[name].bfloat16().float()
    )
    tokenizer = AutoTokenizer.from_pretrained(export_dir)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=10, do_sample=False)
    text = tokenizer.decode(out[0, ids.shape[1] :])
    assert "Paris" in text, text
