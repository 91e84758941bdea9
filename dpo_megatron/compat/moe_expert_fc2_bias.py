"""megatron-core's expert fc2 bias (experts with biases: gpt-oss), two faults of 0.16.

* **In place on a Function's output.** ``MLP.forward`` adds the routing-weighted bias in place:
  ``output += output_bias * per_token_scale`` on what ``linear_fc2`` returned. Without expert or
  expert-tensor parallelism (EP 1 and expert TP 1) that ``RowParallelLinear`` reduces over a
  group of one, whose autograd Function returns its input as it is; modifying it in place is
  forbidden while gradients are recorded (``RuntimeError: Output 0 of
  _ReduceFromModelParallelRegion is a view and is being modified inplace``): the first training
  forward fails. Patched: such an expert layer returns a copy of its output when it hands its
  bias to the caller (one [tokens, hidden] copy per expert; values unchanged).
* **Marked sequence-parallel.** ``RowParallelLinear.__init__`` marks its bias
  ``sequence_parallel`` under sequence parallelism, experts included, and
  ``finalize_model_grads`` then sums the marked gradients over the tensor-parallel group. Expert
  parameters are reduced over the expert data-parallel group instead (the expert weights are
  never marked); with EP over the TP ranks the TP peers hold other experts, whose bias
  gradients the sum mixes in: wrong updates at TP 2 x EP 2 (the log-probs stay right). Patched:
  an expert's bias is not marked, its gradient reduced as its weights'.
* **Counted as a TP duplicate.** The gradient norm counts a parameter without
  ``tensor_model_parallel`` on TP rank 0 only; with EP over the TP ranks the other ranks'
  experts' biases are left out (a norm 0.5% low for the tiny gpt-oss at TP 2 x EP 2, and a
  clipping threshold met at another step than on one rank). Patched: at expert TP 1 an expert's
  bias is marked tensor-parallel (one copy per expert), as its weights are.

Switched on by ``dpo_megatron.models.gpt.build_model_chunks`` when it builds a
mixture-of-experts model with linear biases (``model.add_bias_linear``).
"""

from __future__ import annotations

import functools

from dpo_megatron.compat.registry import Patch, register

PATCH = register(
    Patch(
        name="moe_expert_fc2_bias",
        why="megatron-core 0.16 adds an expert's fc2 bias in place to a reduce's output (an "
        "autograd error at EP 1) and marks it sequence-parallel (its gradient summed over TP "
        "ranks holding other experts)",
        versions={"megatron-core": "==0.16.*"},
        switched_on="when a mixture-of-experts model with linear biases is built",
    )
)

__all__ = ["PATCH", "enable"]


def enable() -> bool:
    """Wrap ``RowParallelLinear.__init__`` and ``forward`` (idempotent); True when the patch
    applies. Layers built before it keep megatron-core's behaviour."""
    if not PATCH.applies_to_installed():
        return False
    from megatron.core.tensor_parallel.layers import (
        RowParallelLinear,
        set_tensor_model_parallel_attributes,
    )

    if getattr(RowParallelLinear.forward, "_expert_fc2_bias", False):
        return True
    init, forward = RowParallelLinear.__init__, RowParallelLinear.forward

    @functools.wraps(init)
    def patched_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if self.is_expert and self.bias is not None:
            self.bias.sequence_parallel = False
            if self.tp_group.size() == 1:  # one copy per expert: not a TP duplicate
                set_tensor_model_parallel_attributes(self.bias, True, 0, 1)

    @functools.wraps(forward)
    def patched_forward(self, *args, **kwargs):
        output, bias = forward(self, *args, **kwargs)
        if self.is_expert and bias is not None and not self.explicit_expert_comm:
            output = output.clone()  # the caller adds the bias in place
        return output, bias

    patched_forward._expert_fc2_bias = True
    RowParallelLinear.__init__, RowParallelLinear.forward = patched_init, patched_forward
    return True
