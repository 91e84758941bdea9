"""Every workaround of torch or megatron-core, in one package (torchtitan's ``overrides/``).

Nothing outside this package patches torch or megatron-core or reaches into their private
names. Each module here holds one patch, declares it (:class:`~dpo_megatron.compat.registry.Patch`:
why, the versions it was written for, when it is switched on), checks those versions against the
installed ones when it is imported, and has a test of its own under ``tests/compat/``:

* :mod:`~dpo_megatron.compat.cuda_on_cpu`: megatron-core's CUDA calls land on the CPU (switched on
  by the device owner when the engine's device is the CPU, i.e. the gloo backend).
* :mod:`~dpo_megatron.compat.torch_adam_resume`: loading distributed-optimizer state into
  torch's Adam (megatron-core 0.16 without apex / transformer-engine).
* :mod:`~dpo_megatron.compat.dist_ckpt_queue`: synchronous ``torch_dist`` saves without a
  spawned ``multiprocessing`` Manager (megatron-core 0.16).
* :mod:`~dpo_megatron.compat.dist_ckpt_writer_orphans`: the writer processes a ``torch_dist``
  save forks die with their rank (megatron-core 0.16).
* :mod:`~dpo_megatron.compat.eager_fusions`: megatron-core's fused SwiGLU runs eagerly on the
  CPU (its ``torch.compile`` compiles C++ for every shape there).
* :mod:`~dpo_megatron.compat.frozen_linear_fold`: a frozen linear (the reference's) runs the
  trainable one's matrix product (torch.matmul picks its kernel by ``requires_grad``), so step-0
  policy and reference log-probs are bit-identical.
* :mod:`~dpo_megatron.compat.rope_tables_once`: megatron-core's unfused RoPE makes the table's
  cos / sin once per forward (not for the queries and keys of every layer, each kept for
  backward) and skips copying into an empty concatenation.
* :mod:`~dpo_megatron.compat.expected_warnings`: silence the warnings every run prints.
* :mod:`~dpo_megatron.compat.moe_router_without_te`: megatron-core 0.16's MoE router gating
  without transformer-engine (an undefined name).
* :mod:`~dpo_megatron.compat.checkpoint_without_output_without_te`: megatron-core 0.16's
  output-discarding checkpoint (selective recompute of the norms) without transformer-engine
  (an undefined name).
* :mod:`~dpo_megatron.compat.mla_without_te`: megatron-core 0.16's multi-latent attention
  without transformer-engine (an isinstance() check against a mock class).
* :mod:`~dpo_megatron.compat.mla_rope_key_grad`: megatron-core 0.16's multi-latent attention at
  TP > 1 on the local spec: the shared RoPE key's gradient summed over the TP ranks (one rank's
  share was kept).
* :mod:`~dpo_megatron.compat.moe_expert_bias_padding_mask`: megatron-core 0.16's expert-bias
  token count with a padding mask (a broadcast error).
* :mod:`~dpo_megatron.compat.moe_expert_fc2_bias`: megatron-core 0.16's expert fc2 bias
  (gpt-oss): added in place at expert parallel 1 (an autograd error while training) and marked
  sequence-parallel (its gradient summed over TP ranks holding other experts).
* :mod:`~dpo_megatron.compat.moe_alltoall_on_cpu`: the all-to-all MoE token dispatcher on the CPU
  (host stand-ins for its side CUDA stream, host split sizes, uneven collectives on gloo).
* :mod:`~dpo_megatron.compat.torchrun_failure_logs`: hold back torch elastic's log lines about a
  failed worker until the launcher (:mod:`dpo_megatron.cli.launch`) knows whether it was a crash.
* :mod:`~dpo_megatron.compat.model_parallel_teardown`: megatron-core 0.16's model-parallel
  groups destroyed for real when a run switches layouts in one process (online DPO's phases).
* :mod:`~dpo_megatron.compat.gloo_shared_device`: one gloo device (one event-loop thread, waking
  every 10 ms) per process instead of one per process group.
* :mod:`~dpo_megatron.compat.torchrun_repeated_signal`: torch elastic's agent keeps waiting for
  its workers to save when SLURM repeats a job's SIGTERM, and a second Ctrl-C stops them at once.
* :mod:`~dpo_megatron.compat.tensorboard_writer_thread`: tensorboard's event-writer thread leaves
  a failed write (full or read-only disk) to the writer's caller instead of printing a traceback.
* :mod:`~dpo_megatron.compat.onednn_inference_linear`: megatron-core's linears multiply with
  weights packed once for oneDNN during generation on the CPU (MKL's sgemm packs every weight
  at every product: a decode step of a few rows paid that twice over).

Applying a patch is always its caller's explicit decision, never an import side effect. This
``__init__`` imports nothing heavy, so config-only entry points stay fast.
"""

from dpo_megatron.compat.registry import Patch, check_installed, installed_version, patches


def before_megatron_import() -> None:
    """What every entry point does before megatron-core is imported (idempotent, light): the
    expected warnings filtered (:mod:`~dpo_megatron.compat.expected_warnings`), and on a machine
    without CUDA no ``torch.compile`` wrapping of megatron-core's fusions
    (:func:`~dpo_megatron.compat.eager_fusions.compile_only_on_cuda`)."""
    from dpo_megatron.compat.eager_fusions import compile_only_on_cuda
    from dpo_megatron.compat.expected_warnings import filter_expected_warnings

    filter_expected_warnings()
    compile_only_on_cuda()


__all__ = ["Patch", "before_megatron_import", "check_installed", "installed_version", "patches"]
