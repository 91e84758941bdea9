"""The records an online run hands from one phase to the next, as typed dataclasses, and the one
place that turns them into JSON and back.

- :class:`SampleRecord`: a completion of one of the round's prompts, a line of
  ``samples.jsonl``;
- :class:`ScoreRecord`: the scorer's verdict on one sample, a line of ``scores.jsonl``;
- :class:`PairRecord`: the best vs the worst completion of a prompt, a line of ``pairs.jsonl``;
- :class:`EvalSample`: a held-out sample, scored, with its log-probabilities, a line of
  ``eval.jsonl`` (``online/eval_start.jsonl`` before round 0);
- :class:`RoundSummary`: a round's counts, training metrics, wall times (:class:`PhaseTimes`)
  and held-out evaluation (:class:`EvaluationEntry`), ``round_<r>/summary.json``;
- :class:`RunSummary`: the run's closing report, ``online/summary.json``;
- :class:`StateRecord`: the finished phases of each round (:class:`RoundState`),
  ``online/state.json``.

(The paths are :class:`~dpo_megatron.utils.run_layout.RunLayout`'s.) A record's JSON object has
one key per field, in field order; a field made with :func:`optional` is left out while it is
None (a round's summary gains its training and evaluation fields as those phases finish), every
other field is always written (``null`` where None). Reading a file back checks each object
against its record: a missing or unknown field, or a value of the wrong type, is one
:class:`RecordError` line naming the file, the line and the field.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, Union

from dpo_megatron.data import PreferencePair
from dpo_megatron.online.pairs import Sample
from dpo_megatron.online.statistics import Interval
from dpo_megatron.utils.files import atomic_file, write_json_atomic

R = TypeVar("R", bound="Record")

_OMIT_NONE = "omit_none"


class RecordError(ValueError):
    """A file of an online run does not hold the record its reader expects (the message names
    the file, the line of a JSON-lines file, and the field)."""


def optional(default=None):
    """A field that may be absent from the JSON object: left out while it is None, None when
    the object lacks it."""
    return field(default=default, metadata={_OMIT_NONE: True})


class Record:
    """Base of the online records (each a frozen dataclass): :meth:`to_json` and
    :meth:`from_json` over the fields."""

    def to_json(self) -> dict:
        """The record as a JSON object (fields in order; tuples as lists; records nested)."""
        return _encode(self)

    @classmethod
    def from_json(cls: type[R], data: Any, where: str) -> R:
        """The record of the JSON object ``data``.

        Args:
            where: the object's place for messages (the file, and its line in a JSON-lines
                file).

        Raises:
            RecordError: ``data`` is not an object of this record: ``<where>: field 'x' is
                missing`` / ``unknown field`` / ``is <value>, expected <type>``.
        """
        return _decode(cls, data, where, "")


# ----------------------------------------------------------------------------------------------
# the records


@dataclass(frozen=True)
class SampleRecord(Record):
    """One completion sampled from the policy, a line of ``samples.jsonl``.

    Attributes:
        round: the round's index, or ``"eval"`` for a held-out evaluation's sample.
        prompt: the prompt's index in the round (0 .. P - 1).
        sample: the completion's index among the prompt's K (0 .. K - 1).
        row: the prompt's row in ``online.prompts``.
        prompt_text: the prompt as the model read it (chat markup included).
        completion_text: the completion, special tokens skipped.
        prompt_ids, completion_ids: their token ids (the stop token kept when the completion
            ended on one).
    """

    round: int | str
    prompt: int
    sample: int
    row: int
    prompt_text: str
    completion_text: str
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]

    @property
    def sequence(self) -> list[int]:
        """Prompt then completion ids (what a scorer reads; the completion starts at
        ``len(prompt_ids)``)."""
        return [*self.prompt_ids, *self.completion_ids]

    def pair_candidate(self) -> Sample:
        """The sample as :func:`~dpo_megatron.online.pairs.build_pairs` reads it."""
        return Sample(self.prompt, self.sample, self.completion_ids)


@dataclass(frozen=True, kw_only=True)
class EvalSample(SampleRecord):
    """A held-out sample with its score, a line of a round's ``eval.jsonl`` or of
    ``online/eval_start.jsonl`` (``round`` is ``"eval"``).

    Attributes:
        logp, logp_initial: log p(completion | prompt) under the evaluated policy and under the
            starting policy, nats at temperature 1 (the KL's terms); absent for the starting
            policy's own samples.
        score: the scorer's score.
    """

    logp: float | None = optional()
    logp_initial: float | None = optional()
    score: float

    @classmethod
    def of(
        cls,
        sample: SampleRecord,
        score: float,
        logp: float | None = None,
        logp_initial: float | None = None,
    ) -> EvalSample:
        """``sample`` with its score (and log-probabilities)."""
        values = {f.name: getattr(sample, f.name) for f in dataclasses.fields(SampleRecord)}
        return cls(**values, logp=logp, logp_initial=logp_initial, score=score)


@dataclass(frozen=True)
class ScoreRecord(Record):
    """The scorer's score of one sample (``prompt``, ``sample`` as in its
    :class:`SampleRecord`), a line of ``scores.jsonl``."""

    prompt: int
    sample: int
    score: float


@dataclass(frozen=True)
class PairRecord(Record):
    """A preference pair of a round, a line of ``pairs.jsonl``: the best (chosen) and the worst
    (rejected) of a prompt's samples (``pairs.build_pairs``), with their scores, texts and ids."""

    round: int
    prompt: int
    row: int
    chosen_sample: int
    rejected_sample: int
    chosen_score: float
    rejected_score: float
    prompt_text: str
    chosen_text: str
    rejected_text: str
    prompt_ids: tuple[int, ...]
    chosen_ids: tuple[int, ...]
    rejected_ids: tuple[int, ...]

    def preference_pair(self) -> PreferencePair:
        """The pair as the engine trains on it."""
        return PreferencePair(self.prompt_ids, self.chosen_ids, self.rejected_ids)


@dataclass(frozen=True)
class PhaseTimes(Record):
    """Wall time of a round's phases, seconds (None: not measured in this process, e.g. a phase
    an earlier run of a resumed one finished without recording it)."""

    sample: float | None
    score: float | None
    train: float | None
    eval: float | None = optional()

    def total(self) -> float:
        return sum(t or 0.0 for t in (self.sample, self.score, self.train, self.eval))


@dataclass(frozen=True)
class EvaluationEntry(Record):
    """The report of one held-out evaluation (``evaluation.evaluation_entry``).

    Attributes:
        round: the round after which the policy was evaluated (-1: the starting policy).
        prompts, samples_per_prompt: the evaluation's P x K samples.
        completion_tokens: mean completion length, tokens.
        score: mean score with its bootstrap interval.
        score_change: the change since the starting policy with its paired interval (None for
            the starting policy).
        kl_from_initial: mean log-ratio to the starting policy, nats per completion, with its
            interval (0 for the starting policy).
    """

    round: int
    prompts: int
    samples_per_prompt: int
    completion_tokens: float
    score: Interval
    score_change: Interval | None
    kl_from_initial: Interval


@dataclass(frozen=True)
class RoundSummary(Record):
    """A round's ``summary.json``. The pairs phase writes the counts; training adds ``train``,
    ``policy_end`` and ``wall_s``; the held-out evaluation adds the ``eval*`` fields.

    Attributes:
        prompts, samples: the round's prompts and scored completions.
        pairs_kept, ties_dropped, near_ties_dropped, empty_samples,
            prompts_with_too_few_samples: ``pairs.PairCounts``.
        samples_without_eos: completions that end without a stop token (cut at
            ``max_new_tokens``; ``online.missing_eos_penalty`` lowers their scores for the
            pairs).
        mean_score: the scorer's, over every sample (None: no sample); mean_chosen_score,
            mean_rejected_score: over the kept pairs, as they were ranked (the missing-EOS
            penalty included; None: no pair).
        sampling_seed: the round's sampling seed; prompt_rows: its prompts' rows.
        policy_start: the weights the round sampled from and trained; reference:
            ``online.reference``.
        train: the last ``train`` record of the round's ``metrics.jsonl`` ({}: it did not train).
        policy_end: the policy after the round (its checkpoints folder, or ``policy_start``).
        eval_prompts: held-out prompts; eval_mean_score_before / eval_mean_score: their mean
            score before and after the round; eval: the evaluation's report.
    """

    round: int
    prompts: int
    samples: int
    pairs_kept: int
    ties_dropped: int
    near_ties_dropped: int
    empty_samples: int
    prompts_with_too_few_samples: int
    samples_without_eos: int
    mean_score: float | None
    mean_chosen_score: float | None
    mean_rejected_score: float | None
    sampling_seed: int
    prompt_rows: tuple[int, ...]
    policy_start: str
    reference: str
    train: dict[str, Any] | None = optional()
    policy_end: str | None = optional()
    wall_s: PhaseTimes | None = optional()
    eval_prompts: int | None = optional()
    eval_mean_score_before: float | None = optional()
    eval_mean_score: float | None = optional()
    eval: EvaluationEntry | None = optional()

    def outline(self) -> RoundOutline:
        """The round's line in the run's report."""
        return RoundOutline(
            self.round,
            self.prompts,
            self.pairs_kept,
            self.ties_dropped,
            self.mean_score,
            self.policy_end,
            self.wall_s,
        )


@dataclass(frozen=True)
class RoundOutline(Record):
    """A round in the run's report: its counts, where its policy ended and its wall times
    (:class:`RoundSummary`'s fields of the same names)."""

    round: int
    prompts: int
    pairs_kept: int
    ties_dropped: int
    mean_score: float | None
    policy_end: str | None
    wall_s: PhaseTimes | None


@dataclass(frozen=True)
class RunTimes(Record):
    """The run's wall times, seconds: the starting policy's evaluation (None: none) and the
    rounds' phases together."""

    eval_start: float | None
    rounds: float


@dataclass(frozen=True)
class RunSummary(Record):
    """``online/summary.json``: the evaluations by round (the start first), each round's outline,
    where the final policy is, the plot, and how the intervals and the KL were computed."""

    scorer: str
    final_policy: str
    plot: str | None
    evaluation: tuple[EvaluationEntry, ...]
    interval: str
    kl: str
    rounds: tuple[RoundOutline, ...]
    wall_s: RunTimes


@dataclass(frozen=True)
class RoundState(Record):
    """What ``online/state.json`` knows of one round (round -1: the starting policy's
    evaluation).

    Attributes:
        done: the finished phases, in order (``rounds.PHASES``).
        sample_s, score_s: wall times of the sample and score phases, seconds.
        policy: after training, the checkpoints folder the policy ended in (or the one it
            started from, when the round trained on too few pairs).
        eval_mean_score: the held-out mean score after the round; eval_s: its wall time.
    """

    done: tuple[str, ...] = ()
    sample_s: float | None = optional()
    score_s: float | None = optional()
    policy: str | None = optional()
    eval_mean_score: float | None = optional()
    eval_s: float | None = optional()


@dataclass(frozen=True)
class StateRecord(Record):
    """``online/state.json``: ``{"rounds": {"<r>": RoundState}}``."""

    rounds: dict[int, RoundState] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------
# files


def write_records(path: str, records: Sequence[Record]) -> None:
    """``records`` as JSON lines at ``path``, atomically (rank 0 calls it)."""
    with atomic_file(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps(record.to_json(), ensure_ascii=False) + "\n")


def read_records(path: str, cls: type[R]) -> list[R]:
    """The records of a JSON-lines file written by :func:`write_records`.

    Raises:
        RecordError: a line is not JSON or not a ``cls`` (naming the file, line and field).
    """
    with open(path, encoding="utf-8") as f:
        lines = [(n, line) for n, line in enumerate(f, start=1) if line.strip()]
    return [
        cls.from_json(_loads(line, f"{path}: line {n}"), f"{path}: line {n}") for n, line in lines
    ]


def write_record(path: str, record: Record) -> None:
    """``record`` as one JSON document at ``path`` (indent 1), atomically."""
    write_json_atomic(path, record.to_json())


def read_record(path: str, cls: type[R]) -> R:
    """The record of a JSON file written by :func:`write_record`.

    Raises:
        RecordError: the file is not JSON or not a ``cls`` (naming the file and field).
    """
    with open(path, encoding="utf-8") as f:
        return cls.from_json(_loads(f.read(), path), path)


def _loads(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as e:
        raise RecordError(f"{where}: not JSON ({e})") from None


# ----------------------------------------------------------------------------------------------
# JSON <-> fields


def _encode(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            f.name: _encode(getattr(value, f.name))
            for f in dataclasses.fields(value)
            if not (f.metadata.get(_OMIT_NONE) and getattr(value, f.name) is None)
        }
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _encode(v) for k, v in value.items()}
    return value


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _decode(hint: Any, value: Any, where: str, name: str) -> Any:
    """``value`` (parsed JSON) as the type ``hint``; ``name`` is the field's dotted path."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:  # Optional[X]: X's own message
            return _decode(options[0], value, where, name)
        for arg in options:
            try:
                return _decode(arg, value, where, name)
            except RecordError:
                continue
        raise _wrong_type(value, hint, where, name)
    if dataclasses.is_dataclass(hint):
        return _decode_fields(hint, value, where, name)
    if origin is tuple and isinstance(value, list):
        return tuple(_decode(args[0], v, where, f"{name}[{i}]") for i, v in enumerate(value))
    if origin is dict and isinstance(value, dict):
        key_type, value_type = args
        out = {}
        for k, v in value.items():
            try:
                key = key_type(k)
            except ValueError:
                raise _wrong_type(k, key_type, where, f"{name} key") from None
            out[key] = _decode(value_type, v, where, f"{name}.{k}")
        return out
    if hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    if hint in (int, str, bool) and type(value) is hint:
        return value
    raise _wrong_type(value, hint, where, name)


def _decode_fields(cls: type, value: Any, where: str, name: str) -> Any:
    prefix = f"{name}." if name else ""
    what = f"field '{name}'" if name else "the record"
    if not isinstance(value, dict):
        raise RecordError(f"{where}: {what} is {_short(value)}, expected a {cls.__name__} object")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in value if k not in fields]
    if unknown:
        raise RecordError(
            f"{where}: unknown field '{prefix}{unknown[0]}' (a {cls.__name__} has "
            f"{', '.join(fields)})"
        )
    missing = [k for k, f in fields.items() if k not in value and not f.metadata.get(_OMIT_NONE)]
    if missing:
        raise RecordError(f"{where}: field '{prefix}{missing[0]}' is missing")
    hints = _hints(cls)
    return cls(**{k: _decode(hints[k], v, where, f"{prefix}{k}") for k, v in value.items()})


def _wrong_type(value: Any, hint: Any, where: str, name: str) -> RecordError:
    expected = getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
    return RecordError(f"{where}: field '{name}' is {_short(value)}, expected {expected}")


def _short(value: Any) -> str:
    text = json.dumps(value, default=repr)
    return text if len(text) <= 40 else text[:37] + "..."
