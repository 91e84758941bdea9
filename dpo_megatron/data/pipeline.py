"""Raw rows -> ``PreferencePair`` lists: read, convert, tokenize (parallel, cached), fit, split, mix.

``load_preference_pairs`` reads top to bottom:
1. each source is read (``reader``) and its format detected (``formats.detect_format``);
2. every row is converted and tokenized in a ``datasets.map`` (``num_proc`` workers); the
   result is cached on disk under a key made of the data file's identity, the tokenizer's
   fingerprint, the chat template and the settings that affect tokens;
3. malformed rows stop the load with file, row and field (``on_error=raise``) or are counted
   (``skip``); a file none of whose rows fits its format stops the load either way, naming the
   format its columns fit; filtered rows (empty completion, chosen == rejected, ...) are
   counted by reason;
4. per-post caps are applied (SHP: ``shp_max_pairs_per_post``), length limits
   (``lengths.fit_lengths``), duplicates counted (and dropped with ``drop_duplicates``), each
   source's eval share is split off, and the training pairs of several sources are mixed by
   ``weights``; the sources of ``eval_datasets`` (read at ``eval_split``) go through steps 1-4
   the same way, their kept pairs making the eval set;
5. the summary (rows read, pairs kept, drops by reason, cuts by kind, notes, duplicates, length
   percentiles) is printed.

``check_sources`` runs steps 1 and the conversion of step 2 without a tokenizer, over the training
and the eval sources: the launchers' pre-check, so that a missing file or a row that does not fit
its format is reported before any rank starts.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from dpo_megatron.data.config import DataConfig, as_data_config
from dpo_megatron.data.encode import EncodeSettings, TokenBudget, encode_example, encode_settings
from dpo_megatron.data.formats import (
    CONVERTERS,
    SFT_ONLY_FORMATS,
    UNPAIRED_FORMATS,
    Filtered,
    RowError,
    detect_format,
)
from dpo_megatron.data.lengths import fit_lengths
from dpo_megatron.data.pairs import (
    PreferenceDataset,
    PreferencePair,
    SFTDataset,
    SFTExample,
    UnpairedDataset,
    UnpairedExample,
)
from dpo_megatron.data.reader import (
    JSON_COLUMN,
    WHERE_COLUMN,
    DataError,
    Source,
    is_local_source,
    read_source,
)
from dpo_megatron.data.summary import drop_warning, format_summary, length_stats
from dpo_megatron.data.tokenizer import resolve_chat_template, tokenizer_fingerprint
from dpo_megatron.utils import ranks
from dpo_megatron.utils.cache import cache_root, content_key
from dpo_megatron.utils.files import atomic_dir

logger = logging.getLogger(__name__)

# Settings that change the tokenized rows. The length limits do since the encoder drops whole
# turns and bounds huge texts before tokenizing; their token cuts still apply after the cache.
_TOKENIZE_FIELDS = (
    "on_error",
    "shp_min_score_ratio",
    "se_max_pairs_per_question",
    "max_length",
    "max_prompt_length",
    "truncation_mode",
)


def load_preference_pairs(cfg: DataConfig, tokenizer) -> PreferenceDataset:
    """Preference pairs for DPO: ``.train``, ``.eval`` (lists of PreferencePair) and ``.summary``.

    Raises DataError for malformed input (message: file, row/line, field), ValueError for an
    invalid config or an undetectable format.
    """
    train, eval_, summary = _load(cfg, tokenizer, sft=False)
    return PreferenceDataset(
        [PreferencePair(p, c, r) for p, c, r, _ in train],
        [PreferencePair(p, c, r) for p, c, r, _ in eval_],
        summary,
    )


def load_sft_examples(cfg: DataConfig, tokenizer) -> SFTDataset:
    """The SFT view of the same files: prompt + chosen (or an Alpaca file's output) per example."""
    train, eval_, summary = _load(cfg, tokenizer, sft=True)
    return SFTDataset(
        [SFTExample(p, c) for p, c, _, _ in train],
        [SFTExample(p, c) for p, c, _, _ in eval_],
        summary,
    )


def load_unpaired_examples(cfg: DataConfig, tokenizer) -> UnpairedDataset:
    """Unpaired examples for KTO (formats ``kto_messages``, ``unpaired``,
    ``unpaired_conversational``), each with its mismatched completion for the KL estimate
    (``unpaired.with_kl_completions``, within the train and the eval split); the summary adds
    ``labels`` (desirable / undesirable counts of the training split). Same errors as
    :func:`load_preference_pairs`."""
    from dpo_megatron.data.unpaired import label_counts, with_kl_completions

    cfg = as_data_config(cfg)
    train, eval_, summary = _load(cfg, tokenizer, sft=False, unpaired=True)

    def examples(items):
        return [UnpairedExample(p, c, bool(label)) for p, c, _, label in items]

    train, eval_ = (with_kl_completions(examples(x), cfg.max_length) for x in (train, eval_))
    summary["labels"] = label_counts(train)
    if cfg.verbose and _is_rank_zero():
        print(
            f"labels (train): {summary['labels']['desirable']} desirable, "
            f"{summary['labels']['undesirable']} undesirable",
            flush=True,
        )
    return UnpairedDataset(train, eval_, summary)


def load_items(cfg: DataConfig, tokenizer, kind: str):
    """The items a loss trains on (``LossFunction.item_kind``): "pairs"
    (:func:`load_preference_pairs`), "sft" (:func:`load_sft_examples`) or "unpaired"
    (:func:`load_unpaired_examples`)."""
    loaders = {
        "pairs": load_preference_pairs,
        "sft": load_sft_examples,
        "unpaired": load_unpaired_examples,
    }
    return loaders[kind](cfg, tokenizer)


def _load(cfg: DataConfig, tokenizer, sft: bool, unpaired: bool = False):
    cfg = as_data_config(cfg)
    cfg.validate()
    chat_template = resolve_chat_template(cfg.chat_template)
    settings = encode_settings(tokenizer, chat_template)

    def load_source(index: int, name: str, fmt: str, split: str) -> dict:
        source = read_source(name, split, cfg.on_error)
        fmt = _source_format(source, fmt, sft, unpaired)
        tokenized = tokenize_source(source, fmt, tokenizer, settings, cfg, sft)
        return _fit_source(index, source, fmt, tokenized, cfg, sft or unpaired, settings)

    # formats already checked by validate(); eval sources hold no eval share (validate())
    per_source = [
        load_source(i, name, fmt, cfg.split) for i, (name, fmt) in enumerate(cfg.sources())
    ]
    eval_sources = [
        load_source(i, name, fmt, cfg.eval_split) | {"role": "eval"}
        for i, (name, fmt) in enumerate(cfg.eval_sources())
    ]
    eval_ = [x for info in per_source for x in info["eval"]] + [
        x for info in eval_sources for x in info["kept"]
    ]
    train = _mix([info["train"] for info in per_source], cfg)
    summary = _summarize(per_source + eval_sources, train, eval_, cfg, sft or unpaired)
    warning = drop_warning(summary)
    if cfg.verbose and _is_rank_zero():
        print(format_summary(summary), flush=True)
        if warning:
            print(warning, flush=True)
    logger.info("%s", format_summary(summary))
    spaced = summary["notes"].get("prompt_ends_with_space", 0)
    if spaced and _is_rank_zero():  # once per load, with the count (TRL warns per row)
        logger.warning(
            "%d text prompt(s) end with a space: the space becomes a token of its own at the end "
            "of the prompt, a boundary the model rarely sees before an answer (completions then "
            "start without their usual space-led token). Move the space into the completions or "
            "strip it.",
            spaced,
        )
    return train, eval_, summary


def _source_format(source: Source, fmt: str, sft: bool, unpaired: bool = False) -> str:
    """The format of a source: ``fmt``, or detected from its columns for ``auto``.

    Raises:
        DataError: the source has no rows, its format cannot be told from its columns (naming
            the source), its format has no rejected answers outside SFT, or its rows are
            unpaired for a paired loss or paired for an unpaired one.
    """
    if len(source.dataset) == 0:
        raise DataError(f"{source.label}: no rows")
    if fmt == "auto":
        try:
            fmt = detect_format(_columns(source), _first_row(source), source.label)
        except ValueError as e:
            raise DataError(str(e)) from None
    if fmt in SFT_ONLY_FORMATS and not sft:
        raise DataError(
            f"{source.label}: format {fmt!r} has no rejected answers; it serves the "
            f"SFT stage only (loss.name=sft)"
        )
    if unpaired and fmt not in UNPAIRED_FORMATS:
        raise DataError(
            f"{source.label}: format {fmt!r} holds pairs; an unpaired loss (kto) reads "
            f"rows with a completion and a label: {', '.join(sorted(UNPAIRED_FORMATS))}"
        )
    if not unpaired and fmt in UNPAIRED_FORMATS:
        raise DataError(
            f"{source.label}: format {fmt!r} holds unpaired rows (a completion and a "
            f"label): train on it with loss.name=kto"
        )
    return fmt


def check_sources(
    cfg: DataConfig, sft: bool = False, unpaired: bool = False
) -> list[tuple[str, str]]:
    """[(source, format)] after reading every local source, training (``data.split``) then eval
    (``data.eval_datasets`` at ``data.eval_split``), and converting each of its rows (no
    tokenizer): what ``load_preference_pairs`` would refuse before tokenizing, refused here.
    Hub names are not read (they need the network); the load checks them.

    Raises:
        DataError: as the load would, with the same messages.
    """
    cfg = as_data_config(cfg)
    out = []
    for (name, fmt), split in [(s, cfg.split) for s in cfg.sources()] + [
        (s, cfg.eval_split) for s in cfg.eval_sources()
    ]:
        if not is_local_source(name):
            out.append((name, fmt))
            continue
        source = read_source(name, split, cfg.on_error)
        fmt = _source_format(source, fmt, sft, unpaired)
        errors, converted = [], 0
        for where, row in _rows(source):
            try:
                CONVERTERS[fmt](row, cfg)
                converted += 1
            except Filtered:
                converted += 1
            except RowError as e:
                errors.append(f"{source.label}: {where}: {e}")
        _raise_row_errors(source, fmt, errors, converted, cfg)
        out.append((source.label, fmt))
    return out


def _rows(source: Source):
    """(location, row dict) of every row of a source."""
    if JSON_COLUMN in source.dataset.column_names:
        for where, text in zip(source.dataset[WHERE_COLUMN], source.dataset[JSON_COLUMN]):
            yield where, json.loads(text)
    else:
        for index, row in enumerate(source.dataset):
            yield f"row {index}", row


def _raise_row_errors(
    source: Source, fmt: str, errors: list[str], fitting: int, cfg: DataConfig
) -> None:
    """Stop on malformed rows: always when no row fits ``fmt`` (naming the format the columns
    fit instead: skipping would drop every row), else per ``data.on_error``."""
    if not errors:
        return
    if fitting == 0:
        try:
            looks = detect_format(_columns(source), _first_row(source), source.label)
            hint = (
                f"its columns {sorted(_columns(source))} look like format {looks!r}: set "
                f"data.format={looks} (or auto)"
                if looks != fmt
                else f"its columns look like {fmt!r} but no row parses as one"
            )
        except ValueError:
            hint = f"its columns {sorted(_columns(source))} fit no known format"
        raise DataError(
            f"{source.label}: no row fits data.format={fmt!r} (first: "
            f"{errors[0].removeprefix(source.label + ': ')}); {hint}"
        )
    if cfg.on_error == "raise":
        more = f" (and {len(errors) - 1} more bad rows)" if len(errors) > 1 else ""
        raise DataError(errors[0] + more + "; set data.on_error=skip to drop and count them")


def _is_rank_zero() -> bool:
    """True unless torch.distributed is initialized and this is not global rank 0."""
    return ranks.is_rank0()


def _columns(source: Source) -> list[str]:
    if JSON_COLUMN in source.dataset.column_names:
        return list(json.loads(source.dataset[0][JSON_COLUMN]).keys())
    return list(source.dataset.column_names)


def _first_row(source: Source) -> dict:
    row = source.dataset[0]
    return json.loads(row[JSON_COLUMN]) if JSON_COLUMN in row else row


# ----------------------------------------------------------------------------------------------
# tokenization (parallel, cached)


def _tokenize_batch(
    batch: dict, indices: list[int], *, fmt, cfg_dict, tokenizer, settings, label, sft
) -> dict:
    """``datasets.map`` worker: rows -> one output row per example or per dropped/bad row."""
    cfg = DataConfig(**cfg_dict)
    budget = TokenBudget(cfg.max_length, cfg.max_prompt_length, cfg.truncation_mode)
    out = {
        "where": [],
        "prompt_ids": [],
        "chosen_ids": [],
        "rejected_ids": [],
        "drop": [],
        "error": [],
        "prompt_length_uncut": [],
        "notes": [],
        "group": [],
        "label": [],
    }

    def emit(where, encoded=None, drop="", error="", group="", label=None):
        out["where"].append(where)
        out["prompt_ids"].append(list(encoded.prompt_ids) if encoded else [])
        out["chosen_ids"].append(list(encoded.chosen_ids) if encoded else [])
        out["rejected_ids"].append(list(encoded.rejected_ids or []) if encoded else [])
        out["prompt_length_uncut"].append(encoded.prompt_length_uncut if encoded else 0)
        out["notes"].append(list(encoded.notes) if encoded else [])
        out["drop"].append(drop)
        out["error"].append(error)
        out["group"].append(group)
        out["label"].append(-1 if label is None else int(label))

    columns = [c for c in batch if c not in (JSON_COLUMN, WHERE_COLUMN)]
    for k, index in enumerate(indices):
        if JSON_COLUMN in batch:
            row, where = json.loads(batch[JSON_COLUMN][k]), batch[WHERE_COLUMN][k]
        else:
            row, where = {c: batch[c][k] for c in columns}, f"row {index}"
        try:
            examples = CONVERTERS[fmt](row, cfg)
            for example in examples:
                if sft:
                    example = replace(example, rejected=None)
                try:
                    emit(
                        where,
                        encode_example(example, tokenizer, settings, budget),
                        group=example.group,
                        label=example.label,
                    )
                except Filtered as f:
                    emit(where, drop=f.reason)
        except Filtered as f:
            emit(where, drop=f.reason)
        except RowError as e:
            emit(where, drop="malformed", error=f"{label}: {where}: {e}")
    return out


def _source_identity(source: Source) -> dict | list:
    if source.files:
        stats = [(str(Path(f).resolve()), Path(f).stat()) for f in source.files]
        return [{"path": p, "size": st.st_size, "mtime_ns": st.st_mtime_ns} for p, st in stats]
    return {"name": source.label, "fingerprint": getattr(source.dataset, "_fingerprint", None)}


def tokenization_cache_key(
    source: Source, fmt: str, tokenizer, settings: EncodeSettings, cfg: DataConfig, sft: bool
) -> str:
    """sha256 over the data's identity, the tokenizer, the chat template and the token-affecting settings."""
    key = {
        "source": _source_identity(source),
        "malformed": source.malformed,
        "format": fmt,
        "sft": sft,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "settings": {
            k: (sorted(v) if isinstance(v, frozenset) else v) for k, v in asdict(settings).items()
        },
        "config": {k: getattr(cfg, k) for k in _TOKENIZE_FIELDS},
    }
    return content_key(key)


def _cache_root(cfg: DataConfig) -> Path | None:
    if cfg.cache_dir.lower() == "none":
        return None
    if cfg.cache_dir:
        return Path(cfg.cache_dir).expanduser()
    return cache_root() / "data"


def tokenize_source(
    source: Source, fmt: str, tokenizer, settings: EncodeSettings, cfg: DataConfig, sft: bool
):
    """Tokenized rows of one source (a ``datasets.Dataset`` with where/prompt_ids/chosen_ids/
    rejected_ids/drop/error columns), from the cache when the key matches."""
    import datasets

    key = tokenization_cache_key(source, fmt, tokenizer, settings, cfg, sft)
    root = _cache_root(cfg)
    cached = root / f"tokenized-{key[:32]}" if root else None
    if cached is not None and (cached / "dataset_info.json").is_file():
        return datasets.load_from_disk(str(cached))
    features = datasets.Features(
        {
            "where": datasets.Value("string"),
            "prompt_ids": datasets.Sequence(datasets.Value("int32")),
            "chosen_ids": datasets.Sequence(datasets.Value("int32")),
            "rejected_ids": datasets.Sequence(datasets.Value("int32")),
            "drop": datasets.Value("string"),
            "error": datasets.Value("string"),
            "prompt_length_uncut": datasets.Value("int64"),
            "notes": datasets.Sequence(datasets.Value("string")),
            "group": datasets.Value("string"),
            "label": datasets.Value("int8"),
        }
    )
    quiet = not cfg.verbose and datasets.is_progress_bar_enabled()
    if quiet:
        datasets.disable_progress_bars()
    try:
        tokenized = source.dataset.map(
            _tokenize_batch,
            batched=True,
            batch_size=64,
            with_indices=True,
            num_proc=cfg.num_proc if cfg.num_proc > 1 and len(source.dataset) > 64 else None,
            remove_columns=source.dataset.column_names,
            features=features,
            fn_kwargs=dict(
                fmt=fmt,
                cfg_dict=asdict(cfg),
                tokenizer=tokenizer,
                settings=settings,
                label=source.label,
                sft=sft,
            ),
            new_fingerprint=key[:32],  # our key: spares datasets from hashing the tokenizer
            load_from_cache_file=False,
            desc=f"tokenizing {Path(source.label).name}",
        )
        if cached is not None:
            _save_atomically(tokenized, cached)
    finally:
        if quiet:
            datasets.enable_progress_bars()
    return tokenized


def _save_atomically(tokenized, cached: Path) -> None:
    """save_to_disk into a temporary folder renamed into place (readers never see half a cache)."""
    try:
        with atomic_dir(cached) as tmp:
            tokenized.save_to_disk(tmp)
    except OSError:  # an unwritable cache only costs speed
        logger.warning("could not write the tokenization cache %s", cached)


# ----------------------------------------------------------------------------------------------
# length limits, eval split, mixing


def _fit_source(
    index: int,
    source: Source,
    fmt: str,
    tokenized,
    cfg: DataConfig,
    sft: bool,
    settings: EncodeSettings,
) -> dict:
    errors = [e for e in tokenized["error"] if e]
    fitting = sum(1 for d in tokenized["drop"] if d != "malformed")
    _raise_row_errors(source, fmt, errors, fitting, cfg)
    dropped: Counter = Counter()
    if source.malformed:
        dropped["malformed"] += source.malformed
    kept: list[
        tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], int]
    ] = []  # (p, c, r, label)
    before = {"prompt": [], "chosen": [], "rejected": []}
    truncated: Counter = Counter()
    notes: Counter = Counter()
    first_seen: dict[tuple, str] = {}
    duplicates: list[tuple[str, str]] = []  # (where, where it repeats)
    rows = set()
    cap = cfg.shp_max_pairs_per_post if fmt == "shp" else 0
    per_group: Counter = Counter()  # kept pairs so far of each group (an SHP post)
    # A tokenizer that puts a BOS first keeps it through every cut (a template's first special
    # token, e.g. ChatML's <|im_start|> reported as "BOS" by SmolLM2, is cut like any token).
    bos = settings.bos_token_id if settings.add_bos else None
    for where, p, c, r, drop, uncut, row_notes, group, label in zip(
        tokenized["where"],
        tokenized["prompt_ids"],
        tokenized["chosen_ids"],
        tokenized["rejected_ids"],
        tokenized["drop"],
        tokenized["prompt_length_uncut"],
        tokenized["notes"],
        tokenized["group"],
        tokenized["label"],
    ):
        rows.add(where)
        if drop:
            dropped[drop] += 1
            continue
        if cap and group:
            per_group[group] += 1
            if per_group[group] > cap:
                dropped["shp_pairs_per_post"] += 1
                continue
        notes.update(row_notes)
        key = (tuple(p), tuple(c), () if sft else tuple(r), label)
        if key in first_seen:
            duplicates.append((where, first_seen[key]))
            if cfg.drop_duplicates:
                dropped["duplicate"] += 1
                continue
        else:
            first_seen[key] = where
        before["prompt"].append(uncut)
        before["chosen"].append(len(c))
        if not sft:
            before["rejected"].append(len(r))
        try:
            fp, fc, fr = fit_lengths(p, c, None if sft else r, cfg, bos)
        except Filtered as f:
            dropped[f.reason] += 1
            continue
        turns = "turns_dropped" in row_notes
        truncated["prompt"] += turns or len(fp) < len(p)
        truncated["prompt_turns_dropped"] += turns
        truncated["prompt_tokens_cut"] += len(fp) < len(p)
        truncated["chosen"] += len(fc) < len(c)
        truncated["rejected"] += (not sft) and len(fr) < len(r)
        kept.append((tuple(fp), tuple(fc), () if sft else tuple(fr), label))

    n_eval = int(round(cfg.eval_fraction * len(kept)))
    if cfg.eval_fraction > 0 and len(kept) >= 2:
        n_eval = min(max(n_eval, 1), len(kept) - 1)
    order = np.random.default_rng([cfg.seed, index]).permutation(len(kept))
    eval_idx = set(order[:n_eval].tolist())
    return {
        "label": source.label,
        "format": fmt,
        "rows_read": len(rows) + source.malformed,
        "dropped": dict(dropped),
        "truncated": truncated,
        "notes": notes,
        "duplicates": duplicates,
        "before": before,
        "kept": kept,
        "train": [x for i, x in enumerate(kept) if i not in eval_idx],
        "eval": [x for i, x in enumerate(kept) if i in eval_idx],
    }


def _mix(trains: list[list], cfg: DataConfig) -> list:
    """Concatenate the sources' training pairs, resized to ``cfg.weights`` proportions if given."""
    if not cfg.weights or len(trains) == 1:
        return [x for t in trains for x in t]
    total = sum(len(t) for t in trains)
    weight_sum = float(sum(cfg.weights))
    out = []
    for i, (pairs, weight) in enumerate(zip(trains, cfg.weights)):
        n = int(round(total * weight / weight_sum))
        if n and not pairs:
            raise DataError(f"data.datasets[{i}] kept no pairs but has weight {weight}")
        if n == 0:
            continue
        rng = np.random.default_rng([cfg.seed, 1_000_003, i])
        full, rest = divmod(n, len(pairs))
        idx = list(range(len(pairs))) * full + sorted(
            rng.choice(len(pairs), rest, replace=False).tolist()
        )
        out.extend(pairs[j] for j in idx)
    return out


def _summarize(
    per_source: list[dict], train: list, eval_: list, cfg: DataConfig, sft: bool
) -> dict:
    dropped: Counter = Counter()
    truncated: Counter = Counter()
    notes: Counter = Counter()
    before = {"prompt": [], "chosen": [], "rejected": []}
    for info in per_source:
        dropped.update(info["dropped"])
        truncated.update(info["truncated"])
        notes.update(info["notes"])
        for k in before:
            before[k].extend(info["before"][k])
    kept = [x for info in per_source for x in info["kept"]]
    after = {
        "prompt": [len(x[0]) for x in kept],
        "chosen": [len(x[1]) for x in kept],
        "rejected": [len(x[2]) for x in kept],
    }
    after["pair"] = [len(x[0]) + max(len(x[1]), len(x[2])) for x in kept]
    names = ("prompt", "chosen") if sft else ("prompt", "chosen", "rejected")
    return {
        "unit": "examples" if sft else "pairs",
        "rows_read": sum(info["rows_read"] for info in per_source),
        "pairs_kept": len(kept),
        "train": len(train),
        "eval": len(eval_),
        "max_length": cfg.max_length,
        "max_prompt_length": cfg.max_prompt_length,
        "dropped": dict(dropped),
        "truncated": {
            k: truncated[k]
            for k in ("prompt", "prompt_turns_dropped", "prompt_tokens_cut", "chosen", "rejected")
        },
        "notes": dict(notes),
        "duplicates": {
            "count": sum(len(info["duplicates"]) for info in per_source),
            "dropped": cfg.drop_duplicates,
            "examples": [
                f"{info['label']}: {where} repeats {first}"
                for info in per_source
                for where, first in info["duplicates"][:3]
            ],
        },
        "lengths_before_cut": {k: length_stats(before[k]) for k in names},
        "lengths": {k: length_stats(after[k]) for k in (*names, "pair")},
        "sources": [
            {k: info[k] for k in ("label", "format", "rows_read", "dropped")}
            | {"pairs_kept": len(info["kept"]), "role": info.get("role", "train")}
            for info in per_source
        ],
    }
