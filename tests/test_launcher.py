"""scripts/pretrain_dpo.sh: launches torchrun itself, and runs in place under torchrun --no-python;
its pre-check stops every config or data mistake with one line before any rank starts; the
scripts' --help texts; the exporter names the checkpoint it loads."""

import glob
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import time

import pytest

from tests.scripts import LAUNCH_VARIABLES, launcher_env, run_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(cmd, run_dir, env=None):
    out = subprocess.run(
        cmd + [f"run_dir={run_dir}"],
        cwd=ROOT,
        env=launcher_env(**(env or {})),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"\[train\] step \d+/2 \| loss ([0-9.]+)", out.stdout)]
    assert len(losses) == 2, out.stdout[-3000:]
    assert abs(losses[0] - math.log(2)) < 1e-4  # printed to 4 decimals
    assert os.path.isdir(os.path.join(run_dir, "checkpoints", "iter_0000002"))
    assert "layout TP" in out.stdout
    return out.stdout


@pytest.mark.slow
def test_under_torchrun_no_python_pp2(tmp_path):
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    stdout = _run(
        [
            torchrun,
            "--nproc-per-node",
            "2",
            "--no-python",
            "scripts/pretrain_dpo.sh",
            "--config",
            "configs/tiny_cpu.yaml",
            "parallel.pipeline_model_parallel_size=2",
        ],
        str(tmp_path / "run"),
        env={"DPO_MEGATRON_HOST_MALLOC": "release"},
    )
    # One job of 2 ranks (no nested launch): one layout line, PP 2.
    assert stdout.count("layout TP") == 1 and "TP 1 x PP 2 x DP 1" in stdout
    if platform.libc_ver()[0] == "glibc":  # opted in: each rank restarted with the tunables
        assert "on cpu (host malloc: mmap_threshold=4194304, hugetlb=1) |" in stdout, stdout
    else:
        assert "on cpu (host malloc: the C library's default) |" in stdout, stdout


# ---------------------------------------------------------------------------------------------
# Config and data mistakes stop the launcher with one line


_script = run_script


def _error_lines(stderr):
    return [line for line in stderr.splitlines() if "error" in line.lower()]


@pytest.mark.slow
def test_ipo_shorthand_trains_ipo_through_the_launcher_at_tp2(tmp_path):
    """The launcher starts its own 2 ranks (TP 2) and ``loss=ipo loss.beta=0.1`` trains IPO: its
    step-0 loss is (0 - 1/(2 x 0.1))^2 = 25 (Azar et al. 2023, eq. 17), computed from TP-reduced
    log-probs; the step's checkpoint is written (pipeline stages through the launcher: the
    torchrun --no-python test above). Sigmoid DPO would start at ln 2 = 0.6931 instead."""
    out = _script(
        "scripts/pretrain_dpo.sh",
        "--config",
        "configs/tiny_cpu.yaml",
        "loss=ipo",
        "loss.beta=0.1",
        "train.train_iters=1",
        "parallel.tensor_model_parallel_size=2",
        f"run_dir={tmp_path / 'run'}",
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    losses = re.findall(r"\[train\] step 1/1 \| loss ([0-9.]+)", out.stdout)
    assert losses == ["25.0000"], out.stdout[-3000:]
    assert "| loss ipo(beta=0.1, average_logps=True) |" in out.stdout  # not a Python repr
    assert "TP 2 x PP 1 x DP 1" in out.stdout
    assert (tmp_path / "run" / "checkpoints" / "iter_0000001" / "manifest.json").is_file()


def test_config_mistake_stops_the_launcher_with_one_line():
    """``train.log_interval=0`` stops the launcher with one config error, before any rank
    starts (the ranks would die of ZeroDivisionError)."""
    out = _script(
        "scripts/pretrain_dpo.sh", "--config", "configs/tiny_cpu.yaml", "train.log_interval=0"
    )
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        "config error: train.log_interval=0 must be >= 1 (train.log_interval set on the command "
        "line)"
    ]
    assert "torch.distributed" not in out.stderr and out.stdout == ""


def test_a_host_malloc_typo_stops_the_launcher_with_one_line():
    out = _script(
        "scripts/pretrain_dpo.sh",
        "--config",
        "configs/tiny_cpu.yaml",
        env={"DPO_MEGATRON_HOST_MALLOC": "relase"},
    )
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        "error: DPO_MEGATRON_HOST_MALLOC='relase': expected one of trim, release, system "
        "(unset means trim)"
    ]
    assert "torch.distributed" not in out.stderr and out.stdout == ""


def test_missing_data_stops_the_launcher_with_one_line(tmp_path):
    """A missing data file stops the launcher with one line naming it, before any rank starts
    (no FileNotFoundError traceback per rank, no torchrun failure block)."""
    out = _script(
        "scripts/pretrain_dpo.sh",
        "--config",
        "configs/tiny_cpu.yaml",
        f"data.path={tmp_path}/missing.jsonl",
    )
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        f"error: data file {tmp_path}/missing.jsonl does not exist"
    ]


def test_a_cut_weights_file_stops_the_launcher_with_one_line_naming_it(tmp_path):
    """``model.hf_path``'s weight files are checked before any rank starts: a safetensors file
    cut to half (else every rank stops at safetensors' "incomplete metadata", which names no
    file) ends in one line naming it, with its size against its header's, exit status 1. (The
    pre-check's other refusals, a pickled ``.bin`` among them, are unit tests of
    ``check_hf_weights`` in tests/models/test_conversion_errors.py.)"""
    from tests.models.conversion_helpers import save_tiny_hf_folder

    folder = save_tiny_hf_folder("llama", str(tmp_path / "hf"))
    weights = os.path.join(folder, "model.safetensors")
    data = open(weights, "rb").read()
    open(weights, "wb").write(data[: len(data) // 2])
    out = _script(
        "scripts/pretrain_dpo.sh",
        "--config",
        "configs/tiny_cpu.yaml",
        f"model.hf_path={folder}",
        f"run_dir={tmp_path / 'run'}",
    )
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == [
        f"config error: {weights}: not a complete safetensors file: {len(data) // 2} bytes, its "
        f"header describes {len(data)} (cut short: copy or download it again)"
    ]
    assert out.stdout == "" and not (tmp_path / "run").exists()


@pytest.mark.slow
def test_error_found_while_tokenizing_stops_the_launcher_too(tmp_path):
    """A chat-template mistake shows only when the data is tokenized: the pre-check tokenizes
    (into the cache the ranks read), so it too ends in one line before any rank starts, with no
    traceback from any rank and no torchrun failure block."""
    from tests.scripts import load_script

    ensure_sentencepiece_model = load_script("assets").ensure_sentencepiece_model

    out = _script(
        "scripts/pretrain_dpo.sh",
        "--config",
        "configs/tiny_cpu.yaml",
        f"data.tokenizer={ensure_sentencepiece_model()}",
        f"data.cache_dir={tmp_path}",
        env={"HF_DATASETS_DISABLE_PROGRESS_BARS": "1"},
    )
    assert out.returncode == 1
    assert _error_lines(out.stderr) == [
        "error: conversational data needs a chat template: the tokenizer has none; set "
        "data.chat_template (chatml, mistral or a Jinja file)"
    ], out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "ChildFailedError" not in out.stderr


@pytest.mark.slow
def test_rank_side_data_error_is_one_line(tmp_path):
    """Under another launcher (here one process, no pre-check) a data error is printed once,
    plainly, with the exit status of a reported mistake (dpo_megatron.utils.exits.USER_ERROR_EXIT,
    which scripts/pretrain_dpo.sh turns into 1), not a traceback ending in the message."""
    from tests.scripts import load_script

    ensure_sentencepiece_model = load_script("assets").ensure_sentencepiece_model
    from dpo_megatron.utils.exits import USER_ERROR_EXIT

    env = launcher_env(PYTHONPATH=ROOT, HF_DATASETS_DISABLE_PROGRESS_BARS="1")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "dpo_megatron.train",
            "--config",
            "configs/tiny_cpu.yaml",
            f"data.tokenizer={ensure_sentencepiece_model()}",
            "data.cache_dir=none",
            f"run_dir={tmp_path}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == USER_ERROR_EXIT == 2
    assert _error_lines(out.stderr) == [
        "error: conversational data needs a chat template: the tokenizer has none; set "
        "data.chat_template (chatml, mistral or a Jinja file)"
    ], out.stderr[-3000:]
    assert "Traceback" not in out.stderr


def test_help_texts_and_key_listing(tmp_path):
    """Each script's ``--help`` prints its own text and exits (``setup.sh --help`` installs
    nothing; ``pretrain_sft.sh --help`` is the SFT text), and the key list it points to exists."""
    setup = _script(
        "scripts/setup.sh", "--help", env={"PYTHON": "/bin/false"}
    )  # an install would fail
    assert setup.returncode == 0 and setup.stdout.startswith("Set up a fresh machine")
    sft = _script("scripts/pretrain_sft.sh", "--help")
    assert sft.returncode == 0 and sft.stdout.startswith("Launch the SFT stage")
    assert "the SFT loss has no parameters" in sft.stdout
    rm = _script("scripts/train_reward_model.sh", "--help")
    assert rm.returncode == 0 and rm.stdout.startswith("Train a Bradley-Terry reward model")
    assert "loss.center_rewards_coefficient (0)" in rm.stdout
    online = _script("scripts/iterative_dpo.sh", "--help")
    assert online.returncode == 0 and online.stdout.startswith("Launch iterative (online) DPO")
    dpo = _script("scripts/pretrain_dpo.sh", "--help")
    assert (
        dpo.returncode == 0
        and dpo.stdout.startswith("Launch DPO training")
        and "--list-keys" in dpo.stdout
    )
    keys = _script("scripts/pretrain_dpo.sh", "--list-keys")
    assert keys.returncode == 0 and "train.global_batch_size (int, default 4)" in keys.stdout
    # the script's default config sets its own run_dir: that is the default it runs with
    assert keys.stdout.startswith(
        "run_dir (str, default 'runs/dpo_smollm2_cpu' in configs/dpo_smollm2_cpu.yaml; "
        "'runs/dpo' without a config file)\n"
    )


def test_exporter_names_the_checkpoint_it_loads(tmp_path):
    """The exporter names the checkpoint it loads (its step and run), not only ``wrote OUT``: a
    run's checkpoints folder written by another run is then seen before its weights go out. A
    checkpoint outside a run's checkpoints folder is named by its run id, not by the folder
    above it (which is no run)."""
    import json

    from tests.scripts import load_script

    module = load_script("convert_megatron_to_hf")
    ckpt = tmp_path / "runs" / "dpo" / "checkpoints" / "iter_0000012"
    ckpt.mkdir(parents=True)
    (ckpt / "train_state.json").write_text(json.dumps({"step": 12}))
    assert module.describe_checkpoint(str(ckpt)) == (
        f"checkpoint {ckpt} (step 12 of run {tmp_path / 'runs' / 'dpo'})"
    )
    # A checkpoint outside a run's checkpoints folder (checkpoint.save, a copy): the folder
    # above it is no run, the run id in its train_state.json says whose it is.
    copied = tmp_path / "copied" / "iter_0000004"
    copied.mkdir(parents=True)
    (copied / "train_state.json").write_text(json.dumps({"step": 4, "run_id": "20250101-x"}))
    assert module.describe_checkpoint(str(copied)) == (
        f"checkpoint {copied} (step 4 of run id 20250101-x)"
    )
    converted = tmp_path / "converted"
    converted.mkdir()
    assert module.describe_checkpoint(str(converted)) == (
        f"checkpoint {converted} (not a training checkpoint: no train_state.json)"
    )


def test_readme_commands_run_from_the_venv_and_keep_their_own_run_dir():
    """Every documented command (the bash blocks of README.md and of the docs/ topic pages, and
    the README's command table) starts with a launcher script, ``bash``, ``sbatch`` or
    ``.venv/bin/``, so it runs without an activated venv; the SFT -> DPO example names its own
    run_dir, so it never writes into the main job's (whose next export would take its weights).
    docs/BENCHMARKS.md is left out: it records the commands of past runs as they were run."""
    pages = [os.path.join(ROOT, "README.md")] + [
        page
        for page in sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
        if os.path.basename(page) != "BENCHMARKS.md"
    ]
    texts = []
    for page in pages:
        with open(page, encoding="utf-8") as f:
            texts.append(f.read())
    readme = texts[0]
    commands = [
        line.strip()
        for text in texts
        for block in re.findall(r"```bash\n(.*?)```", text, re.S)
        for line in block.replace("\\\n", " ").splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    table = readme.split("## Commands", 1)[1].split("\n## ", 1)[0]
    table_commands = re.findall(r"^\| [^|]+ \| `([^`]+)`", table, re.M)
    assert len(table_commands) >= 12, table_commands
    commands += table_commands
    for command in commands:
        words = command.split()
        while re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):  # an environment prefix
            words = words[1:]
        first = words[0]
        assert first in (
            "bash",
            "scripts/pretrain_dpo.sh",
            "scripts/pretrain_sft.sh",
            "scripts/iterative_dpo.sh",
            "scripts/train_reward_model.sh",
            "sbatch",
        ) or first.startswith(".venv/bin/"), command
    from_sft = [c for c in commands if c.startswith("scripts/pretrain_dpo.sh model.load=runs/sft")]
    assert from_sft and all("run_dir=" in c for c in from_sft)
    assert "dequantised" in readme and "4-bit" in readme


# ---------------------------------------------------------------------------------------------
# A mistake met on the ranks (dpo_megatron/launch.py)


def _ended(ending, tmp_path, **env):
    """scripts/pretrain_dpo.sh at 2 ranks running tests/launcher_entry.py's ``ending``."""
    return _script(
        "scripts/pretrain_dpo.sh",
        "--config",
        "configs/tiny_cpu.yaml",
        "parallel.tensor_model_parallel_size=2",
        "data.cache_dir=none",
        f"run_dir={tmp_path / 'run'}",
        env={
            "DPO_MEGATRON_ENTRY": "tests.launcher_entry",
            "DPO_TEST_ENDING": ending,
            "PYTHONPATH": ROOT,
            **env,
        },
    )


@pytest.mark.slow
def test_a_mistake_met_on_the_ranks_ends_with_its_line_and_a_pointer(tmp_path):
    """A mistake met on the ranks ends with rank 0's one ``error:`` line and the launcher's
    pointer at train.log: no closing-signal or ``failed (exitcode: 1)`` log line, no torchrun
    traceback or ChildFailedError block, and rank 1 exiting first never cuts rank 0 off before
    it prints the line."""
    from tests.launcher_entry import MISTAKE

    out = _ended("mistake", tmp_path)
    assert out.returncode == 1, out.stderr[-3000:]
    assert out.stderr.splitlines() == [
        MISTAKE,
        "launcher: the job stopped at the line above (rank 0; the other 1 rank(s) were stopped)",
    ]


@pytest.mark.slow
def test_a_mistake_met_by_one_rank_alone_is_printed_by_that_rank(tmp_path):
    """Rank 0 runs on (here: sleeps 300 s): rank 1 waits RANK0_GRACE_S for it (here shortened
    to RANK1_GRACE_S), then prints the line itself and exits; torchrun stops rank 0."""
    from tests.launcher_entry import MISTAKE, RANK1_GRACE_S

    fail_time = tmp_path / "fail_time"
    out = _ended("mistake_on_rank1", tmp_path, DPO_TEST_FAIL_TIME=str(fail_time))
    ended = time.time()
    assert out.returncode == 1, out.stderr[-3000:]
    assert out.stderr.splitlines() == [
        MISTAKE,
        "launcher: the job stopped at the line above (rank 1; the other 1 rank(s) were stopped)",
    ]
    # rank 1 waited the grace before its line; rank 0 (300 s asleep) was stopped
    assert RANK1_GRACE_S <= ended - float(fail_time.read_text()) < 300


@pytest.mark.slow
def test_a_converter_mistake_under_the_launcher_is_one_line(tmp_path):
    """The converters end a mistake through ``utils.exits.fail``: under the launcher at 2 ranks
    the job ends with rank 0's line and the launcher's, exit status 1 (no line per rank, no
    torchrun block, and no usage text from reading the converter's flags as a config command's
    to look for a train.log)."""
    missing = tmp_path / "missing"
    out = subprocess.run(
        [sys.executable, "-m", "dpo_megatron.launch", "--nproc-per-node", "2"]
        + ["scripts/convert_hf_to_megatron.py", "--hf-path", str(missing)]
        + ["--save", str(tmp_path / "ckpt")],
        cwd=ROOT,
        env=launcher_env(PYTHONPATH=ROOT),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 1, out.stderr[-3000:]
    assert out.stderr.splitlines() == [
        f"error: --hf-path {missing}/config.json: no config.json (model.hf_path must be a "
        "Hugging Face model folder)",
        "launcher: the job stopped at the line above (rank 0; the other 1 rank(s) were stopped)",
    ]


@pytest.mark.slow
def test_a_crash_on_the_ranks_keeps_its_traceback_and_torchruns_block(tmp_path):
    out = _ended("crash", tmp_path)
    assert out.returncode == 1
    assert out.stderr.count("Traceback (most recent call last)") >= 2  # a rank's and torchrun's
    assert "RuntimeError: a bug on rank " in out.stderr
    assert "torch.distributed.elastic.multiprocessing.errors.ChildFailedError" in out.stderr
    assert "tests.launcher_entry FAILED" in out.stderr and "exitcode  : 1" in out.stderr
    assert "failed (exitcode: 1)" in out.stderr  # torch elastic's log line, released
    assert "launcher:" not in out.stderr


def test_a_run_dir_refusal_comes_in_seconds_before_any_heavy_import(tmp_path):
    """Re-running a finished run's command (a fresh run over its folder) is refused by the
    launcher's pre-check, and by rank 0 of ``dpo_megatron.train`` under another launcher, before
    torch / megatron-core / the data are loaded: one line, nothing changed, in seconds (not
    once the ranks have started)."""
    from dpo_megatron.utils.exits import USER_ERROR_EXIT

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "split": "train", "loss": 0.5}\n')
    (run_dir / "train.log").write_text("the earlier run's log\n")
    message = (
        f"error: run_dir {run_dir} already holds a run (metrics.jsonl with 1 record(s)): "
        f"refusing to mix a fresh run into it (nothing was changed). Continue that run with "
        f"checkpoint.resume=auto, start afresh with checkpoint.overwrite=true (the old run moves "
        f"to {run_dir}.replaced-<time>), or choose another run_dir"
    )
    started = time.monotonic()
    out = _script(
        "scripts/pretrain_dpo.sh",
        "--config",
        "configs/tiny_cpu.yaml",
        "parallel.tensor_model_parallel_size=2",
        f"run_dir={run_dir}",
    )
    assert time.monotonic() - started < 15
    assert out.returncode == 1 and out.stderr.splitlines() == [message], out.stderr[-3000:]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    started = time.monotonic()
    ranks = subprocess.run(
        [
            sys.executable,
            "-m",
            "dpo_megatron.train",
            "--config",
            "configs/tiny_cpu.yaml",
            f"run_dir={run_dir}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert time.monotonic() - started < 15
    assert ranks.returncode == USER_ERROR_EXIT and ranks.stderr.splitlines() == [message]
    assert (run_dir / "train.log").read_text() == "the earlier run's log\n"
    assert sorted(os.listdir(run_dir)) == ["metrics.jsonl", "train.log"]


@pytest.mark.slow
def test_a_world_size_that_does_not_fit_the_layout_is_one_line(tmp_path):
    """3 ranks for TP 2: every rank finds it before the heavy imports; rank 0 alone prints it.
    Through the launcher: that line and the pointer, exit status 1; under a plain torchrun the
    same single line, then torchrun's own report of exit code 2; no ValueError traceback from
    any rank."""
    args = [
        "-m",
        "dpo_megatron.train",
        "--config",
        "configs/tiny_cpu.yaml",
        "parallel.tensor_model_parallel_size=2",
        f"run_dir={tmp_path / 'run'}",
    ]
    env = launcher_env(PYTHONPATH=ROOT)
    line = (
        "config error: world size 3 is not divisible by parallel.tensor_model_parallel_size "
        "(2) x parallel.pipeline_model_parallel_size (1) x parallel.context_parallel_size (1)"
        " = 2: launch a multiple of 2 ranks"
    )
    ours = subprocess.run(
        [sys.executable, "-m", "dpo_megatron.launch", "--standalone", "--nproc-per-node=3", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ours.returncode == 1
    assert ours.stderr.splitlines() == [
        line,
        "launcher: the job stopped at the line above (rank 0; the other 2 rank(s) were stopped)",
    ], ours.stderr[-3000:]
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    theirs = subprocess.run(
        [torchrun, "--standalone", "--nproc-per-node=3", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert theirs.returncode == 1
    assert theirs.stderr.count(line) == 1 and "ValueError" not in theirs.stderr
    assert "exitcode  : 2" in theirs.stderr  # torchrun's own block: not ours to change


@pytest.mark.parametrize("fault", ["checksum", "disk", "nan"])
def test_a_fault_of_the_run_is_one_line_with_its_own_status(tmp_path, monkeypatch, capsys, fault):
    """The faults a run meets and reports (a checkpoint failing verification, a full disk, the
    NaN stop) end a rank with their ``error:`` line and ``FAULT_EXIT`` (3), which the launcher
    passes on (a mistake's 2 becomes 1); no uncaught exception, no traceback per rank."""
    import dpo_megatron.cli.train as train_module
    from dpo_megatron.checkpointing.integrity import CheckpointIntegrityError
    from dpo_megatron.checkpointing.storage import CheckpointSaveError
    from dpo_megatron.parallel.shutdown import NonFiniteLossError
    from dpo_megatron.utils.exits import FAULT_EXIT, LAUNCHER_EXITS

    error = {
        "checksum": CheckpointIntegrityError("/r/iter_0000002", ["a.distcp: changed"]),
        "disk": CheckpointSaveError(
            "saving checkpoint /r/iter_0000004 failed: no space "
            "left on device writing /r/iter_0000004.tmp/a.distcp"
        ),
        "nan": NonFiniteLossError("2 steps in a row (up to step 4) had a NaN/Inf loss"),
    }[fault]

    def train(cfg):
        raise error

    monkeypatch.setattr(train_module, "train", train)
    for k in LAUNCH_VARIABLES:
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(SystemExit) as stopped:
        train_module.main(["--config", "configs/tiny_cpu.yaml", f"run_dir={tmp_path}"])
    assert stopped.value.code == FAULT_EXIT == LAUNCHER_EXITS[FAULT_EXIT] == 3
    assert capsys.readouterr().err.splitlines() == [f"error: {error}"]


def test_a_run_folder_read_only_from_the_start_is_a_fault_of_the_run(tmp_path, monkeypatch, capsys):
    """A run folder on a read-only disk: rank 0's opening of it (the first thing the trainer
    does) ends every rank with one line naming the file and ``FAULT_EXIT`` (3), as the README
    lists a read-only disk. Shown in one process, the ranks' own path (``RunFolder.open``, then
    ``dpo_megatron.train``'s ending): the launcher adds its pointer and passes the 3 on for
    any fault (``tests/training/test_durability.py``, the folder turning read-only mid-run)."""
    import dpo_megatron.cli.train as train_module
    from dpo_megatron.training.run_dir import RunFolder
    from dpo_megatron.utils.exits import FAULT_EXIT
    from tests.checkpointing.test_storage import small_tmpfs

    with small_tmpfs(tmp_path / "disk", "1m") as disk:
        (disk / "run").mkdir()
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        monkeypatch.setattr(train_module, "train", RunFolder.open)
        for k in LAUNCH_VARIABLES:
            monkeypatch.delenv(k, raising=False)
        with pytest.raises(SystemExit) as stopped:
            train_module.main(["--config", "configs/tiny_cpu.yaml", f"run_dir={disk / 'run'}"])
        assert stopped.value.code == FAULT_EXIT == 3
        assert capsys.readouterr().err.splitlines() == [
            f"error: cannot write run_dir {disk / 'run'}: read-only file system: cannot write "
            f"{disk / 'run' / 'run.lock'}; nothing was started"
        ]


@pytest.mark.slow
def test_the_second_of_two_runs_on_a_folder_does_not_point_at_the_first_runs_log(tmp_path):
    """Two runs started on one run folder at once both pass the launcher's pre-check; the
    second one's rank 0 then finds the folder taken (here: this process holds it, as the first
    run does, and the pre-check is skipped). Its launcher line must not send the user to
    ``<run_dir>/train.log``, which holds the first run's output only."""
    from dpo_megatron.config import load_config
    from dpo_megatron.training.run_dir import RunFolder

    run_dir = tmp_path / "run"
    args = ["--config", "configs/tiny_cpu.yaml", "parallel.tensor_model_parallel_size=2"]
    first = RunFolder.open(load_config(args[1], [*args[2:], f"run_dir={run_dir}"]))
    try:
        out = _script(
            "scripts/pretrain_dpo.sh",
            *args,
            f"run_dir={run_dir}",
            env={"DPO_MEGATRON_PRECHECK": "-c print(2)"},  # as if it ran before the first took it
        )
    finally:
        first.close()
    assert out.returncode == 1, out.stderr[-3000:]
    refusal, pointer = out.stderr.splitlines()
    assert refusal.startswith(f"error: run_dir {run_dir} is in use by another run (pid ")
    assert f"(pid {os.getpid()} on " in refusal
    assert pointer == (
        "launcher: the job stopped at the line above (rank 0; the other 1 rank(s) were "
        f"stopped); {run_dir / 'train.log'} holds no output of this job"
    )
