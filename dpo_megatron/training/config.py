"""Optimisation and schedule settings of a training run."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainConfig:
    """Batching, optimizer and LR schedule. Batch sizes count preference *pairs*."""

    micro_batch_size: int = 1
    """Pairs per micro-batch per data-parallel rank (the schedule sees 2x sequences)."""
    global_batch_size: int = 4
    """Pairs per optimizer step over all data-parallel ranks; gradient accumulation steps =
    global_batch_size / (micro_batch_size x data-parallel size)."""
    train_iters: int = 10
    """Optimizer steps."""
    lr: float = 1e-6
    """Peak learning rate (DPO papers use 5e-7 to 1e-6 for 7B models)."""
    min_lr: float = 0.0
    """Floor of the decay."""
    lr_warmup_iters: int = 0
    """Linear warm-up steps from 0 to lr."""
    lr_decay_style: str = "cosine"
    """'constant', 'linear' or 'cosine' (megatron-core OptimizerParamScheduler)."""
    lr_decay_iters: int = 0
    """Steps over which lr decays to min_lr (0: train_iters)."""
    optimizer: str = "adam"
    """'adam' (megatron-core's Adam with decoupled weight decay = AdamW) or 'sgd'."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    """Adam first-moment decay."""
    adam_beta2: float = 0.999
    """Adam second-moment decay."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Clip the global gradient L2 norm to this (0: no clipping)."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state over data-parallel ranks (ZeRO-1, megatron-core)."""
    seed: int = 1234
    """Seed for weights, data order and dropout."""
    log_interval: int = 1
    """Steps between log lines / TensorBoard points."""
    eval_interval: int = 0
    """Steps between evaluations on the eval split (0: only at the end if there is one)."""
    eval_iters: int = 0
    """Eval batches per evaluation (0: the whole eval split)."""
    sample_during_eval: bool = False
    """At each evaluation, greedily decode the first ``eval_num_samples`` eval prompts and write
    them to ``<run_dir>/samples/step_<step>.jsonl``."""
    eval_num_samples: int = 3
    """Eval prompts decoded when ``sample_during_eval`` is set."""
    eval_sample_max_new_tokens: int = 32
    """Most tokens generated per sample."""
    max_nonfinite_steps: int = 3
    """A step whose loss or gradient is NaN/Inf is skipped (no update) and counted; after this
    many such steps in a row the run stops with an error, its last checkpoint intact."""
    seq_length_multiple: int = 8
    """Each step's micro-batches are padded to the longest sequence rounded up to this x TP."""
