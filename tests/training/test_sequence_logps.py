"""Sequence log-probs count exactly the completion tokens, whatever the padding and batching.

For prompt [p1, p2, p3] and completion [r1, r2, EOS] the engine's sequence log-prob must be
log p(r1 | p) + log p(r2 | p, r1) + log p(EOS | p, r1, r2), computed here by hand from the
model's full-vocabulary logits of the unpadded sequence.
"""

import pytest
import torch

from dpo_megatron.data import PreferencePair
from tests.engine import save_initial_checkpoint, tiny_trainer
from tests.multirank import run_ranks

pytestmark = pytest.mark.slow
EOS = 2
PAIR = PreferencePair(
    prompt_ids=(11, 12, 13), chosen_ids=(21, 22, EOS), rejected_ids=(31, 32, 33, 34, EOS)
)
LONG = PreferencePair(
    prompt_ids=tuple(range(40, 60)),
    chosen_ids=(5, 6, EOS),
    rejected_ids=tuple(range(70, 95)) + (EOS,),
)


def _run(ckpt_dir):
    from dpo_megatron.data.collate import PaddedPairs
    from dpo_megatron.training.step import step_forward_backward

    # simpo is reference-free: only the policy's log-probs, as the real trainer builds them.
    trainer = tiny_trainer(
        [PAIR], load=ckpt_dir, loss={"name": "simpo"}, seed=0, global_batch_size=1
    )
    model = trainer.policy

    def logps(pairs, indices, multiple):
        batch = PaddedPairs(0, multiple).build(pairs, indices).to_device()
        out = step_forward_backward(model, None, batch, trainer.loss_fn, forward_only=True)
        return out.per_item["logps/chosen"].tolist(), out.per_item["logps/rejected"].tolist()

    alone = logps([PAIR], [[0]], 8)
    batched = logps([LONG, PAIR, LONG], [[0, 1], [2]], 64)  # more padding, other neighbours
    with torch.no_grad():  # by hand: full logits of each unpadded sequence
        hand = []
        for completion in (PAIR.chosen_ids, PAIR.rejected_ids):
            tokens = torch.tensor([PAIR.prompt_ids + completion])
            logits = model[0](tokens, torch.arange(tokens.shape[1])[None], attention_mask=None)
            log_probs = torch.log_softmax(logits[0].double(), -1)
            p = len(PAIR.prompt_ids)
            hand.append(
                sum(float(log_probs[p - 1 + i, token]) for i, token in enumerate(completion))
            )
    return alone, batched, hand


def test_completion_tokens_only_by_hand_and_independent_of_batching(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run_ranks(save_initial_checkpoint, world_size=1, ckpt_dir=ckpt)
    alone, batched, hand = run_ranks(_run, world_size=1, ckpt_dir=ckpt)[0]
    (chosen,), (rejected,) = alone
    assert chosen == pytest.approx(hand[0], rel=1e-6)  # r1 + r2 + EOS, given the prompt
    assert rejected == pytest.approx(hand[1], rel=1e-6)  # the same rule for rejected
    # Pair 1 of the batched call is the same pair, padded to 64 beside long pairs.
    assert batched[0][1] == pytest.approx(chosen, rel=1e-6)
    assert batched[1][1] == pytest.approx(rejected, rel=1e-6)
