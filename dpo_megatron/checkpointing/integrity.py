"""Can this checkpoint be trusted: checksums of every file, and no code run from any file.

**Manifest.** The last file written into a checkpoint's ``.tmp`` folder (before the rename that
publishes it) is ``manifest.json``: every other file of the checkpoint with its size in bytes
and its xxHash XXH3-128 digest. Loading checks every file against it, and a file that is missing,
unlisted, of another size or another digest is named in the error. XXH3-128 is a
non-cryptographic 128-bit hash made for checksums (the ``xxhash`` PyPI package, bindings of the
reference C library), several times faster than hashlib's SHA-256 (``docs/BENCHMARKS.md``), so
hashing stays well below the cost of reading the files. It detects corruption (bit
rot, torn or truncated writes, a stray copy), not tampering: an attacker who can rewrite the
files can rewrite the manifest too, which is why the second half of this module exists. Ranks
hash disjoint shares of the files, so the cost is divided by the world size.

**No code from files.** Pickle runs code on load. A checkpoint's files are read as follows:

* ``.metadata`` (torch DCP's index, a pickle that torch reads with plain ``pickle.load``):
  scanned first with an unpickler that accepts only torch DCP's metadata dataclasses and enums,
  ``torch.Size``, dtypes, layouts and memory formats;
* byte items inside ``*.distcp`` (torch DCP reads them with ``torch.load(weights_only=False)``):
  each one is loaded first with ``torch.load(weights_only=True)`` (tensors and plain containers
  only); tensor items are read by torch DCP with ``weights_only=True`` already (a refusal there is
  traced back to its file by :func:`unsafe_tensor_items`);
* ``common.pt`` (megatron-core, ``torch.load`` with the caller's default) and ``rng/*.pt``
  (ours): ``torch.load(weights_only=True)``;
* ``*.json``: JSON.

A file that would need more is refused with :class:`UnsafeCheckpointError` naming it. Every
rank reaches the same verdict (rank 0 scans, the findings are broadcast), so no rank is left
waiting in a collective for one that refused.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import json
import os
import pickle
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from dpo_megatron.utils import ranks
from dpo_megatron.utils.exceptions import exceptions_in
from dpo_megatron.utils.files import write_json_atomic

MANIFEST_FILE = "manifest.json"
"""Sizes and digests of every other file of a checkpoint (written last)."""
HASH_NAME = "xxh3_128"
"""The digest stored in manifests (xxHash XXH3, 128 bits, hex)."""
MANIFEST_FORMAT = 1
_CHUNK = 8 << 20  # bytes per read: large enough that the hash, not the syscalls, sets the pace
_DCP_METADATA = ".metadata"


class CheckpointIntegrityError(RuntimeError):
    """A checkpoint failed verification; ``problems`` names each file and what is wrong."""

    def __init__(self, ckpt_dir: str, problems: list[str]):
        self.ckpt_dir = ckpt_dir
        self.problems = list(problems)
        super().__init__(f"checkpoint {ckpt_dir} failed verification: " + "; ".join(problems))


class UnsafeCheckpointError(CheckpointIntegrityError):
    """A checkpoint file holds Python objects that loading it would construct or call (code),
    beyond tensors and plain containers: refused, nothing of it was executed."""


# ----------------------------------------------------------------------------------------------
# checksums


def file_digest(path: str) -> tuple[int, str]:
    """(size in bytes, XXH3-128 hex digest) of a file, read in 8 MiB chunks."""
    import xxhash

    h = xxhash.xxh3_128()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    size = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
            size += n
    return size, h.hexdigest()


def checkpoint_files(folder: str) -> list[str]:
    """Relative paths (``/``-separated) of every file under ``folder`` except the manifest."""
    out = []
    for root, _, files in os.walk(folder):
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), folder).replace(os.sep, "/")
            if rel != MANIFEST_FILE:
                out.append(rel)
    return sorted(out)


def _share(names: list[str]) -> list[str]:
    """This rank's share of ``names`` (round robin)."""
    return names[ranks.rank() :: ranks.world_size()]


def write_manifest(folder: str) -> dict:
    """Hash every file of ``folder`` (ranks split the files) and write ``manifest.json`` there,
    atomically, on rank 0 (collective). Returns the manifest."""
    names = ranks.broadcast_from_rank0(checkpoint_files(folder) if ranks.is_rank0() else None)
    local = {}
    for name in _share(names):
        size, digest = file_digest(os.path.join(folder, name))
        local[name] = {"size": size, HASH_NAME: digest}
    files: dict[str, Any] = {}
    for part in ranks.gather_to_all(local):
        files.update(part)
    manifest = {
        "format": MANIFEST_FORMAT,
        "hash": HASH_NAME,
        "total_bytes": sum(e["size"] for e in files.values()),
        "files": dict(sorted(files.items())),
    }
    if ranks.is_rank0():
        write_json_atomic(os.path.join(folder, MANIFEST_FILE), manifest)
    return manifest


def read_manifest(folder: str) -> dict | None:
    """The manifest of a checkpoint, or None when it has none (saved before checksums existed).

    Raises:
        CheckpointIntegrityError: the manifest exists but is not a readable manifest.
    """
    path = os.path.join(folder, MANIFEST_FILE)
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
        if manifest.get("hash") != HASH_NAME or not isinstance(manifest.get("files"), dict):
            raise ValueError(f"not a format-{MANIFEST_FORMAT} {HASH_NAME} manifest")
    except (OSError, ValueError) as e:
        raise CheckpointIntegrityError(folder, [f"{MANIFEST_FILE}: unreadable ({e})"]) from None
    return manifest


@dataclass
class Verification:
    """What :func:`verify_checkpoint` found."""

    problems: list[str] = field(default_factory=list)
    """One line per file that is missing, unlisted, of the wrong size or digest, or unsafe."""
    unsafe: bool = False
    """Some problem is a refused pickle (:class:`UnsafeCheckpointError`)."""
    has_manifest: bool = True
    """False for a checkpoint saved before manifests existed (sizes and digests unchecked)."""
    files: int = 0
    bytes: int = 0
    seconds: float = 0.0
    """Wall time of the whole verification on this rank."""

    def raise_if_failed(self, ckpt_dir: str) -> None:
        """Raise :class:`UnsafeCheckpointError` / :class:`CheckpointIntegrityError` on problems."""
        if self.problems:
            cls = UnsafeCheckpointError if self.unsafe else CheckpointIntegrityError
            raise cls(ckpt_dir, self.problems)

    def report(self, ckpt_dir: str) -> str:
        """The line rank 0 prints about a checkpoint that passed."""
        if not self.has_manifest:
            return (
                f"WARNING: {ckpt_dir} has no {MANIFEST_FILE} (saved before checksums): its "
                f"files' sizes and digests cannot be checked (its pickles were scanned)"
            )
        return (
            f"verified {ckpt_dir}: {self.files} files, {describe_size(self.bytes)} checked "
            f"({HASH_NAME}) in {self.seconds:.2f} s"
        )


def describe_size(n_bytes: int) -> str:
    """``2.15 GB`` / ``12.3 MB`` (decimal units, as ``du --si``)."""
    return f"{n_bytes / 1e9:.2f} GB" if n_bytes >= 1e9 else f"{n_bytes / 1e6:.1f} MB"


def verify_checkpoint(folder: str) -> Verification:
    """Check every file of a checkpoint against its manifest, then scan its pickles (collective:
    every rank gets the same result).

    Rank 0 reads the manifest and compares it with the folder's listing; every rank hashes its
    share of the files; rank 0 then scans the pickled files that passed (:func:`unsafe_pickles`:
    a file that failed its checksum is corrupt, and reported as such only).
    """
    start = time.perf_counter()
    head = _manifest_and_listing(folder) if ranks.is_rank0() else None
    entries, problems = ranks.broadcast_from_rank0(head)
    local = []
    for name in _share(sorted(entries or {})):
        local.extend(_check_file(folder, name, entries[name]))
    for part in ranks.gather_to_all(local):
        problems.extend(part)
    scan = None
    if ranks.is_rank0():
        failed = {p.split(": ", 1)[0] for p in problems}
        scan = unsafe_pickles(folder, skip=failed)
    unsafe = ranks.broadcast_from_rank0(scan)
    return Verification(
        problems=problems + unsafe,
        unsafe=any("unreadable" not in p for p in unsafe),
        has_manifest=entries is not None,
        files=len(entries or {}),
        bytes=sum(e["size"] for e in (entries or {}).values()),
        seconds=time.perf_counter() - start,
    )


def _manifest_and_listing(folder: str) -> tuple[dict | None, list[str]]:
    try:
        manifest = read_manifest(folder)
    except CheckpointIntegrityError as e:
        return {}, e.problems
    if manifest is None:
        return None, []
    entries = manifest["files"]
    present = set(checkpoint_files(folder))
    problems = [f"{name}: missing" for name in sorted(set(entries) - present)]
    problems += [
        f"{name}: not in the manifest (added after the save)"
        for name in sorted(present - set(entries))
    ]
    return entries, problems


def _check_file(folder: str, name: str, entry: dict) -> list[str]:
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        return []  # reported by rank 0 as missing
    size = os.path.getsize(path)
    if size != entry["size"]:
        return [
            f"{name}: {size} bytes, the manifest says {entry['size']} (truncated or overwritten)"
        ]
    _, digest = file_digest(path)
    if digest != entry[HASH_NAME]:
        return [
            f"{name}: {HASH_NAME} digest {digest} does not match the manifest's "
            f"{entry[HASH_NAME]} (the file's content changed after the save)"
        ]
    return []


# ----------------------------------------------------------------------------------------------
# no code from files


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles torch DCP's ``.metadata`` and refuses any other global (the stdlib's
    "restricting globals" pattern): DCP's metadata dataclasses and enums, ``torch.Size``,
    dtypes, layouts, memory formats."""

    def find_class(self, module: str, name: str):
        if module.startswith("torch.distributed.checkpoint"):
            obj = super().find_class(module, name)
            if isinstance(obj, type) and (
                dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)
            ):
                return obj
        elif module == "torch":
            obj = getattr(torch, name, None)
            if obj is torch.Size or isinstance(
                obj, (torch.dtype, torch.layout, torch.memory_format)
            ):
                return obj
        elif (module, name) == ("torch.serialization", "_get_layout"):
            # How torch pickles a layout (``torch.strided``): a name lookup, part of the format.
            return super().find_class(module, name)
        elif (module, name) == ("collections", "OrderedDict"):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refused global {module}.{name}")


def read_dcp_metadata(folder: str):
    """torch DCP's ``.metadata`` of a checkpoint, read with the restricted unpickler.

    Raises:
        UnsafeCheckpointError: it references anything but DCP's metadata types.
    """
    path = os.path.join(folder, _DCP_METADATA)
    try:
        with open(path, "rb") as f:
            return _MetadataUnpickler(f).load()
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointError(
            folder, [f"{_DCP_METADATA}: {e}: refused (it may only hold torch DCP metadata)"]
        ) from None


def load_weights_only(path: str, what: str | None = None):
    """``torch.load(path, weights_only=True)`` on the CPU, with an error naming the file.

    Raises:
        UnsafeCheckpointError: the file holds objects beyond tensors and plain containers.
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        folder = os.path.dirname(path)
        reason = _refusal_reason(e)
        raise UnsafeCheckpointError(
            folder,
            [
                f"{what or os.path.basename(path)}: holds objects other than tensors and plain "
                f"containers, refused ({reason})"
            ],
        ) from None


def _refusal_reason(e: BaseException) -> str:
    """The line of torch's weights-only refusal that names what was refused."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    named = [line for line in lines if "GLOBAL" in line or "Unsupported" in line]
    return (named or lines or [type(e).__name__])[0][:200]


def _weights_only_problem(data: bytes) -> str | None:
    try:
        torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        return _refusal_reason(e)
    except Exception as e:  # not even a torch file: corrupt rather than unsafe
        return f"unreadable ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
    return None


def _dcp_items(folder: str, byte_items: bool):
    """(file, key, bytes) of each byte item (or tensor item) of a DCP checkpoint."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    metadata = read_dcp_metadata(folder)
    for index, info in metadata.storage_data.items():
        item_md = metadata.state_dict_metadata.get(index.fqn)
        if isinstance(item_md, BytesStorageMetadata) != byte_items:
            continue
        if info.transform_descriptors:
            yield info.relative_path, index.fqn, None  # transformed: cannot be checked raw
            continue
        with open(os.path.join(folder, info.relative_path), "rb") as f:
            f.seek(info.offset)
            yield info.relative_path, index.fqn, f.read(info.length)


def unsafe_pickles(folder: str, skip: frozenset = frozenset()) -> list[str]:
    """Problems of the pickled files of a checkpoint, each naming the file (one process, no
    collective): ``.metadata``, the byte items of ``*.distcp``, ``common.pt``, ``rng/*.pt``
    (files named in ``skip``, already known to be corrupt, are not read). An empty list:
    loading them runs no code."""
    problems = []
    if os.path.isfile(os.path.join(folder, _DCP_METADATA)) and _DCP_METADATA not in skip:
        try:
            for path, key, data in _dcp_items(folder, byte_items=True):
                if path in skip:
                    continue
                reason = (
                    "stored with a transform, cannot be checked"
                    if data is None
                    else _weights_only_problem(data)
                )
                if reason:
                    problems.append(f"{path}: item {key}: {reason}: refused")
        except UnsafeCheckpointError as e:
            problems += e.problems
        except Exception as e:
            problems.append(f"{_DCP_METADATA}: unreadable ({type(e).__name__}: {e})")
    names = ["common.pt"]
    rng_dir = os.path.join(folder, "rng")
    if os.path.isdir(rng_dir):
        names += [f"rng/{n}" for n in sorted(os.listdir(rng_dir))]
    for name in names:
        path = os.path.join(folder, name)
        if os.path.isfile(path) and name not in skip:
            with open(path, "rb") as f:
                reason = _weights_only_problem(f.read())
            if reason:
                problems.append(
                    f"{name}: holds objects other than tensors and plain containers "
                    f"({reason}): refused"
                )
    return problems


def unsafe_tensor_items(folder: str) -> list[str]:
    """The tensor items of ``*.distcp`` that ``torch.load(weights_only=True)`` refuses, each
    naming its file and key (reads every tensor: only after torch DCP's load failed)."""
    problems = []
    for path, key, data in _dcp_items(folder, byte_items=False):
        reason = None if data is None else _weights_only_problem(data)
        if reason:
            problems.append(f"{path}: item {key}: {reason}: refused")
    return problems


def is_weights_only_refusal(exc: BaseException) -> bool:
    """True when ``exc`` (or what it wraps: its cause / context chain, torch DCP's per-rank
    failures) is torch's weights-only unpickling refusal."""
    return any(
        isinstance(e, pickle.UnpicklingError) or "Weights only load failed" in str(e)
        for e in exceptions_in(exc)
    )


def verify_or_raise(folder: str) -> Verification:
    """:func:`verify_checkpoint`, raising on any problem; rank 0 prints what was checked
    (collective).

    Raises:
        UnsafeCheckpointError, CheckpointIntegrityError: naming each bad file.
    """
    verification = verify_checkpoint(folder)
    verification.raise_if_failed(folder)
    if ranks.is_rank0():
        print(verification.report(folder), flush=True)
    return verification


def load_sharded(sharded_state_dict: dict, folder: str) -> dict:
    """megatron-core ``dist_checkpointing.load`` of a verified checkpoint (collective); a
    tensor item that torch's weights-only unpickler refuses is traced to its file.

    Raises:
        UnsafeCheckpointError: naming the file and key of each refused item.
    """
    from megatron.core import dist_checkpointing

    try:
        return dist_checkpointing.load(sharded_state_dict, folder)
    except BaseException as e:  # torch DCP's CheckpointException is a BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)) or not is_weights_only_refusal(e):
            raise
        problems = unsafe_tensor_items(folder) or [f"a tensor item was refused: {e}"]
        raise UnsafeCheckpointError(folder, problems) from None
