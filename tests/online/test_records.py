"""The online records: each one back from its JSON equal to itself, files written in the format
existing run folders hold (the keys, their order, the state file of an earlier run read and
resumed), and a file that is not the record it should be stopped with one line naming the file,
its line and the field."""

from __future__ import annotations

import dataclasses
import json

import pytest

from dpo_megatron.online.records import (
    EvalSample,
    EvaluationEntry,
    PairRecord,
    PhaseTimes,
    RecordError,
    RoundState,
    RoundSummary,
    RunSummary,
    RunTimes,
    SampleRecord,
    ScoreRecord,
    StateRecord,
    read_record,
    read_records,
    write_record,
    write_records,
)
from dpo_megatron.online.statistics import Interval
from dpo_megatron.utils.run_layout import RunLayout

SAMPLE = SampleRecord(
    round=0,
    prompt=1,
    sample=2,
    row=7,
    prompt_text="Say hi.",
    completion_text="Salut, ça va",
    prompt_ids=(1, 2),
    completion_ids=(3, 4, 0),
)
PAIR = PairRecord(
    round=0,
    prompt=1,
    row=7,
    chosen_sample=2,
    rejected_sample=0,
    chosen_score=3.5,
    rejected_score=-1.0,
    prompt_text="Say hi.",
    chosen_text="Salut",
    rejected_text="",
    prompt_ids=(1, 2),
    chosen_ids=(3, 4),
    rejected_ids=(5,),
)
ENTRY = EvaluationEntry(
    round=0,
    prompts=2,
    samples_per_prompt=3,
    completion_tokens=4.5,
    score=Interval(0.5, 0.25, 0.75),
    score_change=Interval(0.125, -0.25, 0.5),
    kl_from_initial=Interval(1.5, 1.0, 2.0),
)
PAIRS_DONE = RoundSummary(
    round=0,
    prompts=3,
    samples=9,
    pairs_kept=1,
    ties_dropped=1,
    near_ties_dropped=0,
    empty_samples=2,
    prompts_with_too_few_samples=1,
    samples_without_eos=4,
    mean_score=1.5,
    mean_chosen_score=3.5,
    mean_rejected_score=None,
    sampling_seed=11,
    prompt_rows=(4, 0, 2),
    policy_start="/w/initial",
    reference="round_start",
)
EVALUATED = dataclasses.replace(
    PAIRS_DONE,
    train={"step": 2, "split": "train", "loss": 0.69, "rewards/margins": 0.0},
    policy_end="/w/online/round_0/checkpoints",
    wall_s=PhaseTimes(sample=1.0, score=None, train=3.0, eval=0.5),
    eval_prompts=2,
    eval_mean_score_before=0.375,
    eval_mean_score=0.5,
    eval=ENTRY,
)
RECORDS = [
    SAMPLE,
    dataclasses.replace(SAMPLE, round="eval"),
    EvalSample.of(SAMPLE, 0.25),
    EvalSample.of(SAMPLE, 0.25, logp=-3.5, logp_initial=-4.0),
    ScoreRecord(prompt=1, sample=2, score=0.0),
    PAIR,
    dataclasses.replace(ENTRY, round=-1, score_change=None),
    PAIRS_DONE,
    EVALUATED,
    RunSummary(
        scorer="my.judge:fn",
        final_policy="/w/online/round_0/checkpoints/iter_0000002",
        plot=None,
        evaluation=(ENTRY,),
        interval="95%",
        kl="mean log-ratio",
        rounds=(EVALUATED.outline(), PAIRS_DONE.outline()),
        wall_s=RunTimes(eval_start=None, rounds=4.5),
    ),
    StateRecord({-1: RoundState(("eval",), eval_mean_score=0.5, eval_s=2.0), 0: RoundState()}),
]


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_each_record_comes_back_from_its_json_equal(record, tmp_path):
    """to_json -> from_json is the identity, through a file too, and the file it is read from is
    written back byte for byte."""
    assert type(record).from_json(record.to_json(), "here") == record
    lines, document = tmp_path / "records.jsonl", tmp_path / "record.json"
    write_records(str(lines), [record, record])
    assert read_records(str(lines), type(record)) == [record, record]
    write_record(str(document), record)
    assert read_record(str(document), type(record)) == record
    text = document.read_bytes()
    write_record(str(document), read_record(str(document), type(record)))
    assert document.read_bytes() == text


def test_the_files_keep_the_format_of_existing_run_folders(tmp_path):
    """A samples line as earlier runs wrote it (keys in this order, text not escaped); an
    evaluation row with its log-probabilities before its score, none for the starting policy; a
    round summary with no training field before training, then each phase's fields in order."""
    path = tmp_path / "samples.jsonl"
    write_records(str(path), [SAMPLE])
    assert path.read_text(encoding="utf-8") == (
        '{"round": 0, "prompt": 1, "sample": 2, "row": 7, "prompt_text": "Say hi.", '
        '"completion_text": "Salut, ça va", "prompt_ids": [1, 2], "completion_ids": [3, 4, 0]}\n'
    )
    start = EvalSample.of(dataclasses.replace(SAMPLE, round="eval"), 0.25).to_json()
    assert list(start)[-2:] == ["completion_ids", "score"] and start["round"] == "eval"
    after = EvalSample.of(SAMPLE, 0.25, logp=-3.5, logp_initial=-4.0).to_json()
    assert list(after)[-4:] == ["completion_ids", "logp", "logp_initial", "score"]
    head = [
        "round", "prompts", "samples", "pairs_kept", "ties_dropped", "near_ties_dropped",
        "empty_samples", "prompts_with_too_few_samples", "samples_without_eos", "mean_score",
        "mean_chosen_score",
        "mean_rejected_score", "sampling_seed", "prompt_rows", "policy_start", "reference",
    ]  # fmt: skip
    assert list(PAIRS_DONE.to_json()) == head
    assert PAIRS_DONE.to_json()["mean_rejected_score"] is None  # no rejected pair: null
    full = EVALUATED.to_json()
    assert list(full) == head + [
        "train", "policy_end", "wall_s", "eval_prompts", "eval_mean_score_before",
        "eval_mean_score", "eval",
    ]  # fmt: skip
    assert full["wall_s"] == {"sample": 1.0, "score": None, "train": 3.0, "eval": 0.5}
    assert full["eval"]["score_change"] == {"mean": 0.125, "low": -0.25, "high": 0.5}
    assert EVALUATED.wall_s.total() == 4.5
    layout = RunLayout("/w")
    assert [
        layout.round_samples(2),
        layout.round_scores(2),
        layout.round_pairs(2),
        layout.round_summary(2),
        layout.round_eval(2),
    ] == [
        f"/w/online/round_2/{name}"
        for name in ("samples.jsonl", "scores.jsonl", "pairs.jsonl", "summary.json", "eval.jsonl")
    ]


def test_a_state_file_of_an_earlier_run_resumes(tmp_path):
    """``online/state.json`` as earlier runs wrote it is read, asked, extended by the next phase
    and written in the same format."""
    from dpo_megatron.online.rounds import OnlineState

    old = {
        "rounds": {
            "-1": {"done": ["eval"], "eval_mean_score": 0.5, "eval_s": 2.0},
            "0": {
                "done": ["sample", "score", "pairs", "train"],
                "sample_s": 1.5,
                "score_s": 0.25,
                "policy": "/w/online/round_0/checkpoints",
            },
        }
    }
    path = tmp_path / "state.json"
    path.write_text(json.dumps(old, indent=1))
    state = OnlineState(str(path))
    assert state.done(0, "train") and not state.done(0, "eval") and not state.done(1, "sample")
    assert state.policy_after(0) == "/w/online/round_0/checkpoints"
    assert state.policy_after(1) is None and state.round(-1).eval_mean_score == 0.5
    state.mark(0, "eval", eval_mean_score=0.75)
    state.mark(0, "eval")  # a phase is listed once
    old["rounds"]["0"]["done"].append("eval")
    old["rounds"]["0"]["eval_mean_score"] = 0.75
    assert path.read_text() == json.dumps(old, indent=1)


def _pairs_file(tmp_path, change):
    rows = [PAIR.to_json(), PAIR.to_json()]
    change(rows[1])
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda r: r.pop("chosen_ids"), "field 'chosen_ids' is missing"),
        (
            lambda r: r.update(margin=1.0),
            "unknown field 'margin' (a PairRecord has round, prompt, row, chosen_sample, "
            "rejected_sample, chosen_score, rejected_score, prompt_text, chosen_text, "
            "rejected_text, prompt_ids, chosen_ids, rejected_ids)",
        ),
        (
            lambda r: r.update(chosen_score="high"),
            "field 'chosen_score' is \"high\", expected float",
        ),
        (lambda r: r.update(chosen_ids=[1, "2"]), "field 'chosen_ids[1]' is \"2\", expected int"),
        (lambda r: r.update(row=None), "field 'row' is null, expected int"),
    ],
)
def test_a_record_missing_a_field_or_with_one_too_many_names_file_line_and_field(
    tmp_path, change, message
):
    path = _pairs_file(tmp_path, change)
    with pytest.raises(RecordError) as e:
        read_records(path, PairRecord)
    assert str(e.value) == f"{path}: line 2: {message}"


def test_a_nested_field_and_a_broken_file_are_named(tmp_path):
    """The field of a record inside a record is named by its path; a line that is not JSON, a
    state file with a round that is not a number, an earlier state file with an unknown key."""
    from dpo_megatron.online.rounds import OnlineState

    summary = EVALUATED.to_json()
    del summary["eval"]["score"]["low"]
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(summary))
    with pytest.raises(RecordError, match=r"summary.json: field 'eval.score.low' is missing$"):
        read_record(str(path), RoundSummary)
    lines = tmp_path / "scores.jsonl"
    lines.write_text('{"prompt": 0, "sample": 0, "score": 1.0}\n{"prompt": 0,\n')
    with pytest.raises(RecordError, match=r"scores.jsonl: line 2: not JSON \("):
        read_records(str(lines), ScoreRecord)
    state = tmp_path / "state.json"
    state.write_text('{"rounds": {"first": {"done": []}}}')
    with pytest.raises(RecordError, match=r"state.json: field 'rounds key' is \"first\""):
        OnlineState(str(state))
    state.write_text('{"rounds": {"0": {"done": [], "policy_s": 1.0}}}')
    with pytest.raises(RecordError, match=r"state.json: unknown field 'rounds.0.policy_s'"):
        OnlineState(str(state))
