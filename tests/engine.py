"""Build the real engine (``Trainer``) on a tiny model and hand-made token ids, in a few lines.

Tests that compare layouts, losses or batch forms call this inside ``run_ranks`` ranks::

    trainer = tiny_trainer(pairs, tp=2, pp=2, micro_batch_size=2, global_batch_size=8)
    out, _ = trainer.train_step()

Everything runs through the same ``Trainer`` as ``python -m dpo_megatron.train``: device,
batch builder, reference source, optimizer, checkpointer. Only the data is given directly
(``RunData``) instead of being read from a file with a tokenizer.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from typing import Any

VOCAB = 256

TINY = dict(
    num_layers=4,
    hidden_size=64,
    ffn_hidden_size=128,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=VOCAB,
    tie_word_embeddings=False,
)
"""The tiny model of the engine tests (4 layers: PP 2 gives 2 layers per stage)."""

SHALLOW = dict(num_layers=2, tie_word_embeddings=True)
"""Changes to :data:`TINY` for the batch-form tests (packing, shared prompt): 2 tied layers."""


def model_overrides(model: dict) -> list[str]:
    """``model`` (a dict of ``model.*`` fields) as command-line overrides ``model.key=value``,
    booleans spelled as YAML reads them (``true`` / ``false``)."""
    return [f"model.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in model.items()]


def engine_config(
    *,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    vpp: int | None = None,
    sp: bool = False,
    ep: int = 1,
    etp: int | None = None,
    micro_batch_size: int = 1,
    global_batch_size: int = 4,
    steps: int = 2,
    lr: float = 1e-3,
    loss: dict | None = None,
    model: dict | None = None,
    load: str = "",
    packing: bool = False,
    bucket_by_length: bool = False,
    share_prompt: bool = False,
    packing_row_length: int = 0,
    reference_mode: str = "model",
    offload: bool = False,
    cache_dir: str = "",
    run_dir: str | None = None,
    seed: int = 1234,
    resume: str = "none",
    save_interval: int = 0,
    keep_last_n: int = 0,
    **train: Any,
):
    """A ``DPOConfig`` for a tiny random (or ``load``-ed) model; ``train`` adds ``train.*``.
    ``ep`` / ``etp``: expert-parallel and expert tensor-parallel sizes (MoE models)."""
    from dpo_megatron.config import config_from_mapping

    return config_from_mapping(
        {
            "run_dir": run_dir or tempfile.mkdtemp(prefix="dpo-engine-"),
            "parallel": {
                "tensor_model_parallel_size": tp,
                "pipeline_model_parallel_size": pp,
                "context_parallel_size": cp,
                "virtual_pipeline_model_parallel_size": vpp,
                "sequence_parallel": sp,
                "expert_model_parallel_size": ep,
                "expert_tensor_parallel_size": etp,
            },
            "model": {**TINY, **(model or {}), "load": load},
            "loss": loss or {"name": "sigmoid", "beta": 0.1},
            "train": {
                "micro_batch_size": micro_batch_size,
                "global_batch_size": global_batch_size,
                "train_iters": steps,
                "lr": lr,
                "lr_decay_style": "constant",
                "seed": seed,
                **train,
            },
            "packing": {
                "enabled": packing,
                "bucket_by_length": bucket_by_length,
                "share_prompt": share_prompt,
                "row_length": packing_row_length,
            },
            "reference": {"mode": reference_mode, "offload": offload, "cache_dir": cache_dir},
            "checkpoint": {
                "resume": resume,
                "save_interval": save_interval,
                "keep_last_n": keep_last_n,
            },
            "logging": {"tensorboard": False},
        },
        check=False,
    )


def tiny_trainer(pairs: Sequence, eval_pairs: Sequence = (), pad_token_id: int = 0, **config):
    """A ``Trainer`` over ``pairs`` (train) and ``eval_pairs``; ``config`` as
    :func:`engine_config`, given frozen (the run never writes into the config it is given).
    Collective: call it on every rank."""
    from dpo_megatron.training.run_data import RunData
    from dpo_megatron.training.trainer import Trainer
    from dpo_megatron.utils.frozen import freeze

    cfg = freeze(engine_config(**config))
    return Trainer(cfg, data=RunData(list(pairs), list(eval_pairs), pad_token_id))


def save_initial_checkpoint(ckpt_dir: str, seed: int = 3) -> None:
    """Write a distributed checkpoint of the :data:`TINY` model at TP 1 x PP 1 (random init from
    ``seed``): layout tests load it at each layout (megatron-core reshards), so every layout
    starts from the same weights. Collective: call it inside ``run_ranks`` on one rank."""
    from dpo_megatron.checkpointing import save_model_checkpoint
    from dpo_megatron.models import ModelConfig, build_model_chunks
    from dpo_megatron.parallel import ParallelConfig, initialize_distributed, set_seed

    parallel = ParallelConfig()
    initialize_distributed(parallel)
    set_seed(seed)
    save_model_checkpoint(build_model_chunks(ModelConfig(**TINY), parallel), ckpt_dir)


def random_pairs(n: int, seed: int, lengths, vocab: int = VOCAB, eos: int = 2):
    """``n`` pairs of random ids; ``lengths(i)`` gives (prompt, chosen, rejected) lengths of pair
    i before the EOS appended to each completion."""
    import torch

    from dpo_megatron.data import PreferencePair

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p, c, r = (tuple(torch.randint(3, vocab, (k,), generator=g).tolist()) for k in lengths(i))
        out.append(PreferencePair(prompt_ids=p, chosen_ids=c + (eos,), rejected_ids=r + (eos,)))
    return out


def short_lengths(i: int) -> tuple[int, int, int]:
    """(prompt, chosen, rejected) lengths of pair ``i``: 3-6, 2-4, 3-5 tokens."""
    return 3 + i % 4, 2 + i % 3, 5 - i % 3


def varied_lengths(i: int) -> tuple[int, int, int]:
    """Lengths that vary widely, as in real preference data (packing, shared prompts)."""
    return 2 + (7 * i) % 11, 1 + (5 * i) % 9, 3 + (3 * i) % 13


def long_lengths(i: int) -> tuple[int, int, int]:
    """Lengths that grow with ``i`` (5, 8, 11, ... prompt tokens): long enough for every
    context-parallel split of a few pairs."""
    return 5 + 3 * i, 4 + i, 7 - i


def tiny_pairs(n: int = 8, seed: int = 7, lengths=short_lengths, vocab: int = VOCAB):
    """The engine tests' pairs: ``n`` random pairs (:func:`random_pairs`) of ``lengths``
    (default :func:`short_lengths`); ids below ``vocab``."""
    return random_pairs(n, seed, lengths, vocab=vocab)


def step_record(out, batch, policy_equals_reference=None) -> dict:
    """Plain values of one step (for comparisons across processes); ``policy_equals_reference``
    as :func:`train_step_against_reference` gives it."""
    return {
        "policy_equals_reference": policy_equals_reference,
        "metrics": out.metrics,
        "grad_norm": out.grad_norm,
        "per_item": {k: v.tolist() for k, v in out.per_item.items()},
        "shape": list(batch.micro_batches[0].tokens.shape),
    }


class _ComparingLoss:
    """The trainer's loss function, also noting per micro-batch whether the policy's per-token
    log-probs equal the reference's bit for bit on the scored tokens."""

    def __init__(self, loss_fn):
        self.loss_fn = loss_fn
        self.equal: list[bool] = []

    def __getattr__(self, name):
        return getattr(self.loss_fn, name)

    def __call__(self, scores):
        import torch

        scored = scores.targets.loss_mask.bool()
        self.equal.append(torch.equal(scores.policy.detach()[scored], scores.reference[scored]))
        return self.loss_fn(scores)


def train_step_against_reference(trainer):
    """``trainer.train_step()``, and whether the policy's per-token log-probs of every scored
    token of the step were bit-identical (``torch.equal``) to the reference's (model mode) or to
    the precomputed values the pairs carry: at step 0 they must be, whatever the layout. Collective.

    Returns:
        (the step's output, its batch, True / False on the last pipeline stage, None elsewhere).
    """
    comparing = _ComparingLoss(trainer.loss_fn)
    trainer.loss_fn = comparing
    try:
        out, batch = trainer.train_step()
    finally:
        trainer.loss_fn = comparing.loss_fn
    return out, batch, all(comparing.equal) if comparing.equal else None


def assert_step_zero_is_exact(record: dict) -> None:
    """Step 0 of a run whose reference is the policy's starting weights (a :func:`step_record`
    with ``policy_equals_reference``, from a last-stage rank): the policy's per-token log-probs
    equal the reference's bit for bit, so every reward and margin is exactly 0 and
    ``rewards/accuracies`` is 0.0 (a tie is not a win: chosen > rejected strictly, as in TRL)."""
    assert record["policy_equals_reference"] is True
    metrics = record["metrics"]
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert metrics[key] == 0.0, (key, metrics[key])


def owns_results() -> bool:
    """True on the ranks that report per-pair values: last pipeline stage, TP rank 0."""
    from megatron.core import parallel_state as ps

    return ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
