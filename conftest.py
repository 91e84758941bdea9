"""pytest set-up shared by all tests: one thread per process (2-core machines run N ranks), and
the order in which ``pytest -n 2 --dist loadfile`` hands files to its workers."""

import collections
import gc
import multiprocessing.util
import os
import shutil
import tempfile

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

LONGEST_FILES = {
    "tests/training/test_durability.py": 310,
    "tests/test_slurm_cluster.py": 225,
    "tests/training/test_moe_dpo.py": 165,
    "tests/test_bench.py": 145,
    "tests/test_launcher.py": 95,
    "tests/training/test_bf16_architectures.py": 95,
    "tests/test_architecture_launches.py": 65,
    "tests/online/test_rounds.py": 65,
    "tests/training/test_shared_prompt.py": 60,
    "tests/training/test_bf16_objectives.py": 55,
    "tests/training/test_real_smollm2.py": 55,
    "tests/training/test_frontend_dpo_repo_runs.py": 50,
    "tests/training/test_device_boundary.py": 45,
    "tests/test_gpu_check.py": 45,
    "tests/training/test_reference.py": 45,
    "tests/training/test_context_parallel.py": 40,
    "tests/models/test_new_architectures.py": 40,
    "tests/planning/test_prediction.py": 40,
    "tests/online/test_launcher.py": 40,
    "tests/training/test_lifecycle.py": 40,
    "tests/checkpointing/test_vpp_checkpoints.py": 40,
    "tests/training/test_strict_device.py": 35,
    "tests/training/test_lora_lifecycle.py": 35,
    "tests/test_mistral_family_folders.py": 35,
    "tests/test_slurm.py": 30,
}
"""Seconds each file took in the last full run (all its tests, rounded up to 5 s; a run's
"slowest files" summary lists them; some figures here are estimates, from that run's 25 slowest
tests or after a file's waits were shortened): these files go to the workers first, longest
first, so that the last files handed out are short and both workers finish together. A file
missing here only starts later (after these, slow-marked files before the others)."""


def _own_temporary_folder(config) -> None:
    """Every temporary file of this process and of the processes it starts (the tests' run
    folders, torchrun's log folders, multiprocessing's sockets) goes into one folder, removed
    when the session ends: without it each suite run left thousands of folders in /tmp.
    pytest's own ``tmp_path`` folders stay where pytest keeps them (its last three runs)."""
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())
    # multiprocessing's own folder of this process first, where it was: its exit handler
    # removes it after this session's clean-up has run
    multiprocessing.util.get_temp_dir()
    folder = tempfile.mkdtemp(prefix="dpo-tests-")
    os.environ["TMPDIR"] = tempfile.tempdir = folder
    config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))


def pytest_configure(config):
    _own_temporary_folder(config)
    # Collection imports torch, megatron-core and transformers: no cyclic collection meanwhile
    # (dpo_megatron.utils.collector; resumed in pytest_collection_finish).
    gc.disable()
    # As every entry point does, before any test module imports megatron-core (on the CPU its
    # fusions stay plain functions: no TorchDynamo / inductor import in each test process).
    from dpo_megatron.compat import before_megatron_import

    before_megatron_import()
    config.addinivalue_line("markers", "slow: multi-rank or real-weights test (CI runs all)")
    # xdist's default sorts files by their number of tests, which hands the longest files (one
    # test of minutes each) out last, so one worker ends minutes after the other: keep ours.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(session, config, items):
    def weight(item) -> tuple[int, int]:
        path = item.nodeid.split("::", 1)[0]
        return LONGEST_FILES.get(path, 0), int(path in slow_files)

    slow_files = {i.nodeid.split("::", 1)[0] for i in items if i.get_closest_marker("slow")}
    items.sort(key=weight, reverse=True)  # stable: a file's tests keep their order


def pytest_collection_finish(session):
    # Every test module (torch, megatron-core, transformers) is imported by now: their objects
    # leave the collector's view, so the full collections megatron-core runs at each checkpoint
    # save or load in this process walk only what the tests made (tests/multirank.py does the
    # same in each rank).
    gc.collect()
    gc.freeze()
    gc.enable()


_FILE_SECONDS: collections.Counter = collections.Counter()
"""Seconds each test file took in this run (set-up, call and tear-down of all its tests), as
the reports reach this process (with xdist: the controller, from both workers)."""


def pytest_runtest_logreport(report):
    _FILE_SECONDS[report.nodeid.split("::", 1)[0]] += report.duration


def pytest_terminal_summary(terminalreporter):
    """The slowest files, to keep LONGEST_FILES current: printed only for a run of more than
    one file taking over a minute in all."""
    if len(_FILE_SECONDS) < 2 or sum(_FILE_SECONDS.values()) < 60:
        return
    terminalreporter.write_sep("=", "slowest files (all phases; conftest.py's LONGEST_FILES)")
    for path, seconds in _FILE_SECONDS.most_common(30):
        terminalreporter.write_line(f"{seconds:8.1f}s {path}")
