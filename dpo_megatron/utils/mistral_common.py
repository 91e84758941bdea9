"""Whether this interpreter's ``mistral_common`` can serve transformers (earlier set-ups left a
copy installed without its dependencies, on which transformers fails for every Mistral-family
tokenizer): read by the tokenizer loader's error and by ``scripts/assets.py``, which removes it."""

from __future__ import annotations

import importlib
import importlib.util

MISTRAL_COMMON_MODULE = "mistral_common"


def mistral_common_unusable() -> str | None:
    """Why this interpreter's ``mistral_common`` cannot serve transformers: the module its
    tokenizers fail to import (``tiktoken`` for the ``--no-deps`` install earlier set-ups made),
    or None when it is not installed or imports."""
    if importlib.util.find_spec(MISTRAL_COMMON_MODULE) is None:
        return None
    try:
        importlib.import_module(f"{MISTRAL_COMMON_MODULE}.tokens.tokenizers.tekken")
    except ImportError as e:
        return e.name or str(e)
    return None
