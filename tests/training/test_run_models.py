"""The start-up line's account of the policy's weights (``run_models.weights_source``): a fresh
start names the model section's source, a resume the checkpoint it loaded."""

from __future__ import annotations

from dpo_megatron.models.config import ModelConfig
from dpo_megatron.training.run_models import weights_source


def test_weights_source_names_the_resumed_checkpoint():
    """A resume's weights are the checkpoint's, whatever the model section starts from (not
    ``random initialisation``); with LoRA the checkpoint holds the adapters and the base is
    still the model section's; without a resume the start is the model section's source."""
    random_start = ModelConfig()
    hf_start = ModelConfig(hf_path="/models/sft")
    ckpt = "runs/dpo/checkpoints/iter_0000004"
    assert weights_source(random_start, seed=7) == "random initialisation (seed 7)"
    assert weights_source(hf_start, seed=7) == "Hugging Face folder /models/sft"
    assert weights_source(random_start, seed=7, resumed_from=ckpt) == (
        "the resumed checkpoint runs/dpo/checkpoints/iter_0000004"
    )
    assert weights_source(hf_start, seed=7, resumed_from=ckpt) == (
        "the resumed checkpoint runs/dpo/checkpoints/iter_0000004"
    )
    assert weights_source(hf_start, seed=7, resumed_from=ckpt, lora=True) == (
        "LoRA adapters of the resumed checkpoint runs/dpo/checkpoints/iter_0000004 on the base "
        "Hugging Face folder /models/sft"
    )
    assert weights_source(hf_start, seed=7, resumed_from=None, lora=True) == (
        "Hugging Face folder /models/sft"
    )
