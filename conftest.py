"""pytest set-up shared by all tests: one thread per process (2-core machines run N ranks)."""

import gc
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: multi-rank or real-weights test (CI runs all)")


def pytest_collection_finish(session):
    # Every test module (torch, megatron-core, transformers) is imported by now: their objects
    # leave the collector's view, so the full collections megatron-core runs at each checkpoint
    # save or load in this process walk only what the tests made (tests/multirank.py does the
    # same in each rank).
    gc.freeze()
