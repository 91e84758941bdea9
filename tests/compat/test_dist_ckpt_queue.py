"""compat.dist_ckpt_queue: a synchronous save uses an in-process queue, so an entry script
without a ``__main__`` guard saves instead of hanging in a spawned Manager that re-runs it."""

import os
import queue
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_patch_installs_a_plain_queue():
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from dpo_megatron.compat import dist_ckpt_queue

    assert dist_ckpt_queue.use_in_process_results_queue() is True
    assert isinstance(filesystem_async._results_queue, queue.Queue)


@pytest.mark.slow
def test_a_script_without_main_guard_saves(tmp_path):
    script = tmp_path / "no_guard.py"
    script.write_text(
        textwrap.dedent(f"""
        from dpo_megatron.checkpointing import save_model_checkpoint
        from dpo_megatron.models import ModelConfig, build_model_chunks
        from dpo_megatron.parallel import ParallelConfig, initialize_distributed
        initialize_distributed(ParallelConfig())
        save_model_checkpoint(build_model_chunks(ModelConfig(), ParallelConfig()),
                              {str(tmp_path / "ckpt")!r})
        print("saved")
    """)
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    out = subprocess.run(
        [sys.executable, str(script)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        env={**env, "PYTHONPATH": ROOT},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("saved")
    assert (tmp_path / "ckpt" / "metadata.json").is_file()
