"""What the front doors for other tools' command lines (:mod:`~dpo_megatron.frontends.dpo_repo`,
:mod:`~dpo_megatron.frontends.trl`) share: their error, the repository root their base configs
are read from, and the training items counted with the engine's own data pipeline (epochs ->
steps).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
"""The repository root (the base configs are ``configs/*.yaml`` under it)."""


class FrontendError(ValueError):
    """A command in another tool's dialect that cannot be translated (the message says why)."""


def count_items(overrides: Sequence[str], config: str, kind: str = "pairs") -> int:
    """Training items of ``kind`` (``data.kinds``: ``pairs``, or ``sft`` examples) the engine
    makes of the data with these overrides on ``config`` (a path under :data:`ROOT`): the
    engine's own pipeline, so the count is the run's (its cache is then warm).

    Raises:
        FrontendError: the tokenizer or the data cannot be read (e.g. a hub model or
            dataset on an offline machine), with what to give instead.
    """
    from dpo_megatron.config import load_config
    from dpo_megatron.data import load_items, load_tokenizer
    from dpo_megatron.data.sources import is_local_source

    cfg = load_config(os.path.join(ROOT, config), [*overrides, "train.train_iters=1"])
    tokenizer_source = cfg.data.tokenizer or cfg.model.hf_path
    quiet = dataclasses.replace(cfg.data, verbose=False)  # a count: no data summary printed
    remote = [name for name in (tokenizer_source,) if not os.path.isdir(name)] + [
        name for name, _ in cfg.data.sources() if not is_local_source(name)
    ]
    try:
        if remote and hub_offline():  # say so now, not after the hub clients' retries
            raise OSError(
                f"the Hugging Face hub is not reachable from here (offline) for {', '.join(remote)}"
            )
        tokenizer = load_tokenizer(tokenizer_source)
        dataset = load_items(quiet, tokenizer, kind)
    except OSError as e:  # also the hub clients' ConnectionError / OfflineModeIsEnabled
        # n_epochs -> steps needs the pairs counted, so this is where a hub name meets a
        # machine without the hub: one line that says what to give instead, no traceback.
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:300].rstrip(".")
        data = ", ".join(source for source, _ in cfg.data.sources())
        raise FrontendError(
            f"cannot read the tokenizer {tokenizer_source!r} or the data {data} to count the "
            f"training pairs (n_epochs -> steps): {reason}. Without the Hugging Face hub, give "
            f"local copies: model=blank_model model.name_or_path=<HF folder> (or download the "
            f"preset's model and set DPO_MEGATRON_MODELS) and datasets=[<local file or "
            f"folder>]"
        ) from e
    return len(dataset.train)


def hub_offline(timeout_s: float = 3.0) -> bool:
    """Whether the Hugging Face hub is out of reach: ``HF_HUB_OFFLINE`` (or
    ``TRANSFORMERS_OFFLINE`` / ``HF_DATASETS_OFFLINE``) is set, or no TCP connection to the hub
    (``HF_ENDPOINT``, default huggingface.co, port 443) opens within ``timeout_s``. One try:
    the hub clients would otherwise spend about a minute on retries before failing."""
    import socket
    from urllib.parse import urlparse

    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            return True
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout_s).close()
    except OSError:
        return True
    return False
