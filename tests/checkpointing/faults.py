"""Fault injection on checkpoint folders: flipped bytes, planted pickle payloads, and a manifest
rewritten to match (the attacker who can write files can write the manifest too)."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle

import torch


class Payload:
    """Pickles as a call of ``os.mkdir(marker)``: unpickling it runs code (visible as a new
    folder). Harmless, and the tests assert the folder is never created."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def payload_bytes(marker: str) -> bytes:
    """The payload as torch.save writes it (what a ``.pt`` file or a DCP item holds)."""
    buf = io.BytesIO()
    torch.save(Payload(marker), buf)
    return buf.getvalue()


def flip_bytes(path: str, offset: int = 4096, length: int = 4096) -> None:
    """Invert ``length`` bytes of a file from ``offset`` (or from its middle if it is shorter)."""
    size = os.path.getsize(path)
    offset = min(offset, max(size - length, 0) // 2)
    with open(path, "r+b") as f:
        f.seek(offset)
        data = f.read(length)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in data))


def rehash(folder: str, *names: str) -> None:
    """Rewrite the manifest entries of ``names`` to the files' current size and digest."""
    from dpo_megatron.checkpointing.integrity import HASH_NAME, MANIFEST_FILE, file_digest

    path = os.path.join(folder, MANIFEST_FILE)
    with open(path) as f:
        manifest = json.load(f)
    for name in names:
        size, digest = file_digest(os.path.join(folder, name))
        manifest["files"][name] = {"size": size, HASH_NAME: digest}
    with open(path, "w") as f:
        json.dump(manifest, f)


def plant_in_pt_file(folder: str, name: str, marker: str) -> None:
    """Replace a ``.pt`` file of the checkpoint by the payload; manifest updated."""
    with open(os.path.join(folder, name), "wb") as f:
        f.write(payload_bytes(marker))
    rehash(folder, name)


def plant_in_dcp_metadata(folder: str, marker: str) -> None:
    """Replace torch DCP's ``.metadata`` by a pickled payload; manifest updated."""
    with open(os.path.join(folder, ".metadata"), "wb") as f:
        pickle.dump(Payload(marker), f)
    rehash(folder, ".metadata")


def plant_in_dcp_item(folder: str, marker: str, byte_item: bool) -> str:
    """Point one item of the checkpoint (a byte item, or a tensor item) at the payload appended
    to its ``.distcp`` file, rewriting ``.metadata`` to match (manifest updated). Returns the
    ``.distcp`` file's name."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    meta_path = os.path.join(folder, ".metadata")
    with open(meta_path, "rb") as f:
        metadata = pickle.load(f)  # our own, unmodified file
    index, info = next(
        (i, s)
        for i, s in metadata.storage_data.items()
        if isinstance(metadata.state_dict_metadata[i.fqn], BytesStorageMetadata) == byte_item
    )
    data = payload_bytes(marker)
    distcp = os.path.join(folder, info.relative_path)
    offset = os.path.getsize(distcp)
    with open(distcp, "ab") as f:
        f.write(data)
    metadata.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(data))
    with open(meta_path, "wb") as f:
        pickle.dump(metadata, f)
    rehash(folder, ".metadata", info.relative_path)
    return info.relative_path


def tree_digest(folder: str) -> dict[str, tuple[int, str]]:
    """Every file under ``folder`` (relative path -> size, digest): 'nothing changed' checks."""
    from dpo_megatron.checkpointing.integrity import file_digest

    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            out[os.path.relpath(path, folder)] = file_digest(path)
    return out
