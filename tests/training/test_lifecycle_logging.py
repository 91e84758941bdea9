"""The rank-0 progress line, metrics.jsonl on resume, and optional W&B."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from dpo_megatron.training.metrics_log import (
    LoggingConfig,
    MetricsLogger,
    format_duration,
    truncate_metrics,
)


def test_format_duration():
    assert [format_duration(s) for s in (0, 59.4, 75, 3599, 3725)] == [
        "0s",
        "59s",
        "1m15s",
        "59m59s",
        "1h02m",
    ]


def test_progress_line(tmp_path, monkeypatch):
    logger = MetricsLogger(
        LoggingConfig(tensorboard=False), run=str(tmp_path), total_steps=10, start_step=4
    )
    monkeypatch.setattr("time.time", lambda: logger.start + 20.0)  # 2 steps done in 20 s
    line = logger.line(
        6,
        "train",
        {
            "loss": 0.6931471805599453,
            "rewards/accuracies": 0.75,
            "rewards/margins": 0.0123456,
            "grad_norm": 1.23456,
            "lr": 1e-5,
            "tokens_per_s": 1234.4,
            "step_time_s": 10.0,
            "skipped_steps": 1,
        },
    )
    assert line == (
        "[train] step 6/10 | loss 0.6931 | acc 0.7500 | margin 0.0123 | "
        "grad_norm 1.235 | lr 1.00e-05 | tokens/s 1234 | step 10.00s | skipped 1 | "
        "elapsed 20s eta 40s"
    )
    # a step-0 evaluation, before any step of this run: no pace, so no eta
    assert logger.line(4, "eval", {"loss": 0.5}) == "[eval] step 4/10 | loss 0.5000 | elapsed 20s"
    logger.close()


def test_the_progress_line_run_lifecycle_shows_is_the_one_printed(tmp_path, monkeypatch):
    """docs/RUN_LIFECYCLE.md's example progress line shows every field of a DPO step's line
    (loss, acc, margin, logps/chosen, logps/rejected, grad_norm, lr, tokens/s, step, skipped),
    and is what the logger prints for those values: a field moved or formatted otherwise fails
    here until the page follows."""
    page = Path(__file__).parents[2] / "docs" / "RUN_LIFECYCLE.md"
    shown = next(ln for ln in page.read_text().splitlines() if ln.startswith("[train] step "))
    keys = {
        "loss": "loss",
        "acc": "rewards/accuracies",
        "margin": "rewards/margins",
        "logps/chosen": "logps/chosen",
        "logps/rejected": "logps/rejected",
        "grad_norm": "grad_norm",
        "lr": "lr",
        "tokens/s": "tokens_per_s",
        "step": "step_time_s",
        "skipped": "skipped_steps",
    }
    head, *fields, timing = shown.split(" | ")
    values = {}
    for item in fields:
        label, value = item.rsplit(" ", 1)
        values[keys[label]] = int(value) if label == "skipped" else float(value.rstrip("s"))
    assert sorted(values) == sorted(keys.values())  # every field of a DPO step's line, shown
    step, total = map(int, head.removeprefix("[train] step ").split("/"))
    elapsed = int(timing.split()[1].rstrip("s"))
    logger = MetricsLogger(LoggingConfig(tensorboard=False), run=str(tmp_path), total_steps=total)
    monkeypatch.setattr("time.time", lambda: logger.start + elapsed)
    assert logger.line(step, "train", values) == shown
    logger.close()


def test_resumed_run_rewrites_the_steps_after_its_checkpoint(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    records = [json.dumps({"step": s, "split": "train", "loss": s}) + "\n" for s in (1, 2, 3, 4)]
    path.write_text("".join(records))
    assert truncate_metrics(str(path), 2) == 2
    path.write_text("".join(records))
    logger = MetricsLogger(
        LoggingConfig(tensorboard=False), run=str(tmp_path), total_steps=4, start_step=2
    )
    assert capsys.readouterr().out == (
        f"note: {path}: dropped 2 records of steps after 2, the checkpoint resumed from (this "
        "run logs those steps again)\n"
    )
    logger.log(3, "train", {"loss": 30.0}, {"lr": 0.1})
    logger.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in records] == [(1, 1), (2, 2), (3, 30.0)]
    assert records[-1] == {"step": 3, "split": "train", "loss": 30.0, "lr": 0.1}


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed")
def test_wandb_configured_but_missing_warns(tmp_path):
    with pytest.warns(UserWarning, match="wandb package is not installed"):
        logger = MetricsLogger(
            LoggingConfig(tensorboard=False, wandb_project="p"), run=str(tmp_path), total_steps=2
        )
    assert logger.wandb is None
    logger.close()


def _strict(line: str) -> dict:
    def reject(token):
        raise ValueError(f"bare {token} is not JSON")

    return json.loads(line, parse_constant=reject)


def test_metrics_are_strict_json_with_named_non_finite_values(tmp_path):
    import math

    logger = MetricsLogger(LoggingConfig(tensorboard=False), run=str(tmp_path), total_steps=2)
    logger.log(
        1,
        "train",
        {"loss": float("nan"), "rewards/margins": float("inf")},
        {"grad_norm": float("-inf"), "lr": 0.5},
    )
    logger.close()
    record = _strict((tmp_path / "metrics.jsonl").read_text())
    assert record == {
        "step": 1,
        "split": "train",
        "loss": "NaN",
        "rewards/margins": "Infinity",
        "grad_norm": "-Infinity",
        "lr": 0.5,
    }
    assert math.isnan(float(record["loss"])) and float(record["grad_norm"]) == -math.inf


def test_a_torn_last_line_is_dropped_with_a_warning_and_the_file_rewritten(tmp_path):
    path = tmp_path / "metrics.jsonl"
    good = "".join(json.dumps({"step": s, "split": "train", "loss": s}) + "\n" for s in (1, 2))
    path.write_text(good + '{"step": 3, "split": "tr')  # killed mid-write
    inode = path.stat().st_ino
    with pytest.warns(UserWarning, match=r"metrics.jsonl: dropped its torn last line 3"):
        assert truncate_metrics(str(path), 2) == 0
    assert path.read_text() == good
    assert path.stat().st_ino != inode  # replaced by rename, not rewritten in place
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # no temporary left
    logger = MetricsLogger(
        LoggingConfig(tensorboard=False), run=str(tmp_path), total_steps=3, start_step=2
    )
    logger.log(3, "train", {"loss": 3.0})
    logger.close()
    assert [_strict(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]


def test_a_last_line_without_its_newline_gets_one(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1, "split": "train"}))
    assert truncate_metrics(str(path), 1) == 0
    assert path.read_text().endswith("}\n")


def test_a_broken_line_before_the_last_names_the_file_and_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl: line 2: not a JSON record"):
        truncate_metrics(str(path), 2)


def test_a_disk_filling_between_saves_is_kept_for_the_step_boundary(tmp_path, capsys):
    """Rank 0's metrics.jsonl and TensorBoard writes meet a full disk between two saves: the
    logger raises nothing where it stands (the other ranks wait in a collective there), keeps
    the first failure in words with its file, writes no file after it, and prints no traceback
    (TensorBoard's writer thread's neither); ``agreed_write_error`` hands it over at the step
    boundary, where the trainer stops every rank (tests/training/test_durability.py, through
    the launcher)."""
    from tests.checkpointing.test_storage import fill, small_tmpfs

    with small_tmpfs(tmp_path / "disk", "512k") as disk:
        run = disk / "run"
        logger = MetricsLogger(LoggingConfig(), run=str(run), total_steps=100_000)
        logger.log(1, "train", {"loss": 0.5})
        filler = fill(disk)
        step = 1
        while logger.write_error is None and step < 100_000:  # until a new page is needed
            step += 1
            logger.log(step, "train", {"loss": 0.5})
        step += 1
        logger.log(step, "train", {"loss": 0.5})  # after the failure
        logger.close()
        error = logger.write_error
        assert error.startswith("no space left on device writing "), error
        assert error.split(" writing ")[1].startswith(
            (f"{run / 'metrics.jsonl'} (", f"{run / 'tensorboard'}")
        ), error
        assert logger.agreed_write_error() == error  # no process group: this process's
        os.remove(filler)
        # The last line may be torn by the full disk (a resume drops it, with a warning).
        lines = (run / "metrics.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines[:-1]]
        assert [r["step"] for r in records] == list(range(1, len(lines)))
        assert len(lines) < step  # nothing written after the failure
    out = capsys.readouterr()
    assert f"[train] step {step}/100000" in out.out  # the console line goes on
    assert "Traceback" not in out.err and "Exception in thread" not in out.err


def _tensorboard_scalars(folder) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag of a TensorBoard folder as TensorBoard shows it (purged steps gone)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def test_tensorboard_tags_are_the_split_then_the_metric_name_and_a_resume_replaces_steps(
    tmp_path,
):
    """TensorBoard holds each metrics.jsonl value under ``<split>/<name>`` (``train/loss``,
    ``eval/rewards/margins``, the names RUN_LIFECYCLE.md lists), and a resumed run's steps
    replace those the interrupted run logged past its checkpoint, as in metrics.jsonl."""
    pytest.importorskip("tensorboard")
    first = MetricsLogger(LoggingConfig(), run=str(tmp_path), total_steps=3)
    first.log(0, "eval", {"loss": 0.5, "rewards/margins": 0.0, "items": 12})
    for step in (1, 2, 3):
        first.log(step, "train", {"loss": step / 10, "rewards/margins": step}, {"lr": 1e-5})
    first.close()
    resumed = MetricsLogger(LoggingConfig(), run=str(tmp_path), total_steps=3, start_step=1)
    for step in (2, 3):
        resumed.log(step, "train", {"loss": step, "rewards/margins": -step}, {"lr": 2e-5})
    resumed.close()
    scalars = _tensorboard_scalars(tmp_path / "tensorboard")
    assert sorted(scalars) == [
        "eval/items",
        "eval/loss",
        "eval/rewards/margins",
        "train/loss",
        "train/lr",
        "train/rewards/margins",
    ]
    assert scalars["eval/items"] == [(0, 12.0)]
    assert scalars["train/loss"] == [(1, pytest.approx(0.1)), (2, 2.0), (3, 3.0)]
    assert scalars["train/rewards/margins"] == [(1, 1.0), (2, -2.0), (3, -3.0)]
    assert [lr for _, lr in scalars["train/lr"]] == pytest.approx([1e-5, 2e-5, 2e-5])
