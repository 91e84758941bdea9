"""Every call the online loop makes into generation, reward-model scoring, a causal LM's
log-probabilities and a judge, in one module: the names of ``dpo_megatron.generation`` and
``dpo_megatron.reward`` are used here only.

Tests (and programs) may put stand-ins in their place for one block::

    with use_generator(my_generate), use_reward_model(my_build, my_score):
        run_online(cfg)

``my_generate(chunks, prompts, params, *, num_samples, micro_batch_size, pad_id, vocab_size)``
takes the arguments of ``dpo_megatron.generation.generate``; a scorer stand-in those of
``dpo_megatron.reward.scoring.score_sequences``.
"""

from __future__ import annotations

import contextlib
import importlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from dpo_megatron.utils import ranks


class JudgeError(ValueError):
    """The judge callable could not be loaded, failed, or returned bad scores (its message is
    the one line a user sees)."""


_STAND_INS: dict[str, Callable | None] = {"generate": None, "score": None, "build_rm": None}


@contextlib.contextmanager
def use_generator(fn: Callable) -> Iterator[None]:
    """Sample with ``fn`` (the signature of ``dpo_megatron.generation.generate``) in the block."""
    previous, _STAND_INS["generate"] = _STAND_INS["generate"], fn
    try:
        yield
    finally:
        _STAND_INS["generate"] = previous


@contextlib.contextmanager
def use_reward_model(build: Callable, score: Callable) -> Iterator[None]:
    """In the block, build the reward model with ``build(cfg, path)`` (the signature of
    :func:`build_reward_model`) and score with ``score`` (the signature of
    ``dpo_megatron.reward.scoring.score_sequences``)."""
    previous = dict(_STAND_INS)
    _STAND_INS.update(build_rm=build, score=score)
    try:
        yield
    finally:
        _STAND_INS.update(previous)


def sample_completions(
    chunks: list,
    prompts: Sequence[Sequence[int]],
    sampling,
    *,
    seed: int,
    num_samples: int,
    stop_ids: Sequence[int],
    pad_id: int,
    vocab_size: int,
) -> list[list[list[int]]]:
    """``num_samples`` completions per prompt from the policy ``chunks`` (collective over the
    world: every rank passes the same prompts and gets every completion).

    Args:
        sampling: ``online.sampling`` (a ``generation.config.SamplingConfig``).
        seed: the round's seed.

    Returns:
        per prompt, ``num_samples`` lists of generated ids (prompt excluded).
    """
    from dpo_megatron.generation import generate

    generate = _STAND_INS["generate"] or generate
    params = sampling.params(seed, stop_ids)
    return generate(
        chunks,
        [list(p) for p in prompts],
        params,
        num_samples=num_samples,
        micro_batch_size=sampling.micro_batch_size,
        pad_id=pad_id,
        vocab_size=vocab_size,
    )


def build_reward_model(cfg, path: str) -> list:
    """This rank's reward-model chunks at the current layout (``online.reward_model.parallel``,
    set up by the caller), in eval mode, weights from ``path``: a reward model's checkpoint
    (``loss.name=bradley_terry``; a run's checkpoints folder: its latest) or a Hugging Face
    ``*ForSequenceClassification`` folder (``dpo_megatron.reward.scoring.build_reward_chunks``;
    the policy's ``model.*`` settings that are not architecture, e.g. dtype, carry over)."""
    if _STAND_INS["build_rm"] is not None:
        return _STAND_INS["build_rm"](cfg, path)
    import dataclasses

    from dpo_megatron.reward.scoring import build_reward_chunks

    base = dataclasses.replace(cfg.model, hf_path="", load="")
    chunks, _ = build_reward_chunks(path, cfg.online.reward_model.parallel, base)
    return chunks


@dataclass(frozen=True)
class RewardReader:
    """The tokenizer and chat template a reward model reads the policy's samples with
    (:func:`reward_reader`), and where the tokenizer came from (for the start-up line)."""

    tokenizer: Any
    chat_template: str
    source: str
    """The tokenizer's folder or name; empty: the policy's."""
    pad_id: int
    """The reward model's pad id (``reward.scoring.reward_pad_id``): the last token that is not
    it is the one scored."""


def reward_reader(cfg, policy_tokenizer) -> RewardReader:
    """How the reward model of ``online.reward_model`` reads samples: with
    ``online.reward_model.tokenizer`` when set, else with the tokenizer in
    ``online.reward_model.path`` when it is a folder holding one (a Hugging Face
    ``*ForSequenceClassification`` folder), else (a reward model trained here: a checkpoint)
    with the tokenizer of the folder it was built from when that one is not the policy's
    (:func:`_trained_from`), else the policy's; with ``online.reward_model.chat_template``, else
    the tokenizer's own template (``data.chat_template`` for the policy's tokenizer); the pad
    id of ``reward.scoring.reward_pad_id``.

    Raises:
        ValueError / OSError: the tokenizer cannot be loaded (``data.load_tokenizer``).
    """
    from dpo_megatron.data.tokenizer import has_tokenizer_files, load_tokenizer
    from dpo_megatron.reward.scoring import reward_pad_id

    o = cfg.online.reward_model
    source = o.tokenizer or (o.path if has_tokenizer_files(o.path) else "")
    tokenizer = load_tokenizer(source) if source else policy_tokenizer
    if not source:
        source, tokenizer = _trained_from(o.path, policy_tokenizer)
    template = o.chat_template or ("" if source else cfg.data.chat_template)
    return RewardReader(tokenizer, template, source, reward_pad_id(o.path, tokenizer))


def _trained_from(path: str, policy_tokenizer) -> tuple[str, Any]:
    """(folder, tokenizer) of the model a reward-model checkpoint was built from (its stored
    ``model.hf_path``, ``training.run_models.built_from``, as ``reward.rows.scoring_tokenizer``
    reads it) when that folder's tokenizer has another vocabulary than the policy's: scoring the
    policy's ids with it would read them as other tokens. ``("", policy_tokenizer)`` otherwise
    (the same vocabulary, no stored folder, or a folder without a tokenizer)."""
    import os

    from dpo_megatron.data.tokenizer import has_tokenizer_files, load_tokenizer
    from dpo_megatron.training.run_models import built_from

    base = built_from(path) if os.path.isdir(path) else ""
    if not base or not has_tokenizer_files(base):
        return "", policy_tokenizer
    tokenizer = load_tokenizer(base)
    if tokenizer.get_vocab() == policy_tokenizer.get_vocab():
        return "", policy_tokenizer
    return base, tokenizer


def check_reward_reader(reader: RewardReader, prompts: list) -> None:
    """Refuse, before any round, a reward model that reads with its own tokenizer and has no
    chat template for chat prompts (``prompts``: the run's prompt forms).

    Raises:
        ValueError: naming the tokenizer and ``online.reward_model.chat_template``.
    """
    from dpo_megatron.data.tokenizer import has_chat_template, resolve_chat_template

    chat = any(isinstance(p, list) for p in prompts)
    template = resolve_chat_template(reader.chat_template)
    if reader.source and chat and not has_chat_template(reader.tokenizer, template):
        raise ValueError(
            f"the reward model's tokenizer ({reader.source}) has no chat template for the chat "
            "prompts: set online.reward_model.chat_template (chatml, mistral or a Jinja file)"
        )


def reward_model_sequences(reader: RewardReader, forms: list, samples: list, label: str):
    """The reward model's token ids of each sample (``reward.rows.encode_rows``, the rule
    ``python -m dpo_megatron.score`` applies to generated rows): the policy's prompt and
    completion ids as they are when ``reader`` reads the sample's prompt form (``forms[i]``,
    text or messages) as the policy did, else the prompt form and the completion's text
    encoded with ``reader`` (rank 0 says how many, in one line). ``samples`` are
    ``records.SampleRecord``; ``label`` names them in an error. Returns
    ``reward.rows.EncodedRows``."""
    from dpo_megatron.reward.rows import encode_rows, retokenized_note

    rows = [
        (
            f"round {s.round} prompt {s.prompt} sample {s.sample}",
            {
                "prompt": form,
                "completion": s.completion_text,
                "completion_ids": list(s.completion_ids),
                "prompt_ids": list(s.prompt_ids),
            },
        )
        for form, s in zip(forms, samples, strict=True)
    ]
    encoded = encode_rows(rows, label, reader.tokenizer, reader.chat_template)
    if encoded.retokenized and ranks.is_rank0():
        phase = "held-out evaluation" if samples[0].round == "eval" else f"round {samples[0].round}"
        print(retokenized_note(encoded.retokenized, len(rows), f"online, {phase}"), flush=True)
    return encoded


def score_with_reward_model(
    chunks: list,
    sequences: Sequence[Sequence[int]],
    completion_starts: Sequence[int],
    *,
    micro_batch_size: int,
    pad_id: int,
) -> list[float]:
    """The reward model's score of each sequence (prompt + completion ids; the completion starts
    at ``completion_starts[i]``), collective: every rank gets every score."""
    stand_in = _STAND_INS["score"]
    if stand_in is None:
        from dpo_megatron.reward.scoring import score_sequences
    else:
        score_sequences = stand_in
    return list(
        score_sequences(
            chunks,
            [list(s) for s in sequences],
            list(completion_starts),
            micro_batch_size=micro_batch_size,
            pad_id=pad_id,
        )
    )


def completion_logps(
    chunks: list,
    sequences: Sequence[Sequence[int]],
    completion_starts: Sequence[int],
    *,
    micro_batch_size: int,
    pad_id: int,
) -> list[float]:
    """log p(completion | prompt) of each sequence under the causal-LM ``chunks``, in nats
    (``dpo_megatron.reward.scoring.completion_logps``; collective: every rank gets every
    value)."""
    from dpo_megatron.reward.scoring import completion_logps as logps

    return logps(
        chunks,
        [list(s) for s in sequences],
        list(completion_starts),
        micro_batch_size=micro_batch_size,
        pad_id=pad_id,
    )


def load_judge(spec: str) -> Callable:
    """The callable ``package.module:function`` of ``online.judge``.

    Raises:
        ValueError: the module cannot be imported or has no such callable.
    """
    module_name, _, name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"online.judge={spec}: cannot import {module_name} ({e})") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"online.judge={spec}: {module_name} has no callable {name!r}")
    return fn


def judge_scores(spec: str, prompts: list[str], completions: list[str]) -> list[float]:
    """Scores of the judge ``spec`` (``package.module:function``), called once on rank 0 with
    the two lists and shared with every rank (collective).

    Raises:
        JudgeError: on every rank, when the judge cannot be loaded, fails, or returns anything
            but one finite number per completion (rank 0's message).
    """
    scores, error = None, None
    if ranks.is_rank0():
        try:
            judge = load_judge(spec)
        except ValueError as e:
            judge, error = None, str(e)
        try:
            out = judge(list(prompts), list(completions)) if judge else []
            scores = [float(x) for x in out]
            if len(scores) != len(completions):
                raise ValueError(
                    f"returned {len(scores)} scores for {len(completions)} completions"
                )
            bad = [i for i, x in enumerate(scores) if not math.isfinite(x)]
            if bad:
                raise ValueError(f"score {scores[bad[0]]} of completion {bad[0]} is not finite")
        except Exception as e:  # the user's code: any failure becomes one line
            error = error or f"online.judge={spec}: {type(e).__name__}: {e}"
    scores, error = ranks.broadcast_from_rank0((scores, error))
    if error:
        raise JudgeError(error)
    return scores
