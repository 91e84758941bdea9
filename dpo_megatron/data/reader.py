"""Raw rows from a file, folder or hub dataset, as a ``datasets.Dataset``.

JSON and JSON Lines files are parsed here, line by line, so that a malformed line is reported
with its file and line number (``datasets``' JSON loader reports a pyarrow parse error without
either) and so that rows whose fields change type from row to row (a string here, a message list
there) still load; each row is kept as its JSON text in a one-column ``Dataset`` (column
``_json``, with its location in ``_where``). Parquet, Arrow and CSV files, saved datasets and hub
names go through ``datasets`` as they are.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

JSON_COLUMN = "_json"
WHERE_COLUMN = "_where"
_LOADERS = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}


class DataError(ValueError):
    """Bad input data; the message names the file (or dataset), the row or line, and the field."""


@dataclass
class Source:
    """One dataset's raw rows. ``label`` names it in messages; ``malformed`` counts skipped lines."""

    label: str
    dataset: object  # datasets.Dataset
    malformed: int = 0


def read_source(name: str, split: str = "train", on_error: str = "raise") -> Source:
    """Read one dataset (file, folder or hub name). Raises DataError for a malformed JSON line
    (unless ``on_error == "skip"``: then it is skipped and counted), FileNotFoundError for a
    local-looking path that does not exist."""
    path = Path(name).expanduser()
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix in (".json", ".jsonl"):
            return _read_json(path, on_error)
        if suffix in _LOADERS:
            import datasets

            ds = datasets.load_dataset(_LOADERS[suffix], data_files=str(path), split="train")
            return Source(str(path), ds)
        raise DataError(f"{path}: unknown data file type {suffix!r}; expected .json, .jsonl, .parquet, .arrow or .csv")
    if path.is_dir():
        import datasets

        if (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file():
            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise DataError(f"{path}: no split {split!r}; it has {sorted(ds)} (set data.split)")
                ds = ds[split]
            return Source(str(path), ds)
        return Source(f"{path}[{split}]", datasets.load_dataset(str(path), split=split))
    if name.startswith((".", "/", "~")) or Path(name).suffix.lower() in (".json", ".jsonl", *_LOADERS):
        raise FileNotFoundError(f"data file {name} does not exist")
    import datasets  # a hub name: works for users who are online

    return Source(f"{name}[{split}]", datasets.load_dataset(name, split=split))


def _read_json(path: Path, on_error: str) -> Source:
    import datasets

    text = path.read_text(encoding="utf-8")
    rows: list[str] = []
    where: list[str] = []
    malformed = 0
    if text.lstrip().startswith("["):  # one JSON array
        try:
            values = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: line {e.lineno} column {e.colno}: malformed JSON: {e.msg}") from None
        for i, value in enumerate(values):
            if not isinstance(value, dict):
                if on_error == "skip":
                    malformed += 1
                    continue
                raise DataError(f"{path}: row {i}: expected a JSON object, got {type(value).__name__}")
            rows.append(json.dumps(value, ensure_ascii=False))
            where.append(f"row {i}")
    else:  # JSON Lines
        for lineno, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
                if not isinstance(value, dict):
                    raise ValueError(f"expected a JSON object, got {type(value).__name__}")
            except ValueError as e:  # JSONDecodeError is a ValueError
                if on_error == "skip":
                    malformed += 1
                    continue
                raise DataError(f"{path}: line {lineno}: malformed JSON: {e}") from None
            rows.append(line)
            where.append(f"line {lineno}")
    ds = datasets.Dataset.from_dict({WHERE_COLUMN: where, JSON_COLUMN: rows})
    return Source(str(path), ds, malformed)
