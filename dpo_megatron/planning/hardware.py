"""Accelerators and clusters the planner plans for: memory, dense bf16 peak and link speeds.

Peaks are the dense (no sparsity) bf16 figures of NVIDIA's datasheets for the exact board, by the
name ``torch.cuda.get_device_name()`` gives: the PCIe and NVL boards of a chip run at lower
clocks and power than its SXM board (H100 SXM 989.4, H100 NVL 835.5, H100 PCIe 756.5 TFLOP/s),
so a name is matched exactly, never by substring. Memory is the board's capacity in GiB as
``torch.cuda.get_device_properties().total_memory`` reports it (80 GB HBM3 -> 79.1 GiB).
Link speeds are per GPU and per direction: NVLink 4 (H100 / H200 SXM) 450 GB/s, NVLink 3 (A100
SXM) 300 GB/s, PCIe 5 x16 64 GB/s, PCIe 4 x16 32 GB/s; between nodes, one 400 Gb/s InfiniBand
NDR port per GPU (50 GB/s), the DGX H100 / H200 design. Memory bandwidth: HBM3 3.35 TB/s (H100
SXM), HBM3e 4.8 TB/s (H200).
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30


@dataclass(frozen=True)
class Accelerator:
    """One accelerator model.

    Attributes:
        sku: the board (``H100 SXM``).
        memory_gib: device memory (GiB).
        bf16_tflops: dense bf16 peak (TFLOP/s).
        intra_node_gbps: bandwidth to the other GPUs of its node, per direction (GB/s).
        memory_gbps: device-memory bandwidth (GB/s), for the optimizer step.
        device_names: what ``torch.cuda.get_device_name()`` calls it.
    """

    sku: str
    memory_gib: float
    bf16_tflops: float
    intra_node_gbps: float
    memory_gbps: float
    device_names: tuple[str, ...] = ()


ACCELERATORS: dict[str, Accelerator] = {
    "h100": Accelerator("H100 SXM", 79.1, 989.4, 450.0, 3350.0, ("NVIDIA H100 80GB HBM3",)),
    "h100-pcie": Accelerator("H100 PCIe", 79.1, 756.5, 64.0, 2000.0, ("NVIDIA H100 PCIe",)),
    "h100-nvl": Accelerator("H100 NVL", 93.1, 835.5, 300.0, 3900.0, ("NVIDIA H100 NVL",)),
    "h200": Accelerator("H200 SXM", 139.8, 989.4, 450.0, 4800.0, ("NVIDIA H200",)),
    "h200-nvl": Accelerator("H200 NVL", 139.8, 835.5, 450.0, 4800.0, ("NVIDIA H200 NVL",)),
    "gh200": Accelerator(
        "GH200", 94.5, 989.4, 450.0, 4000.0, ("NVIDIA GH200 480GB", "NVIDIA GH200 144G HBM3e")
    ),
    "b200": Accelerator("B200", 178.4, 2250.0, 900.0, 8000.0, ("NVIDIA B200",)),
    "a100-80gb": Accelerator(
        "A100 SXM", 79.1, 312.0, 300.0, 2039.0, ("NVIDIA A100-SXM4-80GB", "NVIDIA A100-SXM-80GB")
    ),
    "a100-40gb": Accelerator("A100 SXM", 39.4, 312.0, 300.0, 1555.0, ("NVIDIA A100-SXM4-40GB",)),
    "a100-pcie": Accelerator(
        "A100 PCIe", 79.1, 312.0, 32.0, 1935.0, ("NVIDIA A100 80GB PCIe", "NVIDIA A100-PCIE-40GB")
    ),
    "l40s": Accelerator("L40S", 44.4, 362.05, 32.0, 864.0, ("NVIDIA L40S",)),
    "l40": Accelerator("L40", 44.4, 181.05, 32.0, 864.0, ("NVIDIA L40",)),
    "l4": Accelerator("L4", 22.0, 121.0, 32.0, 300.0, ("NVIDIA L4",)),
    "a10": Accelerator("A10", 22.0, 125.0, 32.0, 600.0, ("NVIDIA A10",)),
    "a40": Accelerator("A40", 44.4, 149.7, 32.0, 696.0, ("NVIDIA A40",)),
    "rtx-a6000": Accelerator("RTX A6000", 47.4, 154.8, 32.0, 768.0, ("NVIDIA RTX A6000",)),
}
"""Short name (``--gpu``) -> accelerator."""


def _key(name: str) -> str:
    return " ".join(name.lower().split())


def find_accelerator(name: str) -> Accelerator | None:
    """The accelerator a short name (``h100``) or a device name (``NVIDIA H100 80GB HBM3``, case
    and runs of spaces aside) stands for; None when unknown."""
    if _key(name) in ACCELERATORS:
        return ACCELERATORS[_key(name)]
    for accelerator in ACCELERATORS.values():
        if _key(name) in {_key(n) for n in accelerator.device_names}:
            return accelerator
    return None


@dataclass(frozen=True)
class Cluster:
    """What the job runs on.

    Attributes:
        nodes: machines.
        gpus_per_node: ranks per machine.
        accelerator: each rank's device.
        inter_node_gbps: bandwidth to other nodes per GPU and direction (GB/s).
        reserved_gib: device memory no tensor gets: the CUDA context and NCCL's buffers (GiB).
        margin: the caching allocator's fragmentation and the estimate's error, as a share of
            the predicted peak (a layout fits when peak x (1 + margin) + reserved <= memory).
        mfu: the share of the dense peak that the model FLOPs run at (model FLOPs utilisation:
            Chowdhery et al. 2022, "PaLM", appendix B).
        expert_overhead_us: host time per routed expert and pass through a layer: megatron-core's
            ``SequentialMLP`` (the engine's experts) runs one expert after another from Python,
            whatever their size (microseconds).
        host: the CPU stands in for the device (ranks share one host memory).
    """

    nodes: int
    gpus_per_node: int
    accelerator: Accelerator
    inter_node_gbps: float = 50.0
    reserved_gib: float = 3.0
    margin: float = 0.10
    mfu: float = 0.35
    expert_overhead_us: float = 50.0
    host: bool = False

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def usable_bytes(self) -> float:
        """The largest predicted peak per rank that fits (``margin`` and ``reserved_gib`` off)."""
        return (self.accelerator.memory_gib - self.reserved_gib) * GIB / (1 + self.margin)

    def budget(self) -> str:
        """The memory rule in words."""
        if self.host:
            return (
                f"at most {self.usable_bytes / GIB:.1f} GiB predicted fits each of "
                f"{self.world_size} ranks' share of host memory ({self.accelerator.memory_gib:.1f} "
                f"GiB; {self.reserved_gib:g} GiB for the process, {self.margin:.0%} margin)"
            )
        return (
            f"at most {self.usable_bytes / GIB:.1f} GiB predicted fits a "
            f"{self.accelerator.memory_gib:g} GiB {self.accelerator.sku} ({self.reserved_gib:g} "
            f"GiB for the CUDA context and NCCL, {self.margin:.0%} margin)"
        )

    def link_gbps(self, span: int) -> float:
        """Bandwidth of a communication group whose ranks span ``span`` consecutive ranks
        (megatron-core orders ranks TP, CP, EP, DP, PP from fastest to slowest): inside a node
        over NVLink / PCIe, else over the network."""
        if span <= self.gpus_per_node:
            return self.accelerator.intra_node_gbps
        return self.inter_node_gbps


def host_cluster(ranks: int, memory_gib: float, tflops: float) -> Cluster:
    """The CPU as the device: ``ranks`` processes sharing ``memory_gib`` of host memory (each
    rank's budget is its share, less 1.5 GiB for the interpreter, torch, megatron-core and the
    tokenizer of its process) at ``tflops`` fp32 all together, over shared memory."""
    share = memory_gib / ranks
    cpu = Accelerator("CPU", share, tflops / ranks, 10.0, 10.0)
    return Cluster(
        1, ranks, cpu, inter_node_gbps=10.0, reserved_gib=1.5, margin=0.1, mfu=1.0, host=True
    )


def cluster_from_options(args) -> Cluster:
    """The cluster the planner's command-line options describe (``args``: its namespace, with
    ``gpu``, ``nodes``, ``gpus_per_node``, ``gpu_memory_gib``, ``peak_tflops``, ``mfu``,
    ``margin``, ``reserved_gib``, ``inter_node_gbps``, ``intra_node_gbps`` and
    ``expert_overhead_us``: ``dpo_megatron.cli.plan``).

    Raises:
        ValueError: naming the option: a count below 1, an MFU outside (0, 1], a negative
            margin, an unknown ``--gpu`` without ``--gpu-memory-gib`` and ``--peak-tflops``.
    """
    import dataclasses

    for name, value, low in (
        ("--nodes", args.nodes, 1),
        ("--gpus-per-node", args.gpus_per_node, 1),
    ):
        if value < low:
            raise ValueError(f"{name}={value} must be >= {low}")
    if not 0 < args.mfu <= 1:
        raise ValueError(f"--mfu={args.mfu} must be in (0, 1]: a share of the peak")
    if args.margin < 0 or args.reserved_gib < 0:
        raise ValueError("--margin and --reserved-gib must be >= 0")
    ranks = args.nodes * args.gpus_per_node
    if args.gpu.lower() == "cpu":
        import psutil

        memory = args.gpu_memory_gib or psutil.virtual_memory().total / GIB
        return host_cluster(ranks, memory, args.peak_tflops or 0.1)
    accelerator = find_accelerator(args.gpu)
    if accelerator is None:
        if not (args.gpu_memory_gib and args.peak_tflops):
            given = [
                flag
                for flag, v in (
                    ("--gpu-memory-gib", args.gpu_memory_gib),
                    ("--peak-tflops", args.peak_tflops),
                )
                if v
            ]
            raise ValueError(
                f"--gpu {args.gpu!r} is not in the table ({', '.join(ACCELERATORS)}): give both "
                f"--gpu-memory-gib and --peak-tflops (given: {', '.join(given) or 'neither'}; "
                "--intra-node-gbps for its links)"
            )
        accelerator = find_accelerator("h100")
        accelerator = dataclasses.replace(accelerator, sku=args.gpu, device_names=())
    if args.gpu_memory_gib:
        accelerator = dataclasses.replace(accelerator, memory_gib=args.gpu_memory_gib)
    if args.peak_tflops:
        accelerator = dataclasses.replace(accelerator, bf16_tflops=args.peak_tflops)
    if args.intra_node_gbps:
        accelerator = dataclasses.replace(accelerator, intra_node_gbps=args.intra_node_gbps)
    return Cluster(
        args.nodes,
        args.gpus_per_node,
        accelerator,
        inter_node_gbps=args.inter_node_gbps,
        reserved_gib=args.reserved_gib,
        margin=args.margin,
        mfu=args.mfu,
        expert_overhead_us=args.expert_overhead_us,
    )
