"""Tokenizers for the data path: Hugging Face tokenizers and raw SentencePiece ``.model`` files.

Both expose the small surface the data path needs: ``eos_token_id``, ``pad_token_id``,
``bos_token_id``, ``encode(text, add_special_tokens)``, ``decode``, ``chat_template`` and
``apply_chat_template(messages, tokenize=False, add_generation_prompt=...)``. On top of that,
``encode_continuation`` tokenizes a completion the way the model produces it right after a
prompt (no SentencePiece dummy-prefix space, no BOS), and ``render_chat`` applies a chat template
(the tokenizer's own, a built-in one, or a Jinja file).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

# Built-in chat templates, for tokenizers that have none (a raw SentencePiece model) or to
# override one. ``chatml``: the format of SmolLM2 / Qwen (without a default system prompt).
# ``mistral``: Mistral-7B-Instruct v0.1 ([INST] turns, the system turn folded into the first user
# turn, each answer ending with EOS); the space before an answer belongs to the answer, so the
# prompt ends at "[/INST]" and no space token dangles at the prompt/completion boundary.
BUILTIN_CHAT_TEMPLATES = {
    "chatml": (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
    "mistral": (
        "{%- set ns = namespace(system='') -%}"
        "{{- bos_token -}}"
        "{%- for message in messages -%}"
        "{%- if message['role'] == 'system' -%}{%- set ns.system = message['content'] + '\n\n' -%}"
        "{%- elif message['role'] == 'user' -%}"
        "{{- '[INST] ' + ns.system + message['content'] + ' [/INST]' -}}{%- set ns.system = '' -%}"
        "{%- elif message['role'] == 'assistant' -%}{{- ' ' + message['content'] + eos_token -}}"
        "{%- else -%}{{- raise_exception('mistral chat template: unknown role ' + message['role']) "
        "-}}"
        "{%- endif -%}"
        "{%- endfor -%}"
    ),
}


class SentencePieceTokenizer:
    """A SentencePiece ``.model`` file behind the Hugging Face tokenizer surface the data path uses.

    ``encode`` follows the Llama/Mistral reference tokenizers: every text segment between special
    tokens gets SentencePiece's dummy-prefix space, and ``add_special_tokens`` prepends BOS.
    Control-symbol strings in the text (``<s>``, ``</s>``) become their ids (chat templates emit
    them as text). The pad id is the model's pad id, or EOS when it has none.
    """

    def __init__(self, model_file: str | os.PathLike, chat_template: str | None = None):
        self.model_file = str(model_file)
        self._model_bytes = Path(model_file).read_bytes()
        self.chat_template = chat_template
        self._load()

    def _load(self) -> None:
        import sentencepiece as spm
        from sentencepiece import sentencepiece_model_pb2

        self._sp = spm.SentencePieceProcessor(model_proto=self._model_bytes)
        proto = sentencepiece_model_pb2.ModelProto()
        proto.ParseFromString(self._model_bytes)
        # A twin without the dummy prefix: " blue" -> "▁blue", "blue" -> "blue", as inside a text.
        proto.normalizer_spec.add_dummy_prefix = False
        self._sp_continue = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
        n = self._sp.get_piece_size()
        self.all_special_ids = [
            i for i in range(n) if self._sp.is_control(i) or self._sp.is_unknown(i)
        ]
        specials = sorted(
            (self._sp.id_to_piece(i) for i in self.all_special_ids), key=len, reverse=True
        )
        self._special_to_id = {self._sp.id_to_piece(i): i for i in self.all_special_ids}
        self._special_re = (
            re.compile("(" + "|".join(re.escape(s) for s in specials) + ")") if specials else None
        )

    def __getstate__(self) -> dict:  # picklable for datasets.map(num_proc>1)
        return {
            "model_file": self.model_file,
            "_model_bytes": self._model_bytes,
            "chat_template": self.chat_template,
        }

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._load()

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def bos_token_id(self) -> int | None:
        return self._sp.bos_id() if self._sp.bos_id() >= 0 else None

    @property
    def eos_token_id(self) -> int | None:
        return self._sp.eos_id() if self._sp.eos_id() >= 0 else None

    @property
    def pad_token_id(self) -> int | None:
        return self._sp.pad_id() if self._sp.pad_id() >= 0 else self.eos_token_id

    @property
    def bos_token(self) -> str:
        return self._sp.id_to_piece(self._sp.bos_id()) if self._sp.bos_id() >= 0 else ""

    @property
    def eos_token(self) -> str:
        return self._sp.id_to_piece(self._sp.eos_id()) if self._sp.eos_id() >= 0 else ""

    def _encode(self, text: str, continuation: bool) -> list[int]:
        parts = self._special_re.split(text) if self._special_re else [text]
        ids: list[int] = []
        first_text = True
        for part in parts:
            if not part:
                continue
            if part in self._special_to_id:
                ids.append(self._special_to_id[part])
                first_text = False
                continue
            sp = self._sp_continue if (continuation and first_text) else self._sp
            ids.extend(sp.encode(part))
            first_text = False
        return ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (BOS first if ``add_special_tokens`` and the model has one)."""
        ids = self._encode(text, continuation=False)
        if add_special_tokens and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def encode_continuation(self, text: str) -> list[int]:
        """Token ids of ``text`` as it continues a previous text: no dummy prefix, no BOS."""
        return self._encode(text, continuation=True)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids]
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._special_to_id.values()]
        return self._sp.decode(ids)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return [self._sp.id_to_piece(int(i)) for i in ids]

    def apply_chat_template(
        self,
        conversation: list[dict],
        tokenize: bool = False,
        add_generation_prompt: bool = False,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render ``conversation`` with a Jinja chat template (as transformers does)."""
        template = chat_template or self.chat_template
        if not template:
            raise ValueError(
                f"SentencePiece model {self.model_file} has no chat template; set "
                "data.chat_template"
            )
        text = _jinja_template(template).render(
            messages=conversation,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            **kwargs,
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text


@lru_cache(maxsize=16)
def _jinja_template(source: str):
    """Compile a chat template the way transformers does (sandboxed, trim_blocks, lstrip_blocks)."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)


def load_tokenizer(path: str):
    """A tokenizer from an HF folder / hub name, or a SentencePiece model (a ``.model`` file, or a
    folder holding only ``tokenizer.model``). A tokenizer without a pad token pads with EOS.

    Raises FileNotFoundError for a ``.model`` or local-looking path (``/``, ``.``, ``~``) that
    does not exist; OSError, in one line naming ``path``, for a folder or hub name transformers
    cannot load a tokenizer from (no tokenizer files, the hub unreachable, a name not found);
    ValueError for an empty path or for a ``mistral-common`` installed without its dependencies
    (which transformers imports for Mistral-family folders; the message says how to remove it).
    """
    if not path:
        raise ValueError("no tokenizer path: set data.tokenizer (or the model folder)")
    p = Path(path).expanduser()
    if p.suffix == ".model" or p.name == "tokenizer.model":
        if not p.is_file():
            raise FileNotFoundError(f"SentencePiece model {p} does not exist")
        return SentencePieceTokenizer(p)
    if (
        p.is_dir()
        and (p / "tokenizer.model").is_file()
        and not ((p / "tokenizer.json").is_file() or (p / "tokenizer_config.json").is_file())
    ):
        return SentencePieceTokenizer(p / "tokenizer.model")
    if not p.exists() and path.startswith(("/", ".", "~")):
        raise FileNotFoundError(f"tokenizer {path} does not exist")
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(p) if p.exists() else path)
    except (OSError, ValueError) as e:  # transformers' own messages run over several lines
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if p.is_dir() and not has_tokenizer_files(str(p)):
            reason = "the folder holds no tokenizer.json, tokenizer_config.json or tokenizer.model"
        raise OSError(f"cannot load a tokenizer from {path}: {reason}") from None
    except ImportError:
        # transformers routes mistral / mixtral folders through mistral_common whenever it is
        # importable; one installed without its dependencies (earlier set-ups did) fails there.
        from dpo_megatron.utils.mistral_common import mistral_common_unusable

        missing = mistral_common_unusable()
        if missing is None:
            raise
        raise ValueError(
            f"cannot load the tokenizer of {path}: transformers reads Mistral-family tokenizers "
            f"through mistral-common, installed in {sys.prefix} without its dependency "
            f"{missing}; run `bash scripts/setup.sh` again (it removes that install) or "
            f"`{sys.executable} -m pip uninstall mistral-common`"
        ) from None
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def has_tokenizer_files(folder: str) -> bool:
    """Whether ``folder`` is a folder holding a tokenizer :func:`load_tokenizer` reads
    (``tokenizer.json``, ``tokenizer_config.json`` or ``tokenizer.model``)."""
    if not folder or not Path(folder).expanduser().is_dir():
        return False
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    return any((Path(folder).expanduser() / name).is_file() for name in names)


def resolve_chat_template(spec: str) -> str | None:
    """The template text for a ``data.chat_template`` value (empty -> None = the tokenizer's
    own)."""
    if not spec:
        return None
    if spec in BUILTIN_CHAT_TEMPLATES:
        return BUILTIN_CHAT_TEMPLATES[spec]
    path = Path(spec).expanduser()
    if not path.is_file():
        raise ValueError(
            f"data.chat_template={spec!r} is neither a built-in template "
            f"{sorted(BUILTIN_CHAT_TEMPLATES)} nor a file"
        )
    return path.read_text()


def has_chat_template(tokenizer, chat_template: str | None) -> bool:
    return bool(chat_template or getattr(tokenizer, "chat_template", None))


def render_chat(
    tokenizer, messages: list[dict], add_generation_prompt: bool, chat_template: str | None
) -> str:
    """Chat-template text of ``messages`` (``chat_template`` overrides the tokenizer's own)."""
    kwargs = {"chat_template": chat_template} if chat_template else {}
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
    )


def special_ids(tokenizer) -> frozenset[int]:
    """Ids of the tokenizer's special tokens (BOS, EOS, end-of-turn markers, ...)."""
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for attr in ("eos_token_id", "bos_token_id", "pad_token_id"):
        value = getattr(tokenizer, attr, None)
        if value is not None:
            ids.add(int(value))
    return frozenset(ids)


def adds_bos(tokenizer) -> bool:
    """Whether the tokenizer puts BOS before a text it encodes with special tokens."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    ids = tokenizer.encode("a", add_special_tokens=True)
    return bool(ids) and ids[0] == bos


def max_token_chars(tokenizer) -> int:
    """Characters of the longest vocabulary entry (special tokens included): no token covers
    more characters of a text. Byte-level BPE entries spell one character per byte, and
    SentencePiece pieces one per character ("\u2581" for a space), so the count is an upper
    bound either way. 0 when the tokenizer does not expose its vocabulary."""
    if isinstance(tokenizer, SentencePieceTokenizer):
        return max(len(tokenizer._sp.id_to_piece(i)) for i in range(tokenizer.vocab_size))
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return 0
    return max((len(token) for token in get_vocab()), default=0)


def prepends_space(tokenizer) -> bool:
    """True for SentencePiece-style HF tokenizers that add a "▁" before every encoded text."""
    ids = tokenizer.encode("a", add_special_tokens=False)
    tokens = tokenizer.convert_ids_to_tokens(ids)
    return bool(tokens) and tokens[0].startswith("\u2581")


def encode_continuation(tokenizer, text: str, space_prefixed: bool | None = None) -> list[int]:
    """Token ids of ``text`` as produced right after a prompt: no BOS/EOS added, no dummy space.

    SentencePiece-style tokenizers put a "▁" (space) before the start of every text they encode;
    inside a text there is none before "Paris" in "The capital is:Paris". For those, the text is
    encoded after an anchor ("\\n", a byte token that merges with nothing that follows) and the
    anchor's ids are removed. ``space_prefixed`` is ``prepends_space(tokenizer)``, computed here
    when not given.
    """
    if isinstance(tokenizer, SentencePieceTokenizer):
        return tokenizer.encode_continuation(text)
    if not text:
        return []
    if space_prefixed is None:
        space_prefixed = prepends_space(tokenizer)
    if not space_prefixed:
        return tokenizer.encode(text, add_special_tokens=False)
    anchor = tokenizer.encode("\n", add_special_tokens=False)
    ids = tokenizer.encode("\n" + text, add_special_tokens=False)
    if ids[: len(anchor)] == anchor:
        return ids[len(anchor) :]
    return tokenizer.encode(text, add_special_tokens=False)


def tokenizer_fingerprint(tokenizer) -> str:
    """A string that changes when the tokenizer's files or vocabulary change (for cache keys)."""
    import hashlib

    digest = hashlib.sha256()
    if isinstance(tokenizer, SentencePieceTokenizer):
        digest.update(tokenizer._model_bytes)
        digest.update((tokenizer.chat_template or "").encode())
        return "sp-" + digest.hexdigest()
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(
        tokenizer, "_tokenizer", None
    )
    if backend is not None and hasattr(backend, "to_str"):
        digest.update(backend.to_str().encode())
    else:
        digest.update(repr(sorted(tokenizer.get_vocab().items())).encode())
    for attr in ("chat_template", "bos_token", "eos_token", "pad_token"):
        digest.update(repr(getattr(tokenizer, attr, None)).encode())
    digest.update(repr(adds_bos(tokenizer)).encode())
    return "hf-" + digest.hexdigest()
