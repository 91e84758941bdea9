"""compat.torchrun_repeated_signal: torch elastic's agent raises at its first death signal only;
a repeated SIGTERM (SLURM sends more than one) no longer aborts its wait for the workers' save."""

import importlib
import signal

import pytest

from dpo_megatron.compat.torchrun_repeated_signal import MODULE, RepeatedSigtermIgnored


def test_only_the_first_signal_raises_and_a_later_sigint_still_does(capsys):
    api = importlib.import_module(MODULE)
    original = api._terminate_process_handler
    with pytest.raises(api.SignalException):  # unpatched: every SIGTERM raises
        original(signal.SIGTERM, None)
    with RepeatedSigtermIgnored() as patch:
        handler = api._terminate_process_handler
        assert handler is not original
        with pytest.raises(api.SignalException) as first:
            handler(signal.SIGTERM, None)
        assert first.value.sigval == signal.SIGTERM and patch.received == signal.SIGTERM
        assert handler(signal.SIGTERM, None) is None  # the repeat: ignored
        assert "SIGTERM again: still waiting for the ranks" in capsys.readouterr().err
        with pytest.raises(api.SignalException) as second:  # a second Ctrl-C stops at once
            handler(signal.SIGINT, None)
        assert second.value.sigval == signal.SIGINT
    assert api._terminate_process_handler is original
