"""Fixtures shared by the test packages."""

import pytest


@pytest.fixture(scope="session")
def initial_checkpoint(tmp_path_factory):
    """One TP 1 x PP 1 checkpoint of the tiny model (``tests.engine.save_initial_checkpoint``),
    loaded by the layout-equality tests at every layout."""
    from tests.engine import save_initial_checkpoint
    from tests.multirank import run_ranks

    path = str(tmp_path_factory.mktemp("init") / "ckpt")
    run_ranks(save_initial_checkpoint, world_size=1, ckpt_dir=path)
    return path
