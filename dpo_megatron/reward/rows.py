"""A JSONL file of (prompt, completion) rows scored with a reward model: the work of
``python -m dpo_megatron.score`` (:mod:`dpo_megatron.cli.score`), and the rule by which a reward
model reads a policy's samples (the online loop's scoring reads its samples with it too).

Each input line is a JSON object with ``prompt`` and ``completion``: both strings (tokenized as
the data path tokenizes them: the completion as a continuation ending with one EOS), or both
message lists (rendered with the tokenizer's chat template, or ``data.chat_template``, as the
data path renders conversations), or a message-list prompt with a text completion, as
``python -m dpo_megatron.generate`` writes them (the text is the assistant turn after the
prompt's messages, rendered as a message row). A prompt is read in the form it is given and
never re-decided here: ``generate`` writes the form it sampled after (``data.encode.prompt_form``:
a text sent through the chat template as a one-user-turn message list, a text sent as it stands
as the text).

A row with ``completion_ids`` (as ``generate`` writes them, with the ``prompt_ids`` they were
sampled after) is scored on exactly those ids after the prompt's, the sampled sequence (a
completion cut at ``max_new_tokens`` without its stop token, as it was sampled), when the
scoring tokenizer reads the prompt as the policy did: its ids of the prompt equal the row's
``prompt_ids`` (a row without ``prompt_ids`` is taken as read so). Otherwise (a reward model of
another family, with its own tokenizer or chat template: the policy's ids mean nothing to it) the
``completion`` text is tokenized with the scoring tokenizer, as TRL's online trainers score with
a reward model's own tokenizer (``reward_processing_class``); so is every row without
``completion_ids`` (:func:`encode_rows`). The output holds every input row with a ``score`` field
(fp32 reward, a float), in input order, written atomically by rank 0. A bad row stops it with one
line naming the file, the line and the field. The scoring itself is
:mod:`dpo_megatron.reward.scoring`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dpo_megatron.data.config import DataConfig
from dpo_megatron.data.sources import DataError, read_json_rows
from dpo_megatron.models.config import ModelConfig
from dpo_megatron.parallel.config import ParallelConfig
from dpo_megatron.utils import ranks


def read_rows(path: str) -> list[tuple[str, dict]]:
    """(location, JSON object) of each row of a JSON Lines file (or a JSON array), read by the
    data path's reader (``data.sources.read_json_rows``: blank lines skipped, a line that is not
    a UTF-8 JSON object named by its number); the location is ``line N`` (``row N`` in an
    array).

    Raises:
        DataError (a ValueError): ``<path>: line N: ...`` for a malformed line or a row without
            ``prompt`` and ``completion``; ``--input <path>: no such file``.
    """
    if not Path(path).is_file():
        raise DataError(f"--input {path}: no such file")
    texts, where, _ = read_json_rows(Path(path))
    rows = []
    for text, location in zip(texts, where):
        row = json.loads(text)
        for field in ("prompt", "completion"):
            if field not in row:
                raise DataError(f"{path}: {location}: field {field!r} is missing")
        rows.append((location, row))
    return rows


def _as_message_row(row: dict) -> dict:
    """``row`` with a text ``completion`` after a message-list ``prompt`` (the rows
    ``python -m dpo_megatron.generate`` writes for a chat prompt) as the assistant message that
    follows the prompt's messages; any other row unchanged."""
    if isinstance(row["prompt"], list) and isinstance(row["completion"], str):
        return {**row, "completion": [{"role": "assistant", "content": row["completion"]}]}
    return row


def sampled_ids(row: dict, path: str, location: str, vocab_size: int) -> list[int] | None:
    """The row's ``completion_ids`` (the ids ``python -m dpo_megatron.generate`` sampled), or
    None when the row has none (a hand-written row).

    Raises:
        DataError (a ValueError): ``<path>: line N: field 'completion_ids': ...`` for a value
            that is not a list, an entry that is not an int (a JSON ``true`` included) or an id
            outside ``[0, vocab_size)``; ``<path>: line N: nothing to score
            (empty_completion)`` for an empty list.
    """
    if "completion_ids" not in row:
        return None
    ids = _ids_field(row, "completion_ids", path, location, vocab_size)
    if not ids:
        raise DataError(f"{path}: {location}: nothing to score (empty_completion)")
    return ids


def _ids_field(
    row: dict, field: str, path: str, location: str, vocab_size: int | None
) -> list[int]:
    """``row[field]`` checked as a list of token ids, each in ``[0, vocab_size)`` unless
    ``vocab_size`` is None (ids of another tokenizer may be compared, not looked up)
    (:func:`sampled_ids`' errors)."""
    ids = row[field]
    where = f"{path}: {location}: field {field!r}"
    if not isinstance(ids, list):
        raise DataError(f"{where}: expected a list of token ids, got {type(ids).__name__}")
    for k, token in enumerate(ids):
        if type(token) is not int:  # bool is an int subclass: true/false are not token ids
            raise DataError(f"{where}: entry {k} is {token!r}, not a token id")
        if vocab_size is not None and not 0 <= token < vocab_size:
            raise DataError(
                f"{where}: entry {k} is {token}, outside the tokenizer's vocabulary "
                f"[0, {vocab_size})"
            )
    return ids


def read_as_sampled(row: dict, prompt_ids: list[int], path: str, location: str) -> bool:
    """Whether the scoring tokenizer reads ``row``'s ``completion_ids`` as they were sampled:
    the row has them, and its ``prompt_ids`` (the ids the policy sampled after) equal
    ``prompt_ids`` (the scoring tokenizer's ids of the row's prompt); a row without
    ``prompt_ids`` (written by hand) is taken at its word. Unequal prompt ids mean another
    tokenizer or chat template, in which the sampled ids are not the policy's tokens.

    Raises:
        DataError (a ValueError): ``<path>: line N: field 'prompt_ids': ...`` for a value that
            is not a list of ints.
    """
    if "completion_ids" not in row:
        return False
    if "prompt_ids" not in row:
        return True
    return _ids_field(row, "prompt_ids", path, location, None) == prompt_ids


@dataclass(frozen=True)
class EncodedRows:
    """The reward model's sequences of scored rows (:func:`encode_rows`).

    Attributes:
        sequences: per row, the token ids of prompt + completion.
        starts: per row, where its completion starts (the prompt's token count).
        retokenized: rows with ``completion_ids`` whose completion text was tokenized instead,
            because the scoring tokenizer reads their prompt otherwise than the policy did
            (:func:`read_as_sampled`).
    """

    sequences: list[list[int]]
    starts: list[int]
    retokenized: int


def encode_rows(rows: list, path: str, tokenizer, chat_template: str) -> EncodedRows:
    """The reward model's token ids of each (location, row) of :func:`read_rows`.

    The prompt ids are ``data.encode.encode_prompt`` of the row's ``prompt`` (text or messages
    as given), as the data path encodes a pair's prompt. The completion ids are:

    * the row's ``completion_ids`` when it has them and :func:`read_as_sampled` (the rows
      ``python -m dpo_megatron.generate`` writes, scored with its tokenizer and chat template):
      exactly the sampled ids, never the decoded ``completion`` text re-tokenized (a BPE
      tokenizer need not give the sampled ids back from their text). A completion cut at
      ``max_new_tokens`` has no stop token and is scored as it is, with no end token appended:
      the reward model reads the sequence the policy produced, as TRL's online trainers score
      the generated ids (a missing stop token is a choice of penalty there,
      ``missing_eos_penalty``, not a token added);
    * else the ``completion`` tokenized as the data path tokenizes a pair's chosen completion
      (``data.encode.encode_example``: a text as a continuation ending with one EOS, messages
      rendered by the chat template). A sampled completion whose text is blank (the policy
      stopped at once) is the scoring tokenizer's EOS alone.

    ``completion`` is checked in both cases (a string, or assistant messages), as is ``prompt``.

    Raises:
        DataError (a ValueError): ``<path>: line N: field '...': ...`` for a malformed or empty
            field (:func:`sampled_ids` for ``completion_ids``); ``<path>: line N: nothing to
            score (...)`` for a blank completion or a prompt without tokens.
    """
    from dpo_megatron.data.encode import encode_example, encode_prompt, encode_settings
    from dpo_megatron.data.format_registry import Filtered, RowError
    from dpo_megatron.data.formats import convert_unpaired, convert_unpaired_conversational
    from dpo_megatron.data.tokenizer import resolve_chat_template

    settings = encode_settings(tokenizer, resolve_chat_template(chat_template))
    sequences, starts, retokenized = [], [], 0
    for location, row in rows:
        message_row = _as_message_row(row)
        # The unpaired formats' converters check a prompt and one completion (text, or messages);
        # the label they also read plays no part here.
        convert = (
            convert_unpaired_conversational
            if isinstance(message_row["completion"], list)
            else convert_unpaired
        )
        try:
            (example,) = convert({**message_row, "label": True}, None)
            sampled = "completion_ids" in row
            if sampled:  # the prompt's ids decide how the completion is read
                prompt_ids = encode_prompt(example.prompt, tokenizer, settings)
                if not prompt_ids:
                    raise Filtered("empty_prompt")
            if sampled and read_as_sampled(row, prompt_ids, path, location):
                completion_ids = sampled_ids(row, path, location, len(tokenizer))
            elif sampled and not str(row["completion"]).strip():
                retokenized += 1  # sampled in another tokenizer's ids, and stopped at once
                completion_ids = [settings.eos_token_id]
            else:  # a hand-written row, or one sampled in another tokenizer's ids: the text
                retokenized += int(sampled)
                encoded = encode_example(example, tokenizer, settings)
                prompt_ids, completion_ids = encoded.prompt_ids, encoded.chosen_ids
        except RowError as e:
            raise DataError(f"{path}: {location}: {e}") from None
        except Filtered as e:
            raise DataError(f"{path}: {location}: nothing to score ({e.reason})") from None
        sequences.append([*prompt_ids, *completion_ids])
        starts.append(len(prompt_ids))
    return EncodedRows(sequences, starts, retokenized)


def retokenized_note(count: int, total: int, who: str = "score") -> str:
    """The line saying that ``count`` of ``total`` sampled rows were read from their text
    (:attr:`EncodedRows.retokenized`)."""
    return (
        f"[{who}] {count} of {total} sampled completions read from their text: this tokenizer "
        "or chat template reads their prompt otherwise than the policy that sampled them (a "
        "reward model of another family), so their sampled ids were not its tokens"
    )


def write_rows(path: str, rows: list, scores: list[float]) -> None:
    """The rows with their ``score``, one JSON object a line, written atomically."""
    from dpo_megatron.utils.files import write_text_atomic

    lines = [
        json.dumps({**row, "score": score}, ensure_ascii=False)
        for (_, row), score in zip(rows, scores)
    ]
    write_text_atomic(path, "".join(line + "\n" for line in lines))


def reward_source(model: ModelConfig) -> str:
    """The reward model ``score_file`` reads: ``model.load`` (a reward run's checkpoint) when
    set, else ``model.hf_path`` (an HF ``*ForSequenceClassification`` folder). As in training,
    ``model.load`` wins over ``model.hf_path``: a reward run's own config names its base causal
    LM as ``model.hf_path`` (the tokenizer's folder), and its checkpoint as ``model.load``.

    Raises:
        ValueError: neither is set.
    """
    source = model.load or model.hf_path
    if not source:
        raise ValueError("set model.hf_path (an HF reward model) or model.load (a checkpoint)")
    return source


def scoring_tokenizer(model: ModelConfig, data: DataConfig) -> str:
    """The tokenizer ``score_file`` reads rows with: ``data.tokenizer``, else ``model.hf_path``
    (an HF reward model's folder, or a reward run's base model), else the folder the
    ``model.load`` checkpoint was built from (its stored ``model.hf_path``: the reward run's
    tokenizer unless that run set ``data.tokenizer``).

    Raises:
        ValueError: none of them names a tokenizer.
    """
    from dpo_megatron.training.run_models import built_from

    tokenizer = data.tokenizer or model.hf_path or built_from(model.load)
    if tokenizer:
        return tokenizer
    raise ValueError(
        f"model.load={model.load}: the checkpoint names no tokenizer: set data.tokenizer (the "
        "one the reward model was trained with)"
    )


def score_file(
    input_path: str,
    output_path: str,
    *,
    model: ModelConfig,
    parallel: ParallelConfig,
    data: DataConfig,
    micro_batch_size: int,
) -> list[float]:
    """Score ``input_path`` into ``output_path`` with the reward model ``model`` states
    (``model.hf_path`` or ``model.load``) at the layout ``parallel``, ``micro_batch_size`` rows a
    forward, tokenized with ``data.tokenizer`` (or the model folder's) and
    ``data.chat_template`` (collective: every rank calls it; rank 0 writes). Returns the scores
    in row order.

    Raises:
        ValueError: a bad row or config (named), or a model that is not a reward model.
    """
    from dpo_megatron.data.tokenizer import load_tokenizer
    from dpo_megatron.parallel import initialize_distributed
    from dpo_megatron.reward.scoring import build_reward_chunks, reward_pad_id, score_sequences

    source = reward_source(model)
    rows = read_rows(input_path)
    tokenizer = load_tokenizer(scoring_tokenizer(model, data))
    encoded = encode_rows(rows, input_path, tokenizer, data.chat_template)
    sequences, starts = encoded.sequences, encoded.starts
    if encoded.retokenized and ranks.is_rank0():
        print(retokenized_note(encoded.retokenized, len(rows)), flush=True)
    initialize_distributed(parallel)
    chunks, built = build_reward_chunks(source, parallel, model)
    longest = max((len(s) for s in sequences), default=0)
    if longest > built.max_position_embeddings:
        raise ValueError(
            f"{input_path}: a row has {longest} tokens, more than the model's "
            f"{built.max_position_embeddings} positions"
        )
    top = max((max(s) for s in sequences if s), default=0)
    if top >= built.vocab_size:
        raise ValueError(
            f"{input_path}: token id {top} is past the reward model's vocabulary "
            f"({built.vocab_size} ids): score with its tokenizer (data.tokenizer, default "
            "model.hf_path's)"
        )
    scores = score_sequences(
        chunks,
        sequences,
        starts,
        micro_batch_size=micro_batch_size,
        pad_id=reward_pad_id(source, tokenizer),
    )
    if ranks.is_rank0():
        write_rows(output_path, rows, scores)
    return scores
