"""compat.torchrun_failure_logs: torch elastic's failure and forwarded-signal lines are held,
then dropped or released in order; every other record of the loggers passes at once."""

import logging

from dpo_megatron.compat.torchrun_failure_logs import HELD, HeldFailureLogs

LOGGER = "torch.distributed.elastic.multiprocessing.api"
AGENT = "torch.distributed.elastic.agent.server.api"


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _log_a_failure(logger):
    logging.getLogger(AGENT).warning("Received %s death signal, shutting down workers", 15)
    logger.warning("Sending process %s closing signal %s", 4242, "SIGTERM")
    logger.warning("something else torch elastic says")
    logger.error(
        "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s",
        2,
        0,
        4241,
        "/usr/bin/python",
    )


def test_held_then_released_in_order_or_dropped():
    # The messages are torch's own: the module that logs them still holds these templates.
    import inspect

    import torch.distributed.elastic.agent.server.api as agent
    import torch.distributed.elastic.multiprocessing.api as api

    for module in (api, agent):
        source = inspect.getsource(module)
        assert all(f'"{m}"' in source for m in HELD[module.logger.name])
    assert sorted(HELD) == sorted([LOGGER, AGENT]) == sorted([api.logger.name, agent.logger.name])

    logger = logging.getLogger(LOGGER)
    lines = _Lines()
    logger.addHandler(lines)
    logging.getLogger(AGENT).addHandler(lines)
    try:
        with HeldFailureLogs() as held:
            _log_a_failure(logger)
            assert lines.lines == ["something else torch elastic says"]
        assert lines.lines == [
            "something else torch elastic says",
            "Received 15 death signal, shutting down workers",
            "Sending process 4242 closing signal SIGTERM",
            "failed (exitcode: 2) local_rank: 0 (pid: 4241) of binary: /usr/bin/python",
        ]
        lines.lines = []
        with HeldFailureLogs() as held:
            _log_a_failure(logger)
            held.drop()
        assert lines.lines == ["something else torch elastic says"]
        _log_a_failure(logger)  # the filter is gone
        assert len(lines.lines) == 5
    finally:
        logger.removeHandler(lines)
        logging.getLogger(AGENT).removeHandler(lines)
