"""scripts/slurm under a real Slurm: sbatch, srun, scancel, scontrol on a 2-node cluster on this
machine (``scripts/slurm/test_cluster.sh``: munge, slurmctld, one slurmd per node; node names n1
and n2 do not resolve, as on clusters whose NodeName is not a host name).

* ``dpo.sbatch`` with data parallel 2 and ``sft.sbatch`` with tensor parallel 2 across the two
  nodes log the same losses as the same job on one node (two processes there);
* ``scancel --signal=TERM`` (every process of the job step) and ``scancel --batch
  --signal=TERM`` (the batch shell only, as ``sbatch --signal=B:TERM@60`` does before the time
  limit) make every rank save at the end of its step and exit with 143; ``scontrol requeue``
  resumes from that checkpoint and the run ends with the uninterrupted run's numbers;
* a lost node (its slurmd and its job processes killed mid-run) ends the job within a bounded
  time with Slurm's ``Node failure on n2``; Slurm requeues it, and once the node is back it
  resumes from the last checkpoint and ends with the uninterrupted run's numbers;
* a job reaching its time limit saves before it is killed.

Wall time: about 4 minutes on 2 idle cores (each job start imports torch in every process); far
more on a loaded machine.

The cluster starts once for the module. Where it cannot start (not root, no slurm-wlm / munge) the
tests are skipped with the reason, except in CI (``CI=true``), where they fail.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.training.test_lifecycle import TINY_MODEL, read_metrics, write_fixture

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "scripts" / "slurm" / "test_cluster.sh"
DPO, SFT = ROOT / "scripts" / "slurm" / "dpo.sbatch", ROOT / "scripts" / "slurm" / "sft.sbatch"
ONLINE = ROOT / "scripts" / "slurm" / "iterative_dpo.sbatch"
# The CPU overrides of the sbatch headers (--gpus-per-node=8, --cpus-per-task=32, --exclusive),
# as the README shows them.
CPU_FLAGS = ["--gpus-per-node=0", "--cpus-per-task=1", "--oversubscribe"]
STEPS = 30  # long enough for a signal to land mid-run; each step takes a tenth of a second
JOB_TIMEOUT = 600  # seconds: job start-up (torch imports) is slow on a loaded machine


def _ports_free(*ports: int) -> bool:
    for port in ports:
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                return False
    return True


class Cluster:
    """The test cluster's commands (``SLURM_CONF`` set) and its job helpers."""

    def __init__(self, state: Path, port: int):
        self.state = state
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_"))}
        self.env.update(
            DPO_MEGATRON_SLURM_DIR=str(state),
            DPO_MEGATRON_SLURM_PORT=str(port),
            SLURM_CONF=str(state / "slurm.conf"),
            OMP_NUM_THREADS="1",
        )

    def run(self, *cmd: str, check: bool = True) -> str:
        out = subprocess.run(
            cmd, env=self.env, cwd=ROOT, capture_output=True, text=True, timeout=120
        )
        if check and out.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr}")
        return out.stdout

    def cluster(self, action: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", str(CLUSTER), action],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=180,
        )

    def sbatch(
        self, script: Path, out: Path, args: list[str], *flags: str, env: dict | None = None
    ) -> str:
        """Submit ``script`` from the repository root; returns the job id."""
        cmd = [
            "sbatch",
            "--parsable",
            f"--output={out}",
            "--open-mode=append",
            "--time=20",
            *CPU_FLAGS,
            *flags,
            str(script),
            *args,
        ]
        res = subprocess.run(
            cmd,
            env={**self.env, **(env or {})},
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert res.returncode == 0, res.stderr
        return res.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict:
        line = self.run("scontrol", "show", "job", "-o", job_id)
        return dict(re.findall(r"(\w+)=(\S*)", line))

    def wait_done(self, job_id: str, timeout: float = JOB_TIMEOUT) -> dict:
        """Wait until the job is neither pending, running nor completing; its fields."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job = self.job(job_id)
            if job["JobState"] not in (
                "PENDING",
                "RUNNING",
                "COMPLETING",
                "CONFIGURING",
                "REQUEUED",
                "RESIZING",
                "SUSPENDED",
            ):
                return job
            time.sleep(0.5)
        raise AssertionError(f"job {job_id} still {job['JobState']} after {timeout} s")

    def requeue(self, job_id: str) -> None:
        """``scontrol requeue``, then start it at once (Slurm holds a requeued job for
        ``cred_expire``: 90 s on the test cluster, 120 s by default).
        First wait for the job's last processes: a slurmd still ending its step refuses to start
        the requeued job ("Job credential revoked") and the job fails. Then wait for the next
        second: slurmd revokes the old run's credential at a whole second and refuses any
        credential created at or before it, so a requeue within that second fails the same way
        (seen in CI: requeued and refused 0.2 s after the job ended)."""
        self.wait_gone(job_id)
        time.sleep(1.05 - time.time() % 1.0)
        self.run("scontrol", "requeue", job_id)
        self.release(job_id)

    def release(self, job_id: str) -> None:
        """Start a requeued (pending) job now, once its last processes are gone and no node is
        down or completing: a node still completing the job's previous run (a node back from the
        dead is, for a moment) leaves the new run's srun waiting for a step that never starts."""
        self.wait_gone(job_id)
        deadline = time.monotonic() + 120
        while not set(self.run("sinfo", "-h", "-N", "-o", "%T").split()) <= {"idle", "mixed"}:
            assert time.monotonic() < deadline, self.run("sinfo", "-N")
            time.sleep(0.5)
        self.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")

    @staticmethod
    def wait_gone(job_id: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while _job_processes(job_id):
            assert time.monotonic() < deadline, f"job {job_id}'s processes did not end"
            time.sleep(0.5)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A started 2-node test cluster (stopped after the module)."""
    in_ci = os.environ.get("CI", "").lower() in ("1", "true", "yes")
    port = next((p for p in range(21817, 29817, 373) if _ports_free(p, p + 101, p + 102)), None)
    state = tmp_path_factory.mktemp("slurm")
    c = Cluster(state, port or 21817)
    reason = None
    if os.geteuid() != 0:
        reason = "needs root (slurmd runs the jobs)"
    elif port is None:
        reason = "no free ports for slurmctld / slurmd"
    else:
        started = c.cluster("start")
        if started.returncode != 0:
            reason = f"test_cluster.sh start failed: {(started.stderr or started.stdout).strip()}"
    if reason:
        c.cluster("stop")
        message = f"a Slurm test cluster cannot start here: {reason}"
        if in_ci:
            pytest.fail(message + " (CI must run these tests: .ci/run installs slurm-wlm, munge)")
        pytest.skip(message)
    yield c
    c.cluster("stop")


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """The tiny preference data, tokenizer and config (configs/tiny_cpu.yaml's shape)."""
    folder = tmp_path_factory.mktemp("slurm_runs")
    data_file, tok_dir = write_fixture(folder / "data")
    config = folder / "tiny.yaml"
    model = "\n".join(f"  {k.split('.', 1)[1].replace('=', ': ')}" for k in TINY_MODEL)
    config.write_text(f"""model:
{model}
  vocab_size: 400
data:
  path: {data_file}
  tokenizer: {tok_dir}
  format: standard
  max_length: 32
  max_prompt_length: 16
  cache_dir: none
  verbose: false
train:
  micro_batch_size: 1
  global_batch_size: 4
  train_iters: {STEPS}
  lr: 1.0e-3
logging:
  tensorboard: false
checkpoint:
  save_interval: 5
""")
    return folder, config


def _dpo_args(config: Path, run_dir: Path, *more: str) -> list[str]:
    return ["--config", str(config), f"run_dir={run_dir}", "parallel.data_parallel_size=2", *more]


def _wait_for_step(run_dir: Path, step: int, job_id: str, c: Cluster) -> None:
    deadline = time.monotonic() + JOB_TIMEOUT
    path = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        if path.exists() and f'"step": {step},' in path.read_text():
            return
        state = c.job(job_id)["JobState"]
        assert state in ("PENDING", "RUNNING", "CONFIGURING"), f"job {job_id} is {state}"
        time.sleep(0.1)
    raise AssertionError(f"job {job_id} did not reach step {step}")


def _losses(run_dir: Path) -> list[float]:
    metrics = read_metrics(run_dir)
    assert sorted(metrics) == list(range(1, max(metrics) + 1)), sorted(metrics)
    return [metrics[s]["loss"] for s in sorted(metrics)]


def _stopped_step(log: str, after: int = 0) -> int:
    """The step of the last 'stopped by SIGTERM after step K: saved checkpoint' line."""
    steps = [
        int(k)
        for k in re.findall(r"^stopped by SIGTERM after step (\d+): saved checkpoint", log, re.M)
    ]
    assert steps and steps[-1] > after, log[-3000:]
    assert steps[-1] < STEPS, f"the run ended before the signal (step {steps[-1]})"
    return steps[-1]


@pytest.fixture(scope="module")
def time_limit_job(cluster, work):
    """A job that trains until its time limit (one node, one process), submitted with the first
    jobs of the module so that its start-up overlaps theirs, its limit set to 1 minute once it
    trains (:func:`_limit_once_it_trains`, in a thread); (job id, run_dir, output, that
    thread's future)."""
    folder, config = work
    run_dir, out = folder / "dpo_time_limit", folder / "time_limit.out"
    job_id = cluster.sbatch(
        DPO,
        out,
        [
            "--config",
            str(config),
            f"run_dir={run_dir}",
            "train.train_iters=1000000",
            "checkpoint.save_interval=1000000",
        ],
        "--nodes=1",
        "--time=10",
        # the trainer with a sleep of half a second before each step (tests/launcher_entry.py),
        # so that this job leaves the CPU to the other tests' jobs while it waits for its limit
        env={
            "GPUS_PER_NODE": "1",
            "DPO_MEGATRON_ENTRY": "tests.launcher_entry",
            "DPO_TEST_ENDING": "slow_steps",
            "DPO_TEST_STEP_SLEEP": "0.5",
        },
    )
    limiting = concurrent.futures.ThreadPoolExecutor(1)
    limited = limiting.submit(_limit_once_it_trains, cluster, job_id, run_dir)
    limiting.shutdown(wait=False)
    return job_id, run_dir, out, limited


def _limit_once_it_trains(c: Cluster, job_id: str, run_dir: Path) -> None:
    """1 minute (Slurm's smallest limit), set once the job trains so that a slow start cannot
    use it up: Slurm sends SIGTERM at its next check (every 30 s, from 60 s after the job
    started), and SIGKILL after KillWait (30 s here). Set while the other tests run, so that
    the time-limit test (after them) finds the job at its limit or past it."""
    _wait_for_step(run_dir, 1, job_id, c)
    c.run("scontrol", "update", f"JobId={job_id}", "TimeLimit=1")


@pytest.fixture(scope="module")
def uninterrupted(cluster, work, time_limit_job):
    """The 2-node DPO job (DP 2) run to the end, and its one-node twin (2 processes on n1):
    (two-node losses, one-node losses, two-node output)."""
    folder, config = work
    two, one = folder / "dpo_two_nodes", folder / "dpo_one_node"
    jobs = [
        cluster.sbatch(DPO, folder / "two.out", _dpo_args(config, two), "--nodes=2"),
        cluster.sbatch(
            DPO, folder / "one.out", _dpo_args(config, one), "--nodes=1", env={"GPUS_PER_NODE": "2"}
        ),
    ]
    for job_id, out in zip(jobs, ("two.out", "one.out")):
        job = cluster.wait_done(job_id)
        assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), (
            folder / out
        ).read_text()[-4000:]
    return _losses(two), _losses(one), (folder / "two.out").read_text()


def test_dpo_data_parallel_on_two_nodes_logs_the_one_node_losses(cluster, uninterrupted):
    two, one, out = uninterrupted
    assert len(two) == STEPS and two == one
    # the rendezvous is the first node's NodeAddr: the node name n1 does not resolve
    addr = re.search(r"NodeAddr=(\S+)", cluster.run("scontrol", "show", "node", "n1")).group(1)
    assert re.search(rf"node 1/2 on \S+: 1 processes, rendezvous {re.escape(addr)}:\d+", out), out
    assert subprocess.run(["getent", "ahosts", "n1"], capture_output=True).returncode != 0


def test_sft_tensor_parallel_across_two_nodes_logs_the_one_node_losses(cluster, work):
    folder, config = work
    args = [
        "--config",
        str(config),
        "loss.name=sft",
        "train.train_iters=3",
        "parallel.tensor_model_parallel_size=2",
        "parallel.data_parallel_size=1",
    ]
    two, one = folder / "sft_two_nodes", folder / "sft_one_node"
    jobs = [
        cluster.sbatch(SFT, folder / "sft_two.out", [*args, f"run_dir={two}"], "--nodes=2"),
        cluster.sbatch(
            SFT,
            folder / "sft_one.out",
            [*args, f"run_dir={one}"],
            "--nodes=1",
            env={"GPUS_PER_NODE": "2"},
        ),
    ]
    for job_id, out in zip(jobs, ("sft_two.out", "sft_one.out")):
        job = cluster.wait_done(job_id)
        assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), (
            folder / out
        ).read_text()[-4000:]
    assert len(_losses(two)) == 3 and _losses(two) == _losses(one)
    assert (
        '"tensor_model_parallel_size": 2'
        in (two / "checkpoints" / "iter_0000003" / "train_state.json").read_text()
    )


def test_a_mistake_ends_the_job_in_one_line_with_status_1_before_any_node_starts(cluster, work):
    """The pre-check runs in the batch shell, against the allocation's ranks (2 nodes x 1): a
    pinned data-parallel size that does not fill them, and iterative DPO's own pre-check
    (iterative_dpo.sbatch), each end the job with the one line and status 1, no node started.
    Left to the ranks, the first to stop had srun SIGTERM the other node, whose launcher said
    it stopped on SIGTERM, and the job ended with 143 as if preempted."""
    folder, config = work
    jobs = {
        cluster.sbatch(
            DPO,
            folder / "mistake_dp.out",
            ["--config", str(config), f"run_dir={folder / 'mistake_dp'}"]
            + ["parallel.data_parallel_size=1"],
            "--nodes=2",
        ): "config error: parallel.data_parallel_size=1 x TP x PP x CP = 1 but the job has 2 "
        "ranks: launch 1 ranks or drop parallel.data_parallel_size",
        cluster.sbatch(
            ONLINE,
            folder / "mistake_online.out",
            ["--config", "configs/online_smollm2_cpu.yaml", f"run_dir={folder / 'mistake_on'}"]
            + ["online.reward_model.path=", "online.judge=tests.online.standins:char_judge"]
            + ["online.samples_per_prompt=1"],
            "--nodes=2",
        ): "config error: online.samples_per_prompt=1 must be >= 2: a pair needs a best and a "
        "worst completion (online.samples_per_prompt set on the command line)",
    }
    for (job_id, line), out in zip(jobs.items(), ("mistake_dp.out", "mistake_online.out")):
        job = cluster.wait_done(job_id)
        log = (folder / out).read_text()
        assert (job["JobState"], job["ExitCode"]) == ("FAILED", "1:0"), log[-4000:]
        assert log.splitlines() == [line], log[-4000:]


def test_scancel_term_saves_every_rank_and_requeue_resumes_to_the_same_numbers(
    cluster, work, uninterrupted
):
    folder, config = work
    run_dir, out = folder / "dpo_preempted", folder / "preempted.out"
    job_id = cluster.sbatch(DPO, out, _dpo_args(config, run_dir), "--nodes=2")

    # 1. scancel --signal=TERM: slurmstepd signals every process of the step (launchers, ranks)
    _wait_for_step(run_dir, 2, job_id, cluster)
    cluster.run("scancel", "--signal=TERM", job_id)
    job = cluster.wait_done(job_id)
    log = out.read_text()
    assert (job["JobState"], job["ExitCode"]) == ("FAILED", "143:0"), log[-4000:]
    first = _stopped_step(log)
    # every rank is signalled; rank 0 alone says so, and each node's launcher ends in one line
    assert log.count("received SIGTERM: saving a checkpoint at the end of this step") == 1, log
    assert log.count("launcher: the job stopped on SIGTERM") == 2, log
    assert "Traceback" not in log, log
    assert (run_dir / "checkpoints" / f"iter_{first:07d}" / "train_state.json").exists()

    # 2. requeue: resumes from that checkpoint; scancel --batch --signal=TERM signals the batch
    # shell only (srun), as --signal=B:TERM@60 does: srun passes it on to the step
    cluster.requeue(job_id)
    _wait_for_step(run_dir, first + 2, job_id, cluster)
    cluster.run("scancel", "--batch", "--signal=TERM", job_id)
    job = cluster.wait_done(job_id)
    log = out.read_text()
    assert job["JobState"] == "FAILED" and job["Restarts"] == "1", log[-4000:]
    assert f"resumed from {run_dir}/checkpoints/iter_{first:07d} at step {first}" in log
    second = _stopped_step(log, after=first)

    # 3. requeue again: runs to the end with the uninterrupted numbers
    cluster.requeue(job_id)
    job = cluster.wait_done(job_id)
    log = out.read_text()
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), log[-4000:]
    assert f"resumed from {run_dir}/checkpoints/iter_{second:07d} at step {second}" in log
    assert _losses(run_dir) == uninterrupted[0]


def test_a_job_at_its_time_limit_saves_before_it_is_killed(cluster, time_limit_job):
    # (after the other tests but the lost node's: the job started with the module and its limit
    # was set once it trained, so by now it is at its limit or past it)
    job_id, run_dir, out, limited = time_limit_job
    limited.result()  # it trained (step 1) and got its 1-minute limit
    job = cluster.wait_done(job_id)
    log = out.read_text()
    assert job["JobState"] == "TIMEOUT", log[-4000:]
    assert "DUE TO TIME LIMIT" in log
    steps = re.findall(r"^stopped by SIGTERM after step (\d+): saved checkpoint", log, re.M)
    assert len(steps) == 1, log[-4000:]
    assert (run_dir / "checkpoints" / f"iter_{int(steps[0]):07d}" / "train_state.json").exists()
    # (the launchers' own lines may be lost here: srun stops forwarding output at the limit)
    assert "Traceback" not in log, log[-4000:]


def _job_processes(job_id: str, node: str | None = None) -> set[int]:
    """The job's processes (on ``node``, or on any node with their slurmstepd processes): its
    tasks, their children, their slurmstepd."""
    pids = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if node is None and cmdline.startswith(f"slurmstepd: [{job_id}.".encode()):
            pids.add(int(entry))
        if f"SLURM_JOB_ID={job_id}".encode() in env and (
            node is None or f"SLURMD_NODENAME={node}".encode() in env
        ):
            pids.add(int(entry))
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            try:
                if Path(f"/proc/{parent}/cmdline").read_bytes().startswith(b"slurmstepd"):
                    pids.add(parent)
            except OSError:
                pass
    return pids


def _start_after_the_resent_signal(c: Cluster, job_id: str, n2_log: Path, offset: int) -> None:
    """Start the requeued job once n2 has been sent the signal that did not reach it when it
    was lost: slurmctld resends it 60 s later (its RPC retry), and the same step id on n2 is
    then the new run's, which it would end (started at once, or 30 s after the requeue, the new
    run was seen killed so). Resends a second apart are awaited together. Where none comes,
    Slurm's own hold of a requeued job (cred_expire, 90 s on the test cluster) starts it."""
    deadline = time.monotonic() + 120
    # "sending signal 991 to StepId=J.0", "sending signal 15 to all steps job J", or, where no
    # process of the job is left on the node, "failed to get job_uid for job J"
    signal_line = re.compile(rf"_rpc_signal_tasks: .*(StepId={job_id}\.|job {job_id}\b)")
    seen = 0
    while time.monotonic() < deadline and c.job(job_id)["JobState"] == "PENDING":
        with n2_log.open(errors="replace") as f:
            f.seek(offset)
            count = len(signal_line.findall(f.read()))
        if count and count == seen:  # no new one for the last 3 s
            c.release(job_id)
            return
        seen = count
        time.sleep(3)


def test_a_lost_node_ends_the_job_and_the_requeued_job_resumes(cluster, work, uninterrupted):
    folder, config = work
    run_dir, out = folder / "dpo_lost_node", folder / "lost.out"
    job_id = cluster.sbatch(DPO, out, _dpo_args(config, run_dir), "--nodes=2")
    _wait_for_step(run_dir, 6, job_id, cluster)  # after the checkpoint of step 5
    pids = _job_processes(job_id, "n2")
    assert pids
    pids.add(int((cluster.state / "run" / "slurmd-n2.pid").read_text()))
    lost = time.monotonic()
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    # Slurm notices within SlurmdTimeout (10 s here) and requeues the job (--requeue)
    deadline = lost + 120
    while cluster.job(job_id)["Restarts"] == "0" or _job_processes(job_id):
        # no rank may be left hanging in a collective on n1
        assert time.monotonic() < deadline, (_job_processes(job_id), out.read_text()[-4000:])
        time.sleep(0.5)
    log = out.read_text()
    assert "srun: error: Node failure on n2" in log, log[-4000:]

    last = max(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("iter_*"))
    n2_log = cluster.state / "log" / "slurmd-n2.log"
    restarted_at = n2_log.stat().st_size
    started = cluster.cluster("start")  # the node comes back (ReturnToService=2)
    assert started.returncode == 0, started.stderr
    _start_after_the_resent_signal(cluster, job_id, n2_log, restarted_at)
    job = cluster.wait_done(job_id)
    log = out.read_text()
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), log[-4000:]
    assert f"resumed from {run_dir}/checkpoints/iter_{last:07d} at step {last}" in log
    assert _losses(run_dir) == uninterrupted[0]
