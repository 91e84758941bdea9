"""Raw rows from a file, folder or hub dataset, as a ``datasets.Dataset``.

JSON and JSON Lines files are parsed here, line by line, so that a malformed line is reported
with its file and line number (``datasets``' JSON loader reports a pyarrow parse error without
either) and so that rows whose fields change type from row to row (a string here, a message list
there) still load; each row is kept as its JSON text in a one-column ``Dataset`` (column
``_json``, with its location in ``_where``); so are the JSON files of a split of a folder (split
names inferred from file names as ``datasets.load_dataset`` does: ``train.jsonl``, ``test.jsonl``,
``data/validation-*.json`` ...). Parquet, Arrow and CSV files, saved datasets and hub names go
through ``datasets`` as they are.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

JSON_COLUMN = "_json"
WHERE_COLUMN = "_where"
_LOADERS = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}


class DataError(ValueError):
    """Bad input data; the message names the file (or dataset), the row or line, and the field."""


class MissingDataError(DataError, FileNotFoundError):
    """A data path that looks local (a file name or a path) but does not exist."""


class UnreadableDataError(DataError, OSError):
    """A dataset its reader cannot open: a file its loader rejects, a folder ``datasets`` cannot
    read, a hub dataset not found or not reachable (an OSError too, as the hub clients' own
    errors are, for callers that give offline advice)."""


@dataclass
class Source:
    """One dataset's raw rows. ``label`` names it in messages; ``malformed`` counts skipped
    lines; ``files`` are the local files read (their paths, sizes and times identify the data
    in the tokenization cache; empty: the dataset's own fingerprint does)."""

    label: str
    dataset: object  # datasets.Dataset
    malformed: int = 0
    files: tuple[str, ...] = ()
    rows: tuple[int, int] | None = None
    """The rows kept of what was read, [start, stop) (a sliced split, :func:`parse_split`); None:
    all. Part of the data's identity in the tokenization cache."""


_SLICED_SPLIT = re.compile(r"^(?P<name>[^\[\]]+)\[(?P<start>-?\d*):(?P<stop>-?\d*)\]$")


def parse_split(split: str) -> tuple[str, slice | None]:
    """A split name, optionally with a row range in ``datasets``' slicing notation:
    ``train[:200]`` -> ("train", slice(None, 200)), ``train[200:]``, ``test[10:20]``; a plain
    name -> (name, None). Rows are counted as read (a skipped malformed line is not a row).

    Raises:
        DataError: brackets that are not ``[start:stop]`` with integers (e.g. ``train[:10%]``).
    """
    if "[" not in split:
        return split, None
    match = _SLICED_SPLIT.match(split)
    if match is None:
        raise DataError(
            f"split {split!r}: expected a name or a row range such as 'train[:200]' or "
            "'train[200:300]' (integer rows)"
        )
    start, stop = (int(v) if v else None for v in match.group("start", "stop"))
    return match.group("name"), slice(start, stop)


def is_local_source(name: str) -> bool:
    """Whether a ``data.path`` / ``data.datasets`` entry names a local file or folder (an
    existing path, or one that looks like a path or a data file), not a hub dataset."""
    return (
        Path(name).expanduser().exists()
        or name.startswith((".", "/", "~"))
        or Path(name).suffix.lower() in (".json", ".jsonl", *_LOADERS)
    )


def read_source(name: str, split: str = "train", on_error: str = "raise") -> Source:
    """Read one dataset (file, folder or hub name) at ``split``, which may keep a row range
    (:func:`parse_split`: ``train[:200]``; a single file is its ``train`` split). Raises
    DataError for a malformed JSON line (unless ``on_error == "skip"``: then it is skipped and
    counted) or split, MissingDataError (a DataError and a FileNotFoundError) for a
    local-looking path that does not exist."""
    split, rows = parse_split(split)
    source = _read_whole(name, split, on_error)
    if rows is None:
        return source
    start, stop, _ = rows.indices(len(source.dataset))
    source.dataset = source.dataset.select(range(start, max(start, stop)))
    source.rows = (start, max(start, stop))
    source.label = f"{source.label}[{start}:{max(start, stop)}]"
    return source


def _read_whole(name: str, split: str, on_error: str) -> Source:
    """Every row of ``name`` at ``split`` (see :func:`read_source`)."""
    path = Path(name).expanduser()
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix in (".json", ".jsonl"):
            return _read_json(path, on_error)
        if suffix in _LOADERS:
            ds = _load_data_file(path, _LOADERS[suffix])
            return Source(str(path), ds, files=(str(path),))
        raise DataError(
            f"{path}: unknown data file type {suffix!r}; expected .json, .jsonl, .parquet, .arrow "
            "or .csv"
        )
    if path.is_dir():
        import datasets

        if (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file():
            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise DataError(
                        f"{path}: no split {split!r}; it has {sorted(ds)} (set data.split)"
                    )
                ds = ds[split]
            return Source(str(path), ds)
        splits = folder_splits(path)
        if split not in splits:
            raise DataError(
                f"{path}: no split {split!r}; its files make the split(s) "
                f"{sorted(splits)} (named as datasets.load_dataset names them)"
            )
        if all(Path(f).suffix.lower() in (".json", ".jsonl") for f in splits[split]):
            return _read_json_files(f"{path}[{split}]", [Path(f) for f in splits[split]], on_error)
        failure = f"{path}: not a readable data folder"
        return Source(f"{path}[{split}]", _load_dataset(failure, str(path), split=split))
    if is_local_source(name):
        raise MissingDataError(f"data file {name} does not exist")
    failure = f"{name}: no such local file or folder, and not loadable as a hub dataset (online)"
    return Source(f"{name}[{split}]", _load_dataset(failure, name, split=split))


def _load_data_file(path: Path, loader: str):
    """A Parquet, Arrow or CSV file read by ``datasets`` as one split.

    Raises:
        DataError: naming the file, for a file with no rows (``datasets`` fails on those with
            an error that names neither the file nor the cause) or one its loader cannot read
            (with the loader's own reason).
    """
    try:
        return _load_dataset(
            f"{path}: not a readable {loader} file", loader, data_files=str(path), split="train"
        )
    except DataError:
        if _file_rows(path, loader) == 0:
            raise DataError(f"{path}: no rows") from None
        raise


def _load_dataset(failure: str, *args, **kwargs):
    """``datasets.load_dataset(*args, **kwargs)``; its failure (a file its loader cannot read,
    a hub dataset not found or not reachable) as one :class:`UnreadableDataError` line:
    ``failure``, then the innermost reason."""
    import datasets

    level = datasets.logging.get_verbosity()
    # its loaders log their own account of a failure at error level: the DataError is the one line
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        return datasets.load_dataset(*args, **kwargs)
    except (datasets.exceptions.DatasetsError, ValueError, OSError) as e:
        cause = e
        while cause.__cause__ is not None:  # DatasetGenerationError wraps the loader's error
            cause = cause.__cause__
        raise UnreadableDataError(f"{failure}: {cause}") from None
    finally:
        datasets.logging.set_verbosity(level)


def _file_rows(path: Path, loader: str) -> int | None:
    """Rows of a data file, told without ``datasets`` (Parquet: its footer; Arrow: its record
    batches; CSV: its non-blank lines after the header); None when the file cannot tell."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if loader == "parquet":
            return pq.read_metadata(path).num_rows
        if loader == "arrow":
            with pa.memory_map(str(path)) as source:
                return pa.ipc.open_stream(source).read_all().num_rows
        with path.open(encoding="utf-8", errors="replace") as lines:
            return max(0, sum(1 for line in lines if line.strip()) - 1)
    except (OSError, ValueError):  # pyarrow's ArrowInvalid is a ValueError
        return None


def folder_splits(path: Path) -> dict[str, list[str]]:
    """Split name -> data files of a folder of data files, as ``datasets.load_dataset(folder)``
    infers them (``train.jsonl`` / ``test.jsonl``, ``data/train-*.parquet``, ...; a folder
    whose file names name no split is all ``train``); {} for a folder ``datasets`` cannot read.
    Reads no rows."""
    import datasets

    try:
        data_files = datasets.load_dataset_builder(str(path)).config.data_files or {}
    except (FileNotFoundError, ValueError):  # no data files, or files of mixed types
        return {}
    return {str(split): [str(f) for f in files] for split, files in data_files.items()}


def local_split_names(name: str) -> list[str]:
    """The splits a local ``data.datasets`` entry has: a folder's (saved ``DatasetDict`` or data
    files, :func:`folder_splits`), ``[]`` for a file or a saved single ``Dataset`` (read whole)."""
    path = Path(name).expanduser()
    if not path.is_dir() or (path / "dataset_info.json").is_file():
        return []
    if (path / "dataset_dict.json").is_file():
        return list(json.loads((path / "dataset_dict.json").read_text())["splits"])
    return sorted(folder_splits(path))


def _read_json(path: Path, on_error: str) -> Source:
    return _read_json_files(str(path), [path], on_error)


def _read_json_files(label: str, paths: list[Path], on_error: str) -> Source:
    """JSON / JSON Lines files as one source; a row's location names its file when there are
    several or the label is not the file (``test.jsonl line 3``)."""
    import datasets

    rows, where, malformed = [], [], 0
    for path in paths:
        file_rows, file_where, file_malformed = read_json_rows(path, on_error)
        prefix = "" if label == str(path) else f"{path.name} "
        rows += file_rows
        where += [prefix + w for w in file_where]
        malformed += file_malformed
    ds = datasets.Dataset.from_dict({WHERE_COLUMN: where, JSON_COLUMN: rows})
    return Source(label, ds, malformed, files=tuple(str(p) for p in paths))


def read_json_rows(path: Path, on_error: str = "raise") -> tuple[list[str], list[str], int]:
    """The rows of a JSON array file or a JSON Lines file, as (JSON texts, locations, skipped).

    A file that parses as one JSON array is read as that; any other (several values, one per
    line) as JSON Lines, whatever its suffix. Each row must be a JSON object in UTF-8. With
    ``on_error="skip"`` a line / row that is not (bad JSON, an array or a string, bytes that
    are not UTF-8) is dropped and counted; otherwise the first one raises.

    Raises:
        DataError: naming the file and the line (JSON Lines), the row (array) or the line and
            byte of a non-UTF-8 byte.
    """
    data = path.read_bytes()
    if data.lstrip()[:1] in (b"[", b"{"):
        parsed = _parse_whole(path, data, on_error)
        if parsed is not None:
            return parsed
    return _read_lines(path, data, on_error)


def _not_utf8(path: Path, data: bytes, error: UnicodeDecodeError) -> DataError:
    """A DataError locating the first non-UTF-8 byte of the file's ``data``: line, byte within
    the line (from 1) and offset in the file."""
    line = data.count(b"\n", 0, error.start) + 1
    column = error.start - (data.rfind(b"\n", 0, error.start) + 1) + 1
    return DataError(
        f"{path}: line {line}, byte {column} (file offset {error.start}): byte "
        f"0x{data[error.start]:02x} is "
        f"not UTF-8 ({error.reason}); re-save the file as UTF-8, or set "
        f"data.on_error=skip to drop the rows that hold such bytes"
    )


def _parse_whole(path: Path, data: bytes, on_error: str):
    """Rows of a file that is one JSON value (an array of objects), or None if it is not one
    value (then it is read as JSON Lines)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        if on_error != "skip":
            raise _not_utf8(path, data, e) from None
        text = data.decode("utf-8", errors="surrogateescape")  # bad bytes -> lone surrogates
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data" and "\n" in text[: e.pos]:
            return None  # several values, one per line: JSON Lines
        raise DataError(
            f"{path}: line {e.lineno} column {e.colno}: malformed JSON: {e.msg}"
        ) from None
    if isinstance(value, dict):
        if text.strip().count("\n") == 0:
            return None  # a JSON Lines file of one row
        raise DataError(
            f"{path}: one JSON object (keys {sorted(value)[:8]}), not a list of rows: "
            f"expected a JSON array of row objects, or JSON Lines (one object per line)"
        )
    if not isinstance(value, list):
        raise DataError(f"{path}: expected a JSON array of row objects, got {type(value).__name__}")
    rows, where, malformed = [], [], 0
    for i, item in enumerate(value):
        problem = None
        if not isinstance(item, dict):
            problem = f"expected a JSON object, got {type(item).__name__}"
        else:
            row = json.dumps(item, ensure_ascii=False)
            try:
                row.encode("utf-8")
            except UnicodeEncodeError:
                problem = "holds bytes that are not UTF-8"
        if problem is not None:
            if on_error == "skip":
                malformed += 1
                continue
            raise DataError(f"{path}: row {i}: {problem}")
        rows.append(row)
        where.append(f"row {i}")
    return rows, where, malformed


def _read_lines(path: Path, data: bytes, on_error: str) -> tuple[list[str], list[str], int]:
    rows, where, malformed = [], [], 0
    offset = 0
    for lineno, raw in enumerate(data.split(b"\n"), start=1):
        line_offset, offset = offset, offset + len(raw) + 1
        if not raw.strip():
            continue
        try:
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                column = e.start + 1
                raise ValueError(
                    f"byte {column} (file offset {line_offset + e.start}): byte "
                    f"0x{raw[e.start]:02x} is not UTF-8 ({e.reason}); re-save the "
                    f"file as UTF-8"
                ) from None
            try:
                value = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"column {e.colno}: malformed JSON: {e.msg}") from None
            if not isinstance(value, dict):
                raise ValueError(
                    f"expected a JSON object per line, got a JSON {type(value).__name__}"
                )
        except ValueError as e:
            if on_error == "skip":
                malformed += 1
                continue
            raise DataError(f"{path}: line {lineno}: {e}") from None
        rows.append(line)
        where.append(f"line {lineno}")
    return rows, where, malformed
