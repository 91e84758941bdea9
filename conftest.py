"""pytest set-up shared by all tests: one thread per process (2-core machines run N ranks)."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: multi-rank or real-weights test (CI runs all)")
