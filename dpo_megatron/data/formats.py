"""Row formats of preference data -> ``Example`` (prompt, chosen, rejected as text or messages).

Each converter takes one raw row (a dict) and returns the examples it makes (StackExchange rows
can make several). A malformed row raises ``RowError`` naming the field; a well-formed row that a
format's own rule leaves out (SHP score ratio, a question without two differently scored answers)
raises ``Filtered`` with the reason. Conversational examples hold lists of
``{"role": "system"|"user"|"assistant", "content": str}`` messages; the chosen/rejected lists hold
the assistant turn(s) that follow the prompt.

The formats are registered in the table at the end of this module (``format_registry``): adding a
format is its converter and one :class:`RowFormat` entry there (the columns that identify it,
what its rows hold, and a first-row test where formats share columns).
"""

from __future__ import annotations

import html
import re
from html.parser import HTMLParser
from typing import Any

from dpo_megatron.data.format_registry import (
    COMPLETIONS,
    FORMATS,
    UNPAIRED,
    ConvertOptions,
    Example,
    Filtered,
    Messages,
    RowError,
    RowFormat,
    Text,
    detect_format,
    get_format,
    register_format,
)

__all__ = [
    "FORMATS",
    "ConvertOptions",
    "Example",
    "Filtered",
    "Messages",
    "RowError",
    "RowFormat",
    "Text",
    "detect_format",
    "get_format",
    "register_format",
]


# ----------------------------------------------------------------------------------------------
# field helpers


def _get(row: dict, field: str) -> Any:
    if field not in row or row[field] is None:
        raise RowError(field, "missing")
    return row[field]


def _text(row: dict, field: str, key: str | None = None) -> str:
    """``row[key]`` (default: ``row[field]``) as a string; an error names ``field`` (a nested
    one in full: ``chosen[0].content``), and a key that is absent or null is ``missing``."""
    value = _get(row, field) if key is None else row.get(key)
    if value is None:
        raise RowError(field, "missing")
    if not isinstance(value, str):
        raise RowError(field, f"expected a string, got {type(value).__name__}")
    return value


def _messages(value: Any, field: str) -> Messages:
    if not isinstance(value, list):
        raise RowError(field, f"expected a list of messages, got {type(value).__name__}")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise RowError(
                f"{field}[{i}]", f"expected a message dict, got {type(message).__name__}"
            )
        role = message.get("role")
        if role not in ("system", "user", "assistant"):
            raise RowError(f"{field}[{i}].role", f"expected system/user/assistant, got {role!r}")
        out.append({"role": role, "content": _text(message, f"{field}[{i}].content", "content")})
    return out


def _check_prompt_messages(prompt: Messages, field: str) -> None:
    if not prompt:
        raise RowError(field, "the prompt has no messages")
    if prompt[-1]["role"] != "user":
        raise RowError(
            field, f"the prompt's last message must be from the user, got {prompt[-1]['role']!r}"
        )


def _check_completion_messages(messages: Messages, field: str) -> None:
    if not messages:
        raise RowError(field, "no completion message")
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            raise RowError(
                f"{field}[{i}].role",
                f"a completion message must be from the assistant, got {message['role']!r}",
            )


def common_text_prefix(a: str, b: str) -> str:
    """Longest common prefix of two strings that ends at a word boundary, before whitespace.

    "I like cats." / "I like cars." -> "I like" (not "I like ca": a split inside a word would
    give the completions tokens that the model never produces after the prompt). Whitespace at
    the split belongs to the completions (" cats." not "cats."), so they start with a space-led
    token. TRL splits at the first differing character instead.
    """
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    if n == len(a) == len(b):
        return a
    mid_word = 0 < n < min(len(a), len(b)) and not (
        a[n - 1].isspace() or a[n].isspace() or b[n].isspace()
    )
    while mid_word and n > 0 and not a[n - 1].isspace():
        n -= 1  # back to the start of the word the strings differ in
    while n > 0 and a[n - 1].isspace():
        n -= 1
    return a[:n]


def _common_message_prefix(a: Messages, b: Messages) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# ----------------------------------------------------------------------------------------------
# converters


def convert_standard(row: dict, cfg: ConvertOptions) -> list[Example]:
    """TRL standard: ``{"prompt": str, "chosen": str, "rejected": str}``."""
    return [Example(_text(row, "prompt"), _text(row, "chosen"), _text(row, "rejected"))]


def convert_implicit(row: dict, cfg: ConvertOptions) -> list[Example]:
    """TRL implicit prompt: ``{"chosen": str, "rejected": str}``; prompt = common prefix."""
    chosen, rejected = _text(row, "chosen"), _text(row, "rejected")
    if chosen == rejected:
        raise Filtered("identical")
    prompt = common_text_prefix(chosen, rejected)
    return [Example(prompt, chosen[len(prompt) :], rejected[len(prompt) :])]


def convert_conversational(row: dict, cfg: ConvertOptions) -> list[Example]:
    """TRL conversational: prompt/chosen/rejected are message lists."""
    prompt = _messages(_get(row, "prompt"), "prompt")
    chosen = _messages(_get(row, "chosen"), "chosen")
    rejected = _messages(_get(row, "rejected"), "rejected")
    _check_prompt_messages(prompt, "prompt")
    _check_completion_messages(chosen, "chosen")
    _check_completion_messages(rejected, "rejected")
    return [Example(prompt, chosen, rejected)]


def convert_conversational_implicit(row: dict, cfg: ConvertOptions) -> list[Example]:
    """TRL conversational, implicit prompt: chosen/rejected are whole conversations."""
    chosen = _messages(_get(row, "chosen"), "chosen")
    rejected = _messages(_get(row, "rejected"), "rejected")
    n = _common_message_prefix(chosen, rejected)
    if n == len(chosen) == len(rejected):
        raise Filtered("identical")
    prompt = chosen[:n]
    _check_prompt_messages(prompt, "chosen")
    _check_completion_messages(chosen[n:], "chosen")
    _check_completion_messages(rejected[n:], "rejected")
    return [Example(prompt, chosen[n:], rejected[n:])]


SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
}


def _sharegpt_turn(value: Any, field: str) -> dict:
    if isinstance(value, str):  # a bare answer string
        return {"role": "assistant", "content": value}
    if not isinstance(value, dict):
        raise RowError(field, f"expected a {{from, value}} dict, got {type(value).__name__}")
    role = SHAREGPT_ROLES.get(value.get("from"))
    if role is None:
        raise RowError(
            f"{field}.from", f"expected one of {sorted(SHAREGPT_ROLES)}, got {value.get('from')!r}"
        )
    return {"role": role, "content": _text(value, f"{field}.value", "value")}


def convert_sharegpt(row: dict, cfg: ConvertOptions) -> list[Example]:
    """ShareGPT / LLaMA-Factory: ``{"conversations": [{"from", "value"}], "chosen": {...},
    "rejected": {...}}``, optional ``"system"`` column; the system turn is kept."""
    turns = _get(row, "conversations")
    if not isinstance(turns, list):
        raise RowError("conversations", f"expected a list of turns, got {type(turns).__name__}")
    prompt = [_sharegpt_turn(t, f"conversations[{i}]") for i, t in enumerate(turns)]
    if (
        isinstance(row.get("system"), str)
        and row["system"]
        and not (prompt and prompt[0]["role"] == "system")
    ):
        prompt.insert(0, {"role": "system", "content": row["system"]})
    _check_prompt_messages(prompt, "conversations")
    chosen = [_sharegpt_turn(_get(row, "chosen"), "chosen")]
    rejected = [_sharegpt_turn(_get(row, "rejected"), "rejected")]
    _check_completion_messages(chosen, "chosen")
    _check_completion_messages(rejected, "rejected")
    return [Example(prompt, chosen, rejected)]


_HH_TURN = re.compile(r"\n\n(Human|Assistant):")


def parse_hh(text: str, field: str) -> Messages:
    """Anthropic HH text ("\\n\\nHuman: ...\\n\\nAssistant: ...") -> messages."""
    parts = _HH_TURN.split(text)
    if parts[0].strip():
        raise RowError(field, "text before the first '\\n\\nHuman:' turn")
    if len(parts) < 3:
        raise RowError(field, "no '\\n\\nHuman:' / '\\n\\nAssistant:' turns")
    roles = {"Human": "user", "Assistant": "assistant"}
    return [
        {"role": roles[parts[i]], "content": parts[i + 1].strip()} for i in range(1, len(parts), 2)
    ]


_HH_ASSISTANT = "\n\nAssistant:"
_HH_HUMAN = "\n\nHuman: "


def hh_split_point(chosen_text: str, rejected_text: str) -> int:
    """Index in both texts of the ``"\n\nAssistant:"`` that ends their longest common prefix
    ending with that marker (the prompt is ``text[:index + len(marker)]``).

    Raises:
        Filtered: identical texts (``identical``).
        RowError: no Assistant turn common to both dialogues.
    """
    if chosen_text == rejected_text:
        raise Filtered("identical")
    common = 0
    for x, y in zip(chosen_text, rejected_text):
        if x != y:
            break
        common += 1
    split = chosen_text.rfind(_HH_ASSISTANT, 0, common)  # the marker lies wholly in the prefix
    if split < 0:
        raise RowError(
            "rejected",
            "chosen and rejected dialogues share no Assistant turn: no "
            "common prompt to split them at",
        )
    return split


def _hh_reference_text(chosen_text: str, rejected_text: str) -> list[Example]:
    """The reference repo's HH split, as text: prompt up to and including the last common
    ``"\n\nAssistant:"``, completions the rest of each dialogue (``" answer"``)."""
    end = hh_split_point(chosen_text, rejected_text) + len(_HH_ASSISTANT)
    notes = (
        ()
        if chosen_text.rfind(_HH_ASSISTANT) + len(_HH_ASSISTANT)
        == end
        == (rejected_text.rfind(_HH_ASSISTANT) + len(_HH_ASSISTANT))
        else ("diverged_early",)
    )
    return [Example(chosen_text[:end], chosen_text[end:], rejected_text[end:], notes=notes)]


def convert_hh(row: dict, cfg: ConvertOptions) -> list[Example]:
    """Anthropic HH-RLHF raw: chosen/rejected are whole dialogues, usually differing only in
    their last Assistant turn (prompt = the turns before it).

    Some pairs differ earlier (about 1% of HH-RLHF: a different answer, then further turns).
    Those are split at the longest common prefix of the two texts that ends with
    ``"\n\nAssistant:"``: the prompt is the dialogue up to there, each completion the rest of
    its dialogue (possibly several turns), as in the reference DPO repo's PR #86. They are
    marked ``diverged_early`` (counted in the data summary).

    With ``data.reference_preprocessing`` the example is text, as the reference repo feeds it:
    prompt ``"\n\nHuman: ...\n\nAssistant:"``, completions ``" answer"`` (same split point).
    """
    chosen_text, rejected_text = _text(row, "chosen"), _text(row, "rejected")
    chosen = parse_hh(chosen_text, "chosen")
    rejected = parse_hh(rejected_text, "rejected")
    if chosen[-1]["role"] != "assistant":
        raise RowError("chosen", "the dialogue does not end with an Assistant turn")
    if rejected[-1]["role"] != "assistant":
        raise RowError("rejected", "the dialogue does not end with an Assistant turn")
    if cfg.reference_preprocessing:
        return _hh_reference_text(chosen_text, rejected_text)
    if chosen[:-1] == rejected[:-1]:
        prompt = chosen[:-1]
        _check_prompt_messages(prompt, "chosen")
        return [Example(prompt, chosen[-1:], rejected[-1:])]
    split = hh_split_point(chosen_text, rejected_text)
    prompt = parse_hh(chosen_text[:split], "chosen")
    _check_prompt_messages(prompt, "chosen")
    completions = [
        parse_hh(text[split:], field)
        for field, text in (("chosen", chosen_text), ("rejected", rejected_text))
    ]
    return [Example(prompt, completions[0], completions[1], notes=("diverged_early",))]


def _single_turn(
    question: str, chosen: str, rejected: str, cfg: ConvertOptions, group: str = ""
) -> Example:
    """One question and two answers: the reference repo's text form, or a user/assistant turn."""
    if cfg.reference_preprocessing:
        return Example(
            _HH_HUMAN + question + _HH_ASSISTANT, " " + chosen, " " + rejected, group=group
        )
    return Example(
        [{"role": "user", "content": question}],
        [{"role": "assistant", "content": chosen}],
        [{"role": "assistant", "content": rejected}],
        group=group,
    )


def convert_shp(row: dict, cfg: ConvertOptions) -> list[Example]:
    """Stanford SHP: ``history`` (the post), ``human_ref_A``/``human_ref_B`` comments, ``labels``
    (1: A preferred), scores; pairs under ``data.shp_min_score_ratio`` are filtered (the reference
    DPO repo's filter: ratio of the higher to the lower score >= 2). The example's ``group`` is
    the row's ``post_id`` (else its ``history``): the pipeline keeps the first
    ``data.shp_max_pairs_per_post`` pairs of each."""
    history = _text(row, "history")
    a, b = _text(row, "human_ref_A"), _text(row, "human_ref_B")
    label = _get(row, "labels")
    if label not in (0, 1):
        raise RowError("labels", f"expected 0 or 1, got {label!r}")
    ratio = row.get("score_ratio")
    if ratio is None:
        sa, sb = float(_get(row, "score_A")), float(_get(row, "score_B"))
        ratio = max(sa, sb) / max(min(sa, sb), 1e-9)
    if float(ratio) < cfg.shp_min_score_ratio:
        raise Filtered("score_ratio")
    chosen, rejected = (a, b) if label == 1 else (b, a)
    post = row.get("post_id")
    return [_single_turn(history, chosen, rejected, cfg, str(post) if post else history)]


class _HTMLText(HTMLParser):
    _BLOCKS = {
        "p",
        "br",
        "div",
        "pre",
        "li",
        "ul",
        "ol",
        "blockquote",
        "h1",
        "h2",
        "h3",
        "h4",
        "h5",
        "h6",
        "tr",
        "hr",
    }

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag in self._BLOCKS:
            self.parts.append("\n")

    def handle_endtag(self, tag):
        if tag in self._BLOCKS:
            self.parts.append("\n")

    def handle_data(self, data):
        self.parts.append(data)


def strip_html(text: str) -> str:
    """Plain text of an HTML fragment: tags removed, entities decoded, block tags -> newlines."""
    parser = _HTMLText()
    parser.feed(text)
    parser.close()
    out = html.unescape("".join(parser.parts))
    return re.sub(r"\n{3,}", "\n\n", out).strip()


def strip_html_reference(text: str) -> str:
    """The reference DPO repo's StackExchange HTML rule (``strip_html_tags``, BeautifulSoup's
    ``html.parser``): of the fragment's top-level elements, a ``<p>`` gives its direct text
    children (text inside nested tags such as ``<a>`` or ``<em>`` is dropped), a ``<pre>`` each of
    its ``<code>`` blocks and a ``<code>`` itself as ``"<code>" + text + "</code>"``; anything else
    is dropped; the parts are joined by blank lines."""
    try:
        from bs4 import BeautifulSoup, NavigableString
    except ImportError:
        raise RowError(
            "question",
            "data.reference_preprocessing on StackExchange rows needs "
            "beautifulsoup4 (pip install beautifulsoup4, or the "
            "'reference' extra)",
        ) from None
    parts = []
    for element in BeautifulSoup(text, "html.parser").children:
        if isinstance(element, NavigableString):
            continue
        if element.name == "p":
            parts.append("".join(c for c in element.children if isinstance(c, NavigableString)))
        elif element.name == "pre":
            parts.extend(f"<code>{code.get_text()}</code>" for code in element.find_all("code"))
        elif element.name == "code":
            parts.append(f"<code>{element.get_text()}</code>")
    return "\n\n".join(parts)


def _se_answers(row: dict, strip) -> tuple[str, list[tuple[float, str]]]:
    question = strip(_text(row, "question"))
    answers = _get(row, "answers")
    if not isinstance(answers, list):
        raise RowError("answers", f"expected a list, got {type(answers).__name__}")
    scored = []
    for i, answer in enumerate(answers):
        if not isinstance(answer, dict) or not isinstance(answer.get("text"), str):
            raise RowError(f"answers[{i}].text", "expected a string")
        score = answer.get("pm_score", answer.get("score"))
        if not isinstance(score, (int, float)):
            raise RowError(f"answers[{i}].pm_score", f"expected a number, got {score!r}")
        scored.append((float(score), strip(answer["text"])))
    return question, scored


def convert_se(row: dict, cfg: ConvertOptions) -> list[Example]:
    """StackExchange preferences: ``question`` and ``answers`` [{text, pm_score}]; the best-scored
    answer is chosen against up to ``data.se_max_pairs_per_question`` lower-scored ones (highest
    first); HTML stripped.

    With ``data.reference_preprocessing``: the reference repo's rule instead, every pair (i < j)
    of answers in file order with the higher ``pm_score`` chosen (a tie: answer j), its HTML
    rule (:func:`strip_html_reference`) and text form."""
    if cfg.reference_preprocessing:
        question, scored = _se_answers(row, strip_html_reference)
        if len(scored) < 2:
            raise Filtered("se_no_pair")
        pairs = [
            (i, j) if scored[i][0] > scored[j][0] else (j, i)
            for i in range(len(scored))
            for j in range(i + 1, len(scored))
        ]
        return [_single_turn(question, scored[c][1], scored[r][1], cfg) for c, r in pairs]
    question, answers = _se_answers(row, strip_html)
    scored = sorted(
        ((s, i, t) for i, (s, t) in enumerate(answers)), key=lambda t: (-t[0], t[1])
    )  # stable: ties keep the file's order
    if len(scored) < 2 or scored[0][0] == scored[-1][0]:
        raise Filtered("se_no_pair")
    best = scored[0]
    lower = [s for s in scored if s[0] < best[0]][: cfg.se_max_pairs_per_question]
    return [_single_turn(question, best[2], other[2], cfg) for other in lower]


def convert_ultrafeedback(row: dict, cfg: ConvertOptions) -> list[Example]:
    """UltraFeedback binarized: chosen/rejected are [user, assistant] conversations (+
    ``prompt``). The conversations' turns are the prompt trained on; a ``prompt`` text that is
    not their last user turn (whitespace aside) marks the example ``prompt_differs``."""
    chosen = _messages(_get(row, "chosen"), "chosen")
    rejected = _messages(_get(row, "rejected"), "rejected")
    if len(chosen) < 2 or len(rejected) < 2:
        raise RowError(
            "chosen" if len(chosen) < 2 else "rejected", "expected the user prompt and an answer"
        )
    if chosen[:-1] != rejected[:-1]:
        raise RowError(
            "rejected", "chosen and rejected conversations differ before the last answer"
        )
    prompt = chosen[:-1]
    _check_prompt_messages(prompt, "chosen")
    _check_completion_messages(chosen[-1:], "chosen")
    _check_completion_messages(rejected[-1:], "rejected")
    text, users = row.get("prompt"), [m["content"] for m in prompt if m["role"] == "user"]
    differs = isinstance(text, str) and (not users or text.strip() != users[-1].strip())
    return [Example(prompt, chosen[-1:], rejected[-1:], notes=("prompt_differs",) * differs)]


def convert_alpaca(row: dict, cfg: ConvertOptions) -> list[Example]:
    """Alpaca / LLaMA-Factory SFT: ``instruction``, optional ``input``, ``output``, ``system``."""
    instruction = _text(row, "instruction")
    extra = row.get("input") or ""
    if not isinstance(extra, str):
        raise RowError("input", f"expected a string, got {type(extra).__name__}")
    prompt = [{"role": "user", "content": instruction + ("\n" + extra if extra else "")}]
    if isinstance(row.get("system"), str) and row["system"]:
        prompt.insert(0, {"role": "system", "content": row["system"]})
    return [Example(prompt, [{"role": "assistant", "content": _text(row, "output")}], None)]


def _label(row: dict) -> bool:
    value = _get(row, "label")
    if not isinstance(value, bool):
        raise RowError("label", f"expected true (desirable) or false (undesirable), got {value!r}")
    return value


def convert_kto_messages(row: dict, cfg: ConvertOptions) -> list[Example]:
    """LLaMA-Factory's KTO rows (``kto_en_demo``): ``{"messages": [{"role", "content"}, ...],
    "label": bool}``; the completion is the last (assistant) message, the prompt the ones before
    it (ending with a user message)."""
    messages = _messages(_get(row, "messages"), "messages")
    if not messages or messages[-1]["role"] != "assistant":
        raise RowError("messages", "the last message must be the assistant's completion")
    _check_prompt_messages(messages[:-1], "messages")
    return [Example(messages[:-1], messages[-1:], None, label=_label(row))]


def convert_unpaired(row: dict, cfg: ConvertOptions) -> list[Example]:
    """TRL unpaired standard: ``{"prompt": str, "completion": str, "label": bool}``."""
    return [Example(_text(row, "prompt"), _text(row, "completion"), None, label=_label(row))]


def convert_unpaired_conversational(row: dict, cfg: ConvertOptions) -> list[Example]:
    """TRL unpaired conversational: ``prompt`` and ``completion`` are message lists, ``label``
    bool."""
    prompt = _messages(_get(row, "prompt"), "prompt")
    completion = _messages(_get(row, "completion"), "completion")
    _check_prompt_messages(prompt, "prompt")
    _check_completion_messages(completion, "completion")
    return [Example(prompt, completion, None, label=_label(row))]


def _is_list(field: str):
    """First-row test: ``field`` holds a list (of messages)."""
    return lambda row, cols: isinstance(row.get(field), list)


def _is_text(field: str):
    """First-row test: ``field`` holds a string."""
    return lambda row, cols: isinstance(row.get(field), str)


# The built-in formats, in the order detection tries their column sets (a set that includes
# another's comes first: prompt/chosen/rejected before chosen/rejected).
for _format in (
    RowFormat("sharegpt", convert_sharegpt, {"conversations", "chosen", "rejected"}),
    RowFormat("shp", convert_shp, {"history", "human_ref_A", "human_ref_B", "labels"}),
    RowFormat("se", convert_se, {"question", "answers"}),
    RowFormat("alpaca", convert_alpaca, {"instruction", "output"}, COMPLETIONS),
    RowFormat("kto_messages", convert_kto_messages, {"messages", "label"}, UNPAIRED),
    RowFormat(
        "unpaired_conversational",
        convert_unpaired_conversational,
        {"prompt", "completion", "label"},
        UNPAIRED,
        _is_list("completion"),
    ),
    RowFormat(
        "unpaired",
        convert_unpaired,
        {"prompt", "completion", "label"},
        UNPAIRED,
        lambda row, cols: not isinstance(row.get("completion"), list),
    ),
    RowFormat(
        "standard", convert_standard, {"prompt", "chosen", "rejected"}, matches=_is_text("chosen")
    ),
    RowFormat(  # a prompt string and whole conversations
        "ultrafeedback",
        convert_ultrafeedback,
        {"prompt", "chosen", "rejected"},
        matches=lambda row, cols: (
            isinstance(row.get("chosen"), list) and isinstance(row.get("prompt"), str)
        ),
    ),
    RowFormat(
        "conversational",
        convert_conversational,
        {"prompt", "chosen", "rejected"},
        matches=lambda row, cols: (
            isinstance(row.get("chosen"), list) and not isinstance(row.get("prompt"), str)
        ),
    ),
    RowFormat(
        "hh",
        convert_hh,
        {"chosen", "rejected"},
        matches=lambda row, cols: (
            isinstance(row.get("chosen"), str) and row["chosen"].startswith("\n\nHuman:")
        ),
    ),
    RowFormat(
        "implicit",
        convert_implicit,
        {"chosen", "rejected"},
        matches=lambda row, cols: (
            isinstance(row.get("chosen"), str) and not row["chosen"].startswith("\n\nHuman:")
        ),
    ),
    RowFormat(
        "conversational_implicit",
        convert_conversational_implicit,
        {"chosen", "rejected"},
        matches=_is_list("chosen"),
    ),
):
    register_format(_format)
