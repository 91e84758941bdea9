"""scripts/slurm: the sbatch script run as two simulated SLURM nodes on 127.0.0.1 forms one job.

Each "node" is the sbatch script started with the variables srun would give its task
(SLURM_NNODES=2, SLURM_NODEID=0/1, rendezvous host 127.0.0.1, one process per node) and
DPO_MEGATRON_NO_SRUN=1 in place of srun. The 2-node job (data parallel 2 over gloo, CPU) must log
the same losses as one node running both processes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dpo_megatron.parallel.layout import free_port
from tests.training.test_lifecycle import (
    TINY_MODEL,
    fixture_data_overrides,
    read_metrics,
    write_fixture,
)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SBATCH = ROOT / "scripts" / "slurm" / "dpo.sbatch"


def _args(tmp_path: Path, run_dir: Path) -> list[str]:
    data_file, tok_dir = write_fixture(tmp_path / "data")
    config = tmp_path / "tiny.yaml"
    config.write_text("{}\n")
    return [
        "--config",
        str(config),
        f"run_dir={run_dir}",
        *fixture_data_overrides(data_file, tok_dir),
        "model.vocab_size=400",
        *TINY_MODEL,
        "parallel.data_parallel_size=2",
        "train.micro_batch_size=1",
        "train.global_batch_size=4",
        "train.train_iters=3",
        "train.lr=1e-3",
        "logging.tensorboard=false",
    ]


def _node_env(nnodes: int, node_id: int, gpus_per_node: int, port: int) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(
            ("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_", "TORCHELASTIC")
        )
    }
    env.update(
        SLURM_NNODES=str(nnodes),
        SLURM_NODEID=str(node_id),
        SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST="localhost",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        GPUS_PER_NODE=str(gpus_per_node),
        DPO_MEGATRON_NO_SRUN="1",
        DPO_MEGATRON_ROOT=str(ROOT),
        PYTHON=sys.executable,
        OMP_NUM_THREADS="1",
    )
    return env


def _launch(args: list[str], nnodes: int, gpus_per_node: int) -> None:
    port = free_port()
    procs = [
        subprocess.Popen(
            ["bash", str(SBATCH), *args],
            env=_node_env(nnodes, node, gpus_per_node, port),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in range(nnodes)
    ]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=240)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for node, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"node {node} failed:\n{out[-4000:]}"


def test_two_simulated_nodes_form_one_job_with_the_one_node_losses(tmp_path):
    two_nodes, one_node = tmp_path / "two_nodes", tmp_path / "one_node"
    _launch(_args(tmp_path, two_nodes), nnodes=2, gpus_per_node=1)
    _launch(_args(tmp_path, one_node), nnodes=1, gpus_per_node=2)
    a, b = read_metrics(two_nodes), read_metrics(one_node)
    assert sorted(a) == sorted(b) == [1, 2, 3]
    for step in a:
        assert a[step]["loss"] == b[step]["loss"], step
    assert (two_nodes / "checkpoints" / "iter_0000003" / "train_state.json").exists()
    assert (
        '"data_parallel_size": 2'
        in (two_nodes / "checkpoints" / "iter_0000003" / "train_state.json").read_text()
    )


def _rendezvous(tmp_path: Path, node_addr: str) -> subprocess.CompletedProcess:
    """launch_node.sh on a node list whose first name does not resolve, with a stand-in
    ``scontrol`` (NodeAddr ``node_addr``) and ``echo`` in place of python: the launcher's
    arguments come back on stdout."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f"""#!/bin/bash
case "$1 $2" in
  "show hostnames") echo no-such-node-a.invalid; echo no-such-node-b.invalid ;;
  "show node") echo "NodeName=$4 Arch=x86_64 NodeAddr={node_addr} NodeHostName=$4" ;;
esac
""")
    scontrol.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_"))}
    env.update(
        PATH=f"{bin_dir}:{env['PATH']}",
        SLURM_NNODES="2",
        SLURM_NODEID="1",
        SLURM_JOB_ID="7",
        SLURM_JOB_NODELIST="no-such-node-[a-b].invalid",
        GPUS_PER_NODE="1",
        PYTHON="echo",
    )
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "slurm" / "launch_node.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_the_rendezvous_is_the_first_nodes_node_addr_when_its_name_does_not_resolve(tmp_path):
    out = _rendezvous(tmp_path, "127.0.0.1")
    assert out.returncode == 0, out.stderr
    assert "--master-addr=127.0.0.1 --master-port=29507" in out.stdout
    out = _rendezvous(tmp_path, "no-such-node-a.invalid")  # NodeAddr defaults to the name
    assert out.returncode == 1
    assert out.stderr.strip() == (
        "launch_node.sh: the rendezvous host, node no-such-node-a.invalid (NodeAddr "
        "no-such-node-a.invalid), does not resolve on " + os.uname().nodename + ": set "
        "MASTER_ADDR to an address of no-such-node-a.invalid reachable from every node"
    )
