"""The command layer's exit table: every exception it names exists, each stop ends a command with
its one line and status (a fault 3, a mistake 2 in the ranks and 1 on the launcher's side), a
config's other ``ValueError`` / ``OSError`` is a ``config error`` only while the config is read,
and anything else keeps its traceback."""

from __future__ import annotations

import importlib

import pytest

from dpo_megatron.cli import command
from dpo_megatron.utils.exits import FAULT_EXIT, USER_ERROR_EXIT


def test_every_exception_the_table_names_exists():
    """The table names its exceptions by module and class (no torch import for a config
    mistake): a rename must fail here, not leave a stop unmatched."""
    for stop in (*command.STOPS, command.CONFIG_STOP):
        for name in stop.errors:
            module, _, cls = name.rpartition(".")
            assert issubclass(getattr(importlib.import_module(module), cls), BaseException), name


def _errors():
    from dpo_megatron.checkpointing.integrity import CheckpointIntegrityError
    from dpo_megatron.checkpointing.storage import CheckpointSaveError
    from dpo_megatron.data.sources import DataError, MissingDataError
    from dpo_megatron.online.adapters import JudgeError
    from dpo_megatron.parallel.host_malloc import HostMallocError
    from dpo_megatron.parallel.shutdown import NonFiniteLossError, RunInterrupted
    from dpo_megatron.training.run_dir import RunDirError

    return {
        "checksum": (CheckpointIntegrityError("/r/iter_0000002", ["a: changed"]), FAULT_EXIT),
        "disk": (CheckpointSaveError("no space left writing /r/a.distcp"), FAULT_EXIT),
        "nan": (NonFiniteLossError("2 steps in a row had a NaN/Inf loss"), FAULT_EXIT),
        "row": (DataError("pairs.jsonl, row 3: field 'chosen' is missing"), USER_ERROR_EXIT),
        "missing": (MissingDataError("data file d.jsonl does not exist"), USER_ERROR_EXIT),
        "folder": (RunDirError("runs/x is in use by pid 7"), USER_ERROR_EXIT),
        "judge": (JudgeError("online.judge=m:f returned 3 scores for 4"), USER_ERROR_EXIT),
        "malloc": (HostMallocError("DPO_MEGATRON_HOST_MALLOC='on'"), USER_ERROR_EXIT),
        "interrupted": (RunInterrupted(15, 4, "/r/iter_0000004", True), None),
    }


@pytest.mark.parametrize("case", list(_errors()))
def test_each_stop_has_its_line_prefix_and_status(case):
    error, status = _errors()[case]
    for config in (False, True):
        stop = command.stop_for(error, config=config)
        if status is None:  # a signal's stop is the run's own: 128 + N, already said
            assert stop is None
        else:
            assert (stop.prefix, stop.status) == ("error", status)


def test_a_config_mistake_is_a_config_error_only_while_the_config_is_read():
    for error in (ValueError("train.log_interval=0 must be >= 1"), FileNotFoundError("x")):
        assert command.stop_for(error) is None  # a bug of the run: its traceback
        stop = command.stop_for(error, config=True)
        assert (stop.prefix, stop.status) == ("config error", USER_ERROR_EXIT)
    own = command.stop_for(ValueError("line 2: no completion"), mistakes=(ValueError,))
    assert (own.prefix, own.status) == ("error", USER_ERROR_EXIT)
    assert command.stop_for(KeyError("x"), config=True) is None
    assert command.stop_for(KeyboardInterrupt(), config=True) is None


def test_the_ending_in_the_ranks_and_on_the_launchers_side(capsys, monkeypatch):
    """In a rank (no launcher here: rank 0) the line goes to stderr and the status is the
    table's; on the launcher's side a mistake is the launcher's 1, its line the exit message."""
    for variable in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(variable, raising=False)
    with pytest.raises(SystemExit) as ended, command.stops(config=True):
        raise ValueError("train.log_interval=0 must be >= 1")
    assert ended.value.code == USER_ERROR_EXIT
    assert capsys.readouterr().err == "config error: train.log_interval=0 must be >= 1\n"
    with pytest.raises(SystemExit) as ended, command.stops(config=True, launcher=True):
        raise ValueError("train.log_interval=0 must be >= 1")
    assert ended.value.code == "config error: train.log_interval=0 must be >= 1"  # status 1
    with pytest.raises(KeyError), command.stops(config=True):
        raise KeyError("a bug")


def test_a_rank_stopping_on_a_signal_ends_quietly_at_a_broken_collective(monkeypatch):
    """A rank's run (``run_in_ranks``, every rank command's) that caught SIGINT and then meets a
    collective broken by a peer's exit ends with 130 and no traceback; without a signal caught
    the same error propagates (a fault the user did not ask for)."""
    import signal

    from dpo_megatron.parallel import shutdown

    def broken():
        raise RuntimeError("Connection reset by peer")

    ended = []

    def exit_now(status):
        ended.append(status)
        raise SystemExit(status)

    monkeypatch.setattr(shutdown.os, "_exit", exit_now)
    monkeypatch.setattr(shutdown, "_received", 0)  # kept by an earlier test's caught signal
    with pytest.raises(RuntimeError, match="Connection reset"):
        command.run_in_ranks(broken)
    monkeypatch.setattr(shutdown, "_received", int(signal.SIGINT))
    with pytest.raises(SystemExit):
        command.run_in_ranks(broken)
    assert ended == [128 + signal.SIGINT]


@pytest.mark.parametrize(
    ("module", "argv", "prog", "described_by"),
    [
        ("train", [], "python -m dpo_megatron.train", "train"),
        ("generate", [], "python -m dpo_megatron.generate", "generate"),
        ("score", [], "python -m dpo_megatron.score", "score"),
        ("plan", [], "python -m dpo_megatron.plan", "plan"),
        ("check", [], "python -m dpo_megatron.config", "check"),
        ("online", [], "python -m dpo_megatron.online.run", "online"),
        ("online", ["--check"], "python -m dpo_megatron.online.run --check", "check"),
    ],
)
def test_each_command_help_names_how_it_is_run_in_whole_sentences(
    module, argv, prog, described_by, capsys
):
    """A command's ``--help``: the usage line starts with how the command is run (not the
    file's name), the description is its docstring's whole first paragraph (a sentence, not
    the first line cut at a colon; an online run's pre-check is the pre-check's), and
    ``--config`` takes any path."""
    cli = importlib.import_module(f"dpo_megatron.cli.{module}")
    with pytest.raises(SystemExit) as stop:
        cli.main([*argv, "--help"])
    assert stop.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert out.startswith(f"usage: {prog} [-h] [--config FILE]")
    first = command.description(importlib.import_module(f"dpo_megatron.cli.{described_by}").__doc__)
    assert first.endswith(".") and "``" not in first
    assert f" {first} " in out
    assert "--config FILE the run's YAML config (any path;" in out


def test_a_description_is_the_first_paragraph_as_plain_text():
    """The help's description: the docstring's first paragraph joined on one line, without
    reST's double backquotes and role markup; the paragraphs after it are left out."""
    doc = """Score rows with a reward model:
    ``python -m x --input IN`` (:mod:`dpo_megatron.reward.rows`).

    Details that stay in the docstring.
    """
    assert command.description(doc) == (
        "Score rows with a reward model: python -m x --input IN (dpo_megatron.reward.rows)."
    )
