"""The training sections of the config tree: optimisation and schedule (``train.*``), the
reference (``reference.*``) and logging (``logging.*``). Imports nothing heavy."""

from __future__ import annotations

from dataclasses import dataclass

from dpo_megatron.utils.config_checks import check_choice, check_range

REFERENCE_MODES = ("auto", "model", "precomputed")
LR_DECAY_STYLES = ("constant", "linear", "cosine")
OPTIMIZERS = ("adam", "sgd")


@dataclass
class TrainConfig:
    """Batching, optimizer and LR schedule. Batch sizes count preference *pairs*."""

    micro_batch_size: int = 1
    """Pairs per micro-batch per data-parallel rank (the schedule sees 2x sequences); >= 1."""
    global_batch_size: int = 4
    """Pairs per optimizer step over all data-parallel ranks (>= 1, a multiple of
    micro_batch_size x data-parallel size); gradient accumulation steps =
    global_batch_size / (micro_batch_size x data-parallel size)."""
    train_iters: int = 10
    """Optimizer steps (>= 1)."""
    lr: float = 1e-6
    """Peak learning rate (>= 0; DPO papers use 5e-7 to 1e-6 for 7B models)."""
    min_lr: float = 0.0
    """Floor of the decay (0 <= min_lr <= lr)."""
    reward_head_lr: float | None = None
    """Peak learning rate of a reward model's scalar head (``loss.name=bradley_terry``; > 0;
    None: ``lr``), on the same schedule (megatron-core's per-group ``max_lr``). The head starts
    at zero and Adam moves each weight by about the learning rate per step, so at a body's
    fine-tuning rate (1e-5) a short run ends with rewards near 0 whatever the body learned."""
    lr_warmup_iters: int = 0
    """Linear warm-up steps from 0 to lr (>= 0)."""
    lr_decay_style: str = "cosine"
    """'constant', 'linear' or 'cosine' (megatron-core OptimizerParamScheduler)."""
    lr_decay_iters: int = 0
    """Steps over which lr decays to min_lr (>= 0; 0: train_iters)."""
    optimizer: str = "adam"
    """'adam' (megatron-core's Adam with decoupled weight decay = AdamW) or 'sgd'."""
    weight_decay: float = 0.0
    """Decoupled weight decay (>= 0)."""
    adam_beta1: float = 0.9
    """Adam first-moment decay, in [0, 1)."""
    adam_beta2: float = 0.999
    """Adam second-moment decay, in [0, 1)."""
    adam_eps: float = 1e-8
    """Adam epsilon (> 0)."""
    clip_grad: float = 1.0
    """Clip the global gradient L2 norm to this (>= 0; 0: no clipping)."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state over data-parallel ranks (ZeRO-1, megatron-core)."""
    seed: int = 1234
    """Seed for weights, data order and dropout (>= 0)."""
    log_interval: int = 1
    """Steps between log lines / TensorBoard points (>= 1)."""
    eval_interval: int = 0
    """Steps between evaluations on the eval split (>= 0; 0: only at the end if there is one)."""
    eval_iters: int = 0
    """Eval batches per evaluation (>= 0; 0: the whole eval split)."""
    eval_global_batch_size: int = 0
    """Pairs per eval batch over all data-parallel ranks (>= 0; 0: ``global_batch_size``); each
    rank's share is split into ``micro_batch_size`` micro-batches where it divides."""
    eval_at_start: bool = True
    """Also evaluate before the first step of a run starting at step 0 (logged as step 0; the
    reference DPO repo's ``do_first_eval``), when there is an eval set: the baseline the later
    evaluations are read against (at step 0 a DPO loss is ln 2 and the margins 0)."""
    sample_during_eval: bool = False
    """At each evaluation, greedily decode the first ``eval_num_samples`` eval prompts and write
    them to ``<run_dir>/samples/step_<step>.jsonl``."""
    eval_num_samples: int = 3
    """Eval prompts decoded when ``sample_during_eval`` is set (>= 1)."""
    eval_sample_max_new_tokens: int = 32
    """Most tokens generated per sample (>= 1)."""
    max_nonfinite_steps: int = 3
    """A step whose loss or gradient is NaN/Inf is skipped (no update) and counted; after this
    many such steps in a row (>= 1) the run stops with an error, its last checkpoint intact."""
    seq_length_multiple: int = 8
    """Each step's micro-batches are padded to the longest sequence rounded up to this x TP
    (>= 1)."""

    def warmup_warning(self) -> str | None:
        """A line for the start of a run whose warm-up does not end before its last step (the
        learning rate then never reaches ``lr``: the reference repo's 150 warm-up steps on a
        short run), else None."""
        if self.lr_warmup_iters < self.train_iters:
            return None
        return (
            f"WARNING: train.lr_warmup_iters={self.lr_warmup_iters} >= train.train_iters="
            f"{self.train_iters}: the run ends {self.train_iters}/{self.lr_warmup_iters} of "
            f"the way through its linear warm-up and never reaches train.lr={self.lr:g}"
        )

    def validate(self) -> None:
        """The ranges in the field docs, and the names of the decay style and the optimizer.

        Raises:
            ValueError: ``train.<field>=<value> must be ...``.
        """
        for name in (
            "micro_batch_size",
            "global_batch_size",
            "train_iters",
            "log_interval",
            "eval_sample_max_new_tokens",
            "seq_length_multiple",
        ):
            check_range("train", self, name, 1)
        check_range(
            "train",
            self,
            "max_nonfinite_steps",
            1,
            why="the number of NaN/Inf steps in a row that stops the run (1: the first)",
        )
        for name in (
            "lr",
            "min_lr",
            "lr_warmup_iters",
            "lr_decay_iters",
            "weight_decay",
            "seed",
            "eval_interval",
            "eval_iters",
            "eval_global_batch_size",
        ):
            check_range("train", self, name, 0)
        check_range("train", self, "clip_grad", 0, why="0 turns clipping off")
        check_range("train", self, "min_lr", 0, self.lr, why="a floor below train.lr")
        if self.reward_head_lr is not None:
            check_range("train", self, "reward_head_lr", self.min_lr, why="at least train.min_lr")
        check_range("train", self, "adam_beta1", 0, 1, high_open=True)
        check_range("train", self, "adam_beta2", 0, 1, high_open=True)
        check_range("train", self, "adam_eps", 0, low_open=True)
        check_choice("train", self, "lr_decay_style", LR_DECAY_STYLES)
        check_choice("train", self, "optimizer", OPTIMIZERS)
        if self.sample_during_eval:
            check_range(
                "train",
                self,
                "eval_num_samples",
                1,
                why="prompts decoded with train.sample_during_eval=true",
            )
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(
                f"train.global_batch_size={self.global_batch_size} must be "
                f"divisible by train.micro_batch_size={self.micro_batch_size}"
            )


@dataclass
class ReferenceConfig:
    """Which model is the reference and how its log-probs are obtained (``reference.*``)."""

    hf_path: str = ""
    """Hugging Face folder (config.json + safetensors) whose weights are the reference, instead
    of the policy's starting weights (TRL's ``ref_model``): e.g. the SFT model while the policy
    continues from a DPO checkpoint, or a fixed baseline. Its architecture must be the policy's
    (the fields that differ are named at start-up); it is loaded at the run's layout, in either
    mode. Refused with ``lora.enabled`` (LoRA's reference is the policy's base with the adapters
    off) and with a loss that reads no reference. Empty: the policy's starting weights."""
    load: str = ""
    """Checkpoint folder (or a run's ``checkpoints`` folder: its latest) whose weights are the
    reference, as ``reference.hf_path`` (OpenRLHF's reference path); saved at any layout, resharded
    to the run's. Not with ``reference.hf_path``, nor with a LoRA checkpoint (adapters only)."""
    mode: str = "auto"
    """'auto': 'precomputed' when the loss reads a reference and train_iters x global_batch_size
    covers every train pair, else 'model' (``training.auto_settings``). 'model': the frozen
    reference runs forward every step. 'precomputed': one forward-only pass over the training
    pairs before training, cached on disk; no reference forward while training. Both give the
    same log-probs to the bit (the pass groups pairs as the run's first epoch and evaluation
    do), so with the policy's weights as reference step-0 rewards are exactly 0 in each. Other
    than 'auto', refused with a loss that reads no reference."""
    offload: bool = False
    """Keep the reference weights in host memory and copy them to the accelerator only for the
    reference pass (mode 'model'; also used for the precompute pass). Refused with a loss that
    reads no reference."""
    cache_dir: str = ""
    """Directory of precomputed tables (empty: <DPO_MEGATRON_CACHE>/reference_logps). Must be
    shared by all ranks of a multi-node run (like checkpoint directories)."""
    micro_batch_size: int = 0
    """Pairs per micro-batch of the precompute pass (>= 0; 0: train.micro_batch_size, grouped
    as training and evaluation group them). Another size packs other rows: the values then equal
    'model' mode's to fp32 rounding only, and step-0 rewards are float noise around 0."""

    def weights(self) -> str:
        """The reference's own weights: ``hf_path`` or ``load`` ('' when the reference is the
        policy's starting weights)."""
        return self.hf_path or self.load

    def weights_key(self) -> str:
        """The key that names them: 'reference.hf_path' or 'reference.load' ('' for neither)."""
        if self.hf_path:
            return "reference.hf_path"
        return "reference.load" if self.load else ""

    def validate(self) -> None:
        """Raises ValueError for an unknown mode, a negative micro-batch size, or both
        ``hf_path`` and ``load``."""
        if self.mode not in REFERENCE_MODES:
            raise ValueError(f"reference.mode={self.mode!r}; known: {', '.join(REFERENCE_MODES)}")
        check_range("reference", self, "micro_batch_size", 0, why="0: train.micro_batch_size")
        if self.hf_path and self.load:
            raise ValueError(
                f"reference.hf_path={self.hf_path} and reference.load={self.load}: the reference "
                "has one source; keep one of them"
            )


@dataclass
class LoggingConfig:
    """Where step metrics go besides the console line and ``<run_dir>/metrics.jsonl``."""

    tensorboard: bool = True
    """Write TensorBoard scalars to ``<run_dir>/tensorboard``."""
    wandb_project: str = ""
    """Weights & Biases project; empty: off. Needs the ``wandb`` package (a warning, not an
    error, when it is missing) and a login or WANDB_API_KEY / WANDB_MODE=offline."""
    wandb_entity: str = ""
    """W&B entity (team or user); empty: the default of the login."""
    wandb_run_name: str = ""
    """W&B run name; empty: the run directory's name."""
