"""The parallel layout, as one typed config (megatron-core's terms). Imports nothing heavy.

World size = tensor_model_parallel_size x pipeline_model_parallel_size x context_parallel_size x
data-parallel size. The data-parallel size is whatever is left of the world size
(``data_parallel_size``, when set, only tells launchers how many ranks to start and is checked
against the world size).

Mixture-of-experts layers are laid out separately, as megatron-core does: world size =
expert_tensor_parallel_size x expert_model_parallel_size x expert data-parallel size x PP. The
expert-parallel ranks are carved out of the TP x CP x DP ranks of each pipeline stage, so expert
parallelism adds no ranks: TP 2 x PP 2 with EP 2 and expert TP 1 runs on the same 4 ranks as
TP 2 x PP 2.
"""

from __future__ import annotations

from dataclasses import dataclass

from dpo_megatron.utils.config_checks import check_choice, check_range

BACKENDS = ("auto", "nccl", "gloo")


@dataclass
class ParallelConfig:
    """How the model and the batch are split across ranks (megatron-core's terms)."""

    tensor_model_parallel_size: int = 1
    """Ranks that split each weight matrix (and the vocabulary) of a layer (>= 1)."""
    pipeline_model_parallel_size: int = 1
    """Ranks that split the stack of layers into consecutive stages (>= 1)."""
    context_parallel_size: int = 1
    """Ranks that split every sequence along its length (>= 1; Liu et al. 2023 ring attention,
    megatron-core's load-balanced layout: each sequence is cut into 2 x CP chunks and rank r holds
    chunks r and 2CP-1-r; keys/values are all-gathered across the group, see
    ``dpo_megatron.models.context_attention``). Context-parallel ranks hold the same weights and
    see the same pairs; their gradients are summed with the data-parallel ones."""
    data_parallel_size: int | None = None
    """Model replicas (>= 1). None: world size / (TP x PP x CP). Launchers use it to choose the
    world size; under torchrun it must agree with the world size."""
    virtual_pipeline_model_parallel_size: int | None = None
    """Model chunks per pipeline rank for the interleaved 1F1B schedule (>= 2, with PP >= 2;
    None: not interleaved). The micro-batches per step (global batch / (micro batch x DP)) must
    then be a multiple of PP (megatron-core's interleaved schedule)."""
    expert_model_parallel_size: int = 1
    """Ranks that split the experts of each MoE layer (>= 1; each holds num_experts / EP of them);
    taken from the TP x DP ranks of a pipeline stage. Needs ``model.num_experts``."""
    expert_tensor_parallel_size: int | None = None
    """Ranks that split each expert's weight matrices (>= 1; None: tensor_model_parallel_size)."""
    sequence_parallel: bool = False
    """Split activations outside attention/MLP along the sequence across the TP group
    (Korthikanti et al. 2022). Needs tensor_model_parallel_size > 1. Turned on (and said so at
    start-up) for a mixture-of-experts model at TP > 1: megatron-core's MoE layer requires it."""
    backend: str = "auto"
    """'auto' (NCCL with CUDA, gloo without), 'nccl' or 'gloo'. The backend decides the device
    (``dpo_megatron.parallel.device``): NCCL computes on cuda:LOCAL_RANK, gloo on the CPU, so
    ``gloo`` on a CUDA machine runs the whole job on the host."""
    distributed_timeout_minutes: int = 30
    """Timeout for collectives before the job fails instead of hanging (minutes, >= 1)."""

    def model_parallel_size(self) -> int:
        """Ranks that share one data-parallel replica's pairs: TP x PP x CP."""
        return (
            self.tensor_model_parallel_size
            * self.pipeline_model_parallel_size
            * self.context_parallel_size
        )

    def sequence_granule(self) -> int:
        """Tokens a model row's length must be a multiple of for this layout: 2 x CP (the
        load-balanced chunks), times TP under sequence parallelism (each CP rank's L / CP
        tokens are split again over TP). 1 with neither."""
        granule = 2 * self.context_parallel_size if self.context_parallel_size > 1 else 1
        return granule * (self.tensor_model_parallel_size if self.sequence_parallel else 1)

    def launch_world_size(self) -> int:
        """Ranks a launcher should start: TP x PP x DP. With ``data_parallel_size`` unset, DP is
        the fewest replicas that also fit the expert layout (expert TP x EP x PP must divide the
        world size): TP 1 x PP 1 with EP 2 needs 2 ranks, TP 2 x PP 2 with EP 2 / expert TP 1
        needs 4."""
        import math

        mp = self.model_parallel_size()
        if self.data_parallel_size is not None:
            return mp * self.data_parallel_size
        expert_mp = (
            self.expert_tensor_parallel()
            * self.expert_model_parallel_size
            * self.pipeline_model_parallel_size
        )
        return math.lcm(mp, expert_mp)

    def expert_tensor_parallel(self) -> int:
        """Expert tensor-parallel size, resolved (None -> tensor_model_parallel_size)."""
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    def describe(self, data_parallel_size: int, experts: bool = False) -> str:
        """The layout as the start-up line names it: ``TP t x PP p x [CP c x ]DP d`` (CP only
        above 1), and for a mixture-of-experts model (``experts``) how its experts are split,
        ``(experts: EP e x expert TP et)``, a split inside the TP x DP ranks, so not a factor of
        the world size. ``data_parallel_size`` is the built one (megatron-core's)."""
        cp = self.context_parallel_size
        text = (
            f"TP {self.tensor_model_parallel_size} x PP {self.pipeline_model_parallel_size} x "
            + (f"CP {cp} x " if cp > 1 else "")
            + f"DP {data_parallel_size}"
        )
        if experts:
            text += (
                f" (experts: EP {self.expert_model_parallel_size} x expert TP "
                f"{self.expert_tensor_parallel()})"
            )
        return text

    def validate(self, world_size: int | None = None) -> None:
        """Reject layouts that cannot be built; with ``world_size``, also on that many ranks.

        Valid ranges: tensor / pipeline sizes >= 1; ``data_parallel_size`` >= 1 or null;
        ``context_parallel_size`` >= 1; ``virtual_pipeline_model_parallel_size`` >= 2 or null,
        and only with PP >= 2;
        ``expert_model_parallel_size`` >= 1, ``expert_tensor_parallel_size`` >= 1 or null;
        ``sequence_parallel`` only with TP >= 2; ``backend`` auto / nccl / gloo;
        ``distributed_timeout_minutes`` >= 1. With ``world_size``: TP x PP and
        expert TP x EP x PP divide it.

        Raises:
            ValueError: naming the conflicting fields and what to do.
        """
        check_range("parallel", self, "tensor_model_parallel_size", 1)
        check_range("parallel", self, "pipeline_model_parallel_size", 1)
        check_range(
            "parallel",
            self,
            "context_parallel_size",
            1,
            why="ranks that split each sequence (1: no context parallelism)",
        )
        check_range(
            "parallel",
            self,
            "data_parallel_size",
            1,
            optional=True,
            why="model replicas (null: world size / (TP x PP))",
        )
        check_range(
            "parallel",
            self,
            "virtual_pipeline_model_parallel_size",
            2,
            optional=True,
            why="model chunks per pipeline rank (null: not interleaved)",
        )
        check_range(
            "parallel",
            self,
            "expert_model_parallel_size",
            1,
            why="ranks that split each layer's experts",
        )
        check_range(
            "parallel",
            self,
            "expert_tensor_parallel_size",
            1,
            optional=True,
            why="ranks that split each expert (null: tensor_model_parallel_size)",
        )
        check_range("parallel", self, "distributed_timeout_minutes", 1)
        check_choice("parallel", self, "backend", BACKENDS)
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ValueError(
                "parallel.sequence_parallel=true needs parallel.tensor_model_parallel_size > 1"
            )
        if self.virtual_pipeline_model_parallel_size is not None and (
            self.pipeline_model_parallel_size < 2
        ):
            raise ValueError(
                "parallel.virtual_pipeline_model_parallel_size needs "
                "parallel.pipeline_model_parallel_size >= 2"
            )
        if world_size is None:
            return
        mp = self.model_parallel_size()
        if world_size % mp != 0:
            raise ValueError(
                f"world size {world_size} is not divisible by parallel.tensor_model_parallel_size"
                f" ({self.tensor_model_parallel_size}) x parallel.pipeline_model_parallel_size"
                f" ({self.pipeline_model_parallel_size}) x parallel.context_parallel_size"
                f" ({self.context_parallel_size}) = {mp}: launch a multiple of {mp} ranks"
            )
        if self.data_parallel_size is not None and self.data_parallel_size * mp != world_size:
            raise ValueError(
                f"parallel.data_parallel_size={self.data_parallel_size} x TP x PP x CP = "
                f"{self.data_parallel_size * mp} but the job has {world_size} ranks: launch "
                f"{self.data_parallel_size * mp} ranks or drop parallel.data_parallel_size"
            )
        ep, etp = self.expert_model_parallel_size, self.expert_tensor_parallel()
        expert_mp = etp * ep * self.pipeline_model_parallel_size
        if world_size % expert_mp:
            raise ValueError(
                f"world size {world_size} is not divisible by parallel.expert_tensor_parallel_size"
                f" ({etp}) x parallel.expert_model_parallel_size ({ep}) x "
                f"parallel.pipeline_model_parallel_size ({self.pipeline_model_parallel_size}) = "
                f"{expert_mp}: the experts of a pipeline stage are split over its TP x DP ranks; "
                f"lower the expert sizes or launch a multiple of {expert_mp} ranks"
            )
