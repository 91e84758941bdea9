"""The DPO step at every parallel layout: ln 2 at step 0 and identical numbers everywhere.

Weights come from one distributed checkpoint written at TP 1 x PP 1 and loaded at each layout
(megatron-core reshards), so every layout starts from the same model. The interleaved (virtual)
pipeline at PP 2 is included: it is where gloo's in-order p2p matching once silently swapped
activations and gradients.
"""

import math

import pytest
import torch

from dpo_megatron.data import PreferencePair
from tests.multirank import run_ranks

pytestmark = pytest.mark.slow

LAYOUTS = [  # (TP, PP, DP, sequence_parallel, virtual pipeline stages)
    (1, 1, 1, False, None),
    (2, 1, 1, True, None),
    (1, 2, 1, False, None),
    (1, 2, 1, False, 2),
    (1, 1, 2, False, None),
    (2, 2, 1, False, None),
    (2, 2, 2, True, None),
]
GLOBAL_PAIRS = 8
VOCAB = 256


def _pairs() -> list[PreferencePair]:
    g = torch.Generator().manual_seed(7)
    out = []
    for i in range(GLOBAL_PAIRS):
        lengths = (3 + i % 4, 2 + i % 3, 5 - i % 3)
        p, c, r = (tuple(torch.randint(3, VOCAB, (n,), generator=g).tolist()) for n in lengths)
        out.append(PreferencePair(prompt_ids=p, chosen_ids=c + (2,), rejected_ids=r + (2,)))
    return out


def _model_config():
    from dpo_megatron.models import ModelConfig

    return ModelConfig(num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                       num_query_groups=2, vocab_size=VOCAB, tie_word_embeddings=False)


def _save_initial(ckpt_dir):
    from dpo_megatron.checkpointing import save_model_checkpoint
    from dpo_megatron.models import build_model_chunks
    from dpo_megatron.parallel import ParallelConfig, initialize_distributed, set_seed

    parallel = ParallelConfig()
    initialize_distributed(parallel)
    set_seed(3)
    save_model_checkpoint(build_model_chunks(_model_config(), parallel), ckpt_dir)


def _run_layout(ckpt_dir, tp, pp, sp, micro_batch_size, vpp=None, steps=2, loss=None):
    from megatron.core import parallel_state as ps

    from dpo_megatron.checkpointing import load_model_checkpoint

    from dpo_megatron.losses import build_loss
    from dpo_megatron.models import build_model_chunks
    from dpo_megatron.parallel import ParallelConfig, initialize_distributed, set_seed
    from dpo_megatron.training.batches import build_micro_batches
    from dpo_megatron.training.config import TrainConfig
    from dpo_megatron.training.optim import build_optimizer, copy_weights, freeze, wrap_ddp
    from dpo_megatron.training.step import train_step

    parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                              sequence_parallel=sp, virtual_pipeline_model_parallel_size=vpp)
    initialize_distributed(parallel)
    set_seed(11)
    policy = build_model_chunks(_model_config(), parallel)
    load_model_checkpoint(policy, ckpt_dir)
    reference = freeze(build_model_chunks(_model_config(), parallel))
    copy_weights(policy, reference)
    policy = wrap_ddp(policy, use_distributed_optimizer=True)
    optimizer, scheduler = build_optimizer(policy, TrainConfig(lr=1e-3, train_iters=steps,
                                                               lr_decay_style="constant"))
    loss_fn = build_loss(loss or {"name": "sigmoid", "beta": 0.1})
    pairs = _pairs()
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    per_rank = GLOBAL_PAIRS // dp
    mine = list(range(dp_rank * per_rank, (dp_rank + 1) * per_rank))
    indices = [mine[i:i + micro_batch_size] for i in range(0, per_rank, micro_batch_size)]
    history = []
    for _ in range(steps):
        mbs, seq_length, _ = build_micro_batches(pairs, indices, 0, 8 * tp)
        out = train_step(policy, reference, optimizer, scheduler, mbs, seq_length, loss_fn)
        history.append({"metrics": out.metrics, "grad_norm": out.grad_norm,
                        "per_pair": {k: v.tolist() for k, v in out.per_pair.items()}})
    owner = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
    return {"dp_rank": dp_rank, "owner": owner, "history": history}


def _per_pair(results, step, key):
    """Stitch the per-pair values of every DP rank back into global pair order."""
    owners = sorted((r for r in results if r["owner"]), key=lambda r: r["dp_rank"])
    return [v for r in owners for v in r["history"][step]["per_pair"][key]]


@pytest.fixture(scope="module")
def initial_checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("init") / "ckpt")
    run_ranks(_save_initial, world_size=1, ckpt_dir=path)
    return path


@pytest.fixture(scope="module")
def baseline(initial_checkpoint):
    return run_ranks(_run_layout, world_size=1, ckpt_dir=initial_checkpoint, tp=1, pp=1,
                     sp=False, micro_batch_size=2)


def _rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.mark.parametrize("tp, pp, dp, sp, vpp", LAYOUTS)
def test_layout_matches_single_rank(initial_checkpoint, baseline, tp, pp, dp, sp, vpp):
    results = run_ranks(_run_layout, world_size=tp * pp * dp, ckpt_dir=initial_checkpoint,
                        tp=tp, pp=pp, sp=sp, vpp=vpp, micro_batch_size=2)
    step0 = results[0]["history"][0]["metrics"]
    # Step 0, policy == reference: loss exactly ln 2, zero rewards, zero (strict) accuracy.
    assert abs(step0["loss"] - math.log(2)) < 1e-5
    assert step0["rewards/chosen"] == 0 and step0["rewards/rejected"] == 0
    assert step0["rewards/margins"] == 0 and step0["rewards/accuracies"] == 0
    for step in range(2):  # step 1 runs after one distributed-optimizer update
        got, want = results[0]["history"][step], baseline[0]["history"][step]
        for key in ("loss", "rewards/margins", "logps/chosen", "logps/rejected"):
            assert _rel(got["metrics"][key], want["metrics"][key]) < 1e-5, (step, key)
        assert _rel(got["grad_norm"], want["grad_norm"]) < 1e-5
        for key in ("logps/chosen", "logps/rejected"):
            for a, b in zip(_per_pair(results, step, key), _per_pair(baseline, step, key),
                            strict=True):
                assert _rel(a, b) < 1e-5
    # Every rank reports the same metrics (shared from the last stage, reduced over DP).
    assert all(r["history"][1]["metrics"] == results[0]["history"][1]["metrics"]
               for r in results)


@pytest.mark.parametrize("micro_batch_size", [1, 4, 8])
def test_micro_batch_size_and_accumulation_do_not_change_loss_or_gradient(
        initial_checkpoint, baseline, micro_batch_size):
    results = run_ranks(_run_layout, world_size=1, ckpt_dir=initial_checkpoint, tp=1, pp=1,
                        sp=False, micro_batch_size=micro_batch_size)
    for step in range(2):
        got, want = results[0]["history"][step], baseline[0]["history"][step]
        assert _rel(got["metrics"]["loss"], want["metrics"]["loss"]) < 1e-5
        assert _rel(got["grad_norm"], want["grad_norm"]) < 1e-5


def test_loss_is_the_mean_over_global_pairs(baseline):
    """The reported loss equals the mean of the per-pair losses (hand reduction)."""
    step1 = baseline[0]["history"][1]
    per_pair = step1["per_pair"]["loss"]
    assert len(per_pair) == GLOBAL_PAIRS
    assert _rel(step1["metrics"]["loss"], sum(per_pair) / GLOBAL_PAIRS) < 1e-6
    margins = [c - r for c, r in zip(step1["per_pair"]["rewards/chosen"],
                                     step1["per_pair"]["rewards/rejected"])]
    for m, loss in zip(margins, per_pair):  # sigmoid DPO: -log sigmoid(margin)
        assert abs(loss - math.log1p(math.exp(-m))) < 1e-5
