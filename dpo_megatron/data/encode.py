"""``Example`` -> token ids (prompt, chosen, rejected), with the length rules that need text.

The prompt is tokenized alone, exactly as the model sees it at generation time; each completion
is tokenized as a continuation (``encode_continuation``: no BOS, no dummy-prefix space), so its
ids are what the model would emit after the prompt and no token straddles the boundary.

Conversational examples go through a chat template: the prompt is rendered with the generation
prompt (e.g. ``<|im_start|>assistant\\n``) and the completion is the rest of the rendered full
conversation, with the whitespace a template prints after its end-of-turn token removed (the model
stops at the end-of-turn token). A completion that ends with a special token (EOS or a template's
end-of-turn such as ``<|im_end|>``) keeps it and gets no EOS after it; any other gets one EOS.

Three length rules act here, before or while tokenizing, because they need the text (the token
cuts of ``lengths.fit_lengths`` follow after the tokenization cache):

- BOS: a tokenizer that puts a BOS before the texts it encodes (Llama / Mistral SentencePiece)
  gets exactly one BOS at position 0 of every prompt, whether the chat template printed it, printed
  it twice, or did not print it.
- Turns: with ``truncation_mode=keep_end``, a conversation longer than ``max_prompt_length``
  tokens first loses whole oldest user/assistant exchanges (its system messages are kept, the
  last user turn always stays), re-rendered through the template, so the model never reads half
  a turn when whole turns would do (note ``turns_dropped``).
- Huge texts: a text far longer than any limit lets it keep (``bound_text``) is cut to a
  character budget before it is tokenized; the tokens the limits keep are the same, and a huge
  row costs the tokenizer no more than its budget (note ``text_bounded``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from dpo_megatron.data.formats import Example, Filtered, Messages, RowError
from dpo_megatron.data.sources import DataError
from dpo_megatron.data.tokenizer import (
    adds_bos,
    encode_continuation,
    has_chat_template,
    max_token_chars,
    prepends_space,
    render_chat,
    special_ids,
)


@dataclass(frozen=True)
class EncodeSettings:
    """Per-tokenizer facts computed once (they cost an encode call each)."""

    eos_token_id: int
    bos_token_id: int | None
    add_bos: bool
    space_prefixed: bool
    end_ids: frozenset[int]
    chat_template: str | None
    max_token_chars: int = 0
    """Characters of the longest vocabulary entry: no token covers more of a text (0: unknown,
    no text is cut before tokenizing)."""


@dataclass(frozen=True)
class TokenBudget:
    """The length settings the encoder applies while it still has the text (``data.*``)."""

    max_length: int = 0
    """Most tokens of prompt + completion (0: no bound on texts before tokenizing)."""
    max_prompt_length: int = 0
    """Most prompt tokens (0: no prompt cut, no turn dropping)."""
    truncation_mode: str = "keep_end"
    """``keep_end`` drops the oldest turns first; ``keep_start`` keeps the first tokens."""


@dataclass(frozen=True)
class Encoded:
    """One example's token ids before the token cuts of ``lengths.fit_lengths``.

    ``prompt_length_uncut`` is the prompt's length before its oldest turns were dropped (the
    summary's "before cut" length); ``notes`` name what was done (``turns_dropped``,
    ``text_bounded``, ``prompt_ends_with_space``) plus the converter's own notes.
    """

    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int] | None
    prompt_length_uncut: int
    notes: tuple[str, ...] = ()


def encode_settings(tokenizer, chat_template: str | None) -> EncodeSettings:
    """Raise ValueError if the tokenizer has no EOS token (a completion must end with one)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise ValueError("the tokenizer has no EOS token: completions could not end with one")
    bos = getattr(tokenizer, "bos_token_id", None)
    unk = getattr(tokenizer, "unk_token_id", None)
    return EncodeSettings(
        eos_token_id=int(eos),
        bos_token_id=None if bos is None else int(bos),
        add_bos=adds_bos(tokenizer),
        space_prefixed=prepends_space(tokenizer),
        end_ids=special_ids(tokenizer) - {bos, unk},
        chat_template=chat_template,
        max_token_chars=max_token_chars(tokenizer),
    )


def finish_completion(ids: list[int], settings: EncodeSettings) -> list[int]:
    """End ``ids`` with exactly one end token: keep a final EOS/end-of-turn, else append EOS."""
    ids = list(ids)
    while len(ids) >= 2 and ids[-1] == ids[-2] == settings.eos_token_id:
        ids.pop()  # "... </s></s>" in the data: one EOS is the end
    if ids and ids[-1] in settings.end_ids:
        return ids
    return [*ids, settings.eos_token_id]


def one_bos(ids: list[int], settings: EncodeSettings) -> list[int]:
    """``ids`` starting with exactly one BOS when the tokenizer adds one (else as they are, but
    a run of leading BOS tokens printed by a template is collapsed to one)."""
    bos = settings.bos_token_id
    if bos is None:
        return list(ids)
    start = 0
    while start < len(ids) and ids[start] == bos:
        start += 1
    if start == 0 and not settings.add_bos:
        return list(ids)
    return [bos, *ids[start:]]


def bound_text(text: str, max_tokens: int, settings: EncodeSettings, keep_end: bool) -> str:
    """``text`` cut to a character budget that still yields more than ``max_tokens`` tokens.

    No token covers more than ``settings.max_token_chars`` characters, so any ``c`` characters
    make at least ``c / max_token_chars`` tokens. The budget is ``2 x (max_tokens + 64) x
    max_token_chars`` characters: twice what is needed (normalizers may merge characters), plus
    64 tokens of slack so that the tokens near the cut, which may merge differently than in the
    whole text, are among those the length rules cut anyway. ``keep_end`` keeps the text's end
    (a prompt cut with ``keep_end``), else its start. Shorter texts are returned as they are.
    """
    if not max_tokens or not settings.max_token_chars:
        return text
    budget = 2 * (max_tokens + 64) * settings.max_token_chars
    if len(text) <= budget:
        return text
    return text[-budget:] if keep_end else text[:budget]


def _is_blank(value: str | Messages) -> bool:
    if isinstance(value, str):
        return not value.strip()
    return all(not m["content"].strip() for m in value)


def _bound_example(example: Example, settings: EncodeSettings, budget: TokenBudget) -> Example:
    """Every text of ``example`` through :func:`bound_text`: completions keep their start, the
    prompt what its truncation mode keeps (a prompt that is not cut is bounded by max_length,
    beyond which the pair is dropped anyway)."""
    prompt_tokens = budget.max_prompt_length or budget.max_length
    keep_end = budget.truncation_mode == "keep_end"

    def bound(value, max_tokens, end):
        if value is None:
            return None
        if isinstance(value, str):
            return bound_text(value, max_tokens, settings, end)
        return [
            {**m, "content": bound_text(m["content"], max_tokens, settings, end)} for m in value
        ]

    bounded = replace(
        example,
        prompt=bound(example.prompt, prompt_tokens, keep_end),
        chosen=bound(example.chosen, budget.max_length, False),
        rejected=bound(example.rejected, budget.max_length, False),
    )
    return (
        bounded if bounded == example else replace(bounded, notes=(*bounded.notes, "text_bounded"))
    )


def encode_example(
    example: Example, tokenizer, settings: EncodeSettings, budget: TokenBudget = TokenBudget()
) -> Encoded:
    """Token ids of one example; completions end with one EOS/end-of-turn, the prompt starts
    with exactly one BOS when the tokenizer adds one (see the module doc for the length rules
    applied here).

    Raises Filtered("empty_completion") for a blank chosen/rejected, Filtered("identical") when
    chosen == rejected, Filtered("empty_prompt") when the prompt has no token at all (nothing to
    predict the first completion token from), RowError when the chat template does not render the
    prompt as a prefix of the full conversation.
    """
    if _is_blank(example.chosen) or (example.rejected is not None and _is_blank(example.rejected)):
        raise Filtered("empty_completion")
    if example.rejected is not None and example.chosen == example.rejected:
        raise Filtered("identical")
    example = _bound_example(example, settings, budget)
    notes = list(example.notes)
    if example.conversational:
        prompt_ids, completions, uncut, dropped = _encode_chat(example, tokenizer, settings, budget)
        if dropped:
            notes.append("turns_dropped")
    else:
        prompt_ids = encode_prompt(example.prompt, tokenizer, settings)
        uncut = len(prompt_ids)
        if example.prompt.endswith(" "):
            notes.append("prompt_ends_with_space")
        completions = [
            None if c is None else encode_continuation(tokenizer, c, settings.space_prefixed)
            for c in (example.chosen, example.rejected)
        ]
    if not prompt_ids:
        raise Filtered("empty_prompt")
    chosen_ids = finish_completion(completions[0], settings)
    rejected_ids = None if completions[1] is None else finish_completion(completions[1], settings)
    if rejected_ids is not None and chosen_ids == rejected_ids:
        raise Filtered("identical")  # different text, same tokens (e.g. trailing spaces)
    return Encoded(prompt_ids, chosen_ids, rejected_ids, uncut, tuple(notes))


def exchanges(messages: Messages) -> tuple[Messages, list[Messages]]:
    """(leading system messages, the rest split into exchanges: each starts at a user message
    and runs to the next one; messages before the first user message form one exchange)."""
    n = 0
    while n < len(messages) and messages[n]["role"] == "system":
        n += 1
    system, units = messages[:n], []
    for message in messages[n:]:
        if message["role"] == "user" or not units:
            units.append([message])
        else:
            units[-1].append(message)
    return system, units


def prompt_form(
    prompt: str | Messages, tokenizer, settings: EncodeSettings, apply_chat_template: bool = True
) -> str | Messages:
    """The form in which a prompt given to sample from reaches the model: a text becomes one
    user turn (``[{"role": "user", "content": text}]``) when ``apply_chat_template`` and the
    tokenizer (or ``settings.chat_template``) has a chat template, as an instruct model expects;
    else a text stays as it stands; a message list is kept.

    The one place this is decided: a sampler writes this form beside its completions and every
    later reader (scoring, pairs) encodes it with :func:`encode_prompt` / :func:`encode_example`,
    so each stage feeds the model the prompt ids the completion was sampled after.
    """
    as_turn = apply_chat_template and has_chat_template(tokenizer, settings.chat_template)
    if isinstance(prompt, str) and as_turn:
        return [{"role": "user", "content": prompt}]
    return prompt


def encode_prompt(prompt: str | Messages, tokenizer, settings: EncodeSettings) -> list[int]:
    """Token ids of a prompt to complete; :func:`encode_example` encodes an example's prompt
    with it (before any length cut): a text as it is, a message list rendered by the chat
    template with the generation prompt; one BOS first when the tokenizer adds one.

    Raises:
        DataError: a message list and no chat template.
    """
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        return one_bos(ids, settings) if ids or settings.add_bos else ids
    _require_chat_template(tokenizer, settings)
    return _chat_prompt(prompt, tokenizer, settings)[1]


def _require_chat_template(tokenizer, settings: EncodeSettings) -> None:
    if not has_chat_template(tokenizer, settings.chat_template):
        raise DataError(
            "conversational data needs a chat template: the tokenizer has none; set "
            "data.chat_template (chatml, mistral or a Jinja file)"
        )


def _chat_prompt(messages: Messages, tokenizer, settings: EncodeSettings) -> tuple[str, list[int]]:
    """(rendered text, token ids) of a conversation's prompt, generation prompt included."""
    text = render_chat(tokenizer, messages, True, settings.chat_template)
    return text, one_bos(tokenizer.encode(text, add_special_tokens=False), settings)


def _encode_chat(example: Example, tokenizer, settings: EncodeSettings, budget: TokenBudget):
    """(prompt ids, completion ids per side, prompt length before dropping turns, whether turns
    were dropped)."""
    template = settings.chat_template
    _require_chat_template(tokenizer, settings)

    def prompt_tokens(messages):
        return _chat_prompt(messages, tokenizer, settings)

    prompt = example.prompt
    prompt_text, prompt_ids = prompt_tokens(prompt)
    uncut = len(prompt_ids)
    dropped = False
    limit = budget.max_prompt_length
    if limit and uncut > limit and budget.truncation_mode == "keep_end":
        system, units = exchanges(prompt)
        for start in range(1, len(units)):  # oldest exchanges first; the last one always stays
            candidate = system + [m for unit in units[start:] for m in unit]
            text, ids = prompt_tokens(candidate)
            prompt, prompt_text, prompt_ids, dropped = candidate, text, ids, True
            if len(ids) <= limit:
                break
    completions: list[list[int] | None] = []
    for field, messages in (("chosen", example.chosen), ("rejected", example.rejected)):
        if messages is None:
            completions.append(None)
            continue
        full = render_chat(tokenizer, prompt + messages, False, template)
        if not full.startswith(prompt_text):
            raise RowError(
                field,
                "the chat template renders the prompt differently inside the full conversation, so "
                "the "
                "completion cannot be cut off after the prompt",
            )
        completions.append(
            encode_continuation(
                tokenizer, full[len(prompt_text) :].rstrip(), settings.space_prefixed
            )
        )
    return prompt_ids, completions, uncut, dropped
