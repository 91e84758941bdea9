"""``Example`` -> token ids (prompt, chosen, rejected), before any length limit.

The prompt is tokenized alone, exactly as the model sees it at generation time; each completion
is tokenized as a continuation (``encode_continuation``: no BOS, no dummy-prefix space), so its
ids are what the model would emit after the prompt and no token straddles the boundary.

Conversational examples go through a chat template: the prompt is rendered with the generation
prompt (e.g. ``<|im_start|>assistant\\n``) and the completion is the rest of the rendered full
conversation, with the whitespace a template prints after its end-of-turn token removed (the model
stops at the end-of-turn token). A completion that ends with a special token (EOS or a template's
end-of-turn such as ``<|im_end|>``) keeps it and gets no EOS after it; any other gets one EOS.
"""

from __future__ import annotations

from dataclasses import dataclass
from .formats import Example, Filtered, Messages, RowError
from .tokenizer import adds_bos, encode_continuation, prepends_space, render_chat, special_ids


@dataclass(frozen=True)
class EncodeSettings:
    """Per-tokenizer facts computed once (they cost an encode call each)."""

    eos_token_id: int
    bos_token_id: int | None
    add_bos: bool
    space_prefixed: bool
    end_ids: frozenset[int]
    chat_template: str | None


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
    )


def finish_completion(ids: list[int], settings: EncodeSettings) -> list[int]:
    """End ``ids`` with exactly one end token: keep a final EOS/end-of-turn, else append EOS."""
    ids = list(ids)
    while len(ids) >= 2 and ids[-1] == ids[-2] == settings.eos_token_id:
        ids.pop()  # "... </s></s>" in the data: one EOS is the end
    if ids and ids[-1] in settings.end_ids:
        return ids
    return [*ids, settings.eos_token_id]


def _is_blank(value: str | Messages) -> bool:
    if isinstance(value, str):
        return not value.strip()
    return all(not m["content"].strip() for m in value)


def encode_example(
    example: Example, tokenizer, settings: EncodeSettings
) -> tuple[list[int], list[int], list[int] | None]:
    """(prompt_ids, chosen_ids, rejected_ids or None); completions end with one EOS/end-of-turn.

    Raises Filtered("empty_completion") for a blank chosen/rejected, Filtered("identical") when
    chosen == rejected, Filtered("empty_prompt") when the prompt has no token at all (nothing to
    predict the first completion token from), RowError when the chat template does not render the
    prompt as a prefix of the full conversation.
    """
    if _is_blank(example.chosen) or (example.rejected is not None and _is_blank(example.rejected)):
        raise Filtered("empty_completion")
    if example.rejected is not None and example.chosen == example.rejected:
        raise Filtered("identical")
    if example.conversational:
        prompt_ids, completions = _encode_chat(example, tokenizer, settings)
    else:
        prompt_ids = tokenizer.encode(example.prompt, add_special_tokens=False)
        if settings.add_bos:
            prompt_ids = [settings.bos_token_id, *prompt_ids]
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
    return prompt_ids, chosen_ids, rejected_ids


def _encode_chat(example: Example, tokenizer, settings: EncodeSettings) -> tuple[list[int], list]:
    template = settings.chat_template
    if not (template or getattr(tokenizer, "chat_template", None)):
        raise ValueError("conversational data needs a chat template: the tokenizer has none; set data.chat_template")
    prompt_text = render_chat(tokenizer, example.prompt, True, template)
    completions: list[list[int] | None] = []
    for field, messages in (("chosen", example.chosen), ("rejected", example.rejected)):
        if messages is None:
            completions.append(None)
            continue
        full = render_chat(tokenizer, example.prompt + messages, False, template)
        if not full.startswith(prompt_text):
            raise RowError(
                field,
                "the chat template renders the prompt differently inside the full conversation, so the "
                "completion cannot be cut off after the prompt",
            )
        completions.append(encode_continuation(tokenizer, full[len(prompt_text) :].rstrip(), settings.space_prefixed))
    prompt_ids = tokenizer.encode(prompt_text, add_special_tokens=False)
    return prompt_ids, completions
