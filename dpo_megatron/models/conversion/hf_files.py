"""Reading and writing the tensor files of a Hugging Face model folder.

Reading is lazy: the folder's index (``model.safetensors.index.json`` or
``pytorch_model.bin.index.json``) or file headers give every tensor's name and shape without
reading data, and :meth:`HFCheckpointReader.read` returns only the requested slice of one tensor
(``safe_open(...).get_slice``; ``.bin`` files are memory-mapped with ``torch.load(mmap=True)``,
after :func:`dpo_megatron.utils.torch_pickle.load_tensor_file` has read their pickle's opcodes:
a ``.bin`` that pickles anything but tensors is refused unread). A damaged file is named in the
error (a safetensors file cut short: its size against its header's).

Writing produces sharded ``model-0000x-of-0000y.safetensors`` files and
``model.safetensors.index.json``, the layout ``save_pretrained`` writes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

import torch

from dpo_megatron.utils.torch_pickle import load_tensor_file

SAFE_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"


class HFCheckpointReader:
    """Lazy access to the tensors of one HF folder.

    Raises (at construction):
        FileNotFoundError: no weights in the folder, or a shard named by the index is missing
            (names the shard and the index file).
        ValueError: an index that is not JSON with a ``weight_map``, a safetensors file cut
            short or corrupt, a ``.bin`` that pickles more than tensors (refused unread:
            ``utils.torch_pickle``) or is not a readable ``torch.save`` file (each names the
            file).
    """

    def __init__(self, hf_path: str):
        self.hf_path = hf_path
        self._file_of: dict[str, str] = {}
        self._stored: dict[str, str] = {}  # presented name -> name in the file (add_prefix)
        self._open: dict[str, object] = {}
        files = self._weight_files()
        for name in files:
            path = os.path.join(hf_path, name)
            if not os.path.isfile(path):
                raise FileNotFoundError(
                    f"{hf_path}: weight shard {name} listed in the index is missing"
                )
        self._shapes: dict[str, tuple[int, ...]] = {}
        for name in sorted(set(files)):
            for tensor, shape in self._header(name).items():
                self._shapes[tensor] = shape
                self._file_of.setdefault(tensor, name)
        if self._index_map is not None:
            for tensor, name in self._index_map.items():
                if tensor not in self._shapes:
                    raise KeyError(
                        f"{os.path.join(hf_path, name)}: tensor {tensor!r} listed in "
                        "the index is not in the shard"
                    )
                self._file_of[tensor] = name

    def _weight_files(self) -> list[str]:
        self._index_map: dict[str, str] | None = None
        for index in (SAFE_INDEX, BIN_INDEX):
            path = os.path.join(self.hf_path, index)
            if os.path.isfile(path):
                self._index_map = _read_index(path)
                return sorted(set(self._index_map.values()))
        for single in ("model.safetensors", "pytorch_model.bin"):
            if os.path.isfile(os.path.join(self.hf_path, single)):
                return [single]
        from dpo_megatron.models.conversion.hf_config import hub_name_hint

        raise FileNotFoundError(
            f"{self.hf_path}: no model.safetensors, pytorch_model.bin or "
            f"sharded index in this folder{hub_name_hint(self.hf_path)}"
        )

    def _handle(self, name: str):
        if name not in self._open:
            path = os.path.join(self.hf_path, name)
            if name.endswith(".safetensors"):
                from safetensors import SafetensorError, safe_open

                try:  # safetensors checks that the header's offsets cover the file exactly
                    self._open[name] = safe_open(path, framework="pt", device="cpu")
                except SafetensorError as e:
                    raise ValueError(f"{path}: {_safetensors_problem(path, e)}") from None
            else:  # a pickle: read from its opcodes first, tensors only (utils.torch_pickle)
                state = load_tensor_file(path, mmap=True)
                if not isinstance(state, dict) or not all(
                    isinstance(v, torch.Tensor) for v in state.values()
                ):
                    raise ValueError(f"{path}: not a state_dict of tensors")
                self._open[name] = state
        return self._open[name]

    def _header(self, name: str) -> dict[str, tuple[int, ...]]:
        handle = self._handle(name)
        if name.endswith(".safetensors"):
            return {k: tuple(handle.get_slice(k).get_shape()) for k in handle.keys()}
        return {k: tuple(v.shape) for k, v in handle.items()}

    def names(self) -> list[str]:
        """Every tensor name in the folder (after :meth:`add_prefix`)."""
        return list(self._shapes)

    def add_prefix(self, prefix: str, keep: tuple[str, ...] = ("lm_head.",)) -> None:
        """Present every stored name not starting with ``prefix`` or one of ``keep`` as
        ``prefix + name`` (folders saved from HF's base model, e.g. the original GPT-2 files,
        lack the ``transformer.`` prefix that ``*ForCausalLM`` checkpoints have)."""
        renamed = {n: n if n.startswith((prefix,) + keep) else prefix + n for n in self._shapes}
        self._shapes = {renamed[n]: shape for n, shape in self._shapes.items()}
        self._file_of = {renamed[n]: f for n, f in self._file_of.items()}
        self._stored.update({new: self._stored.get(old, old) for old, new in renamed.items()})

    def shape(self, name: str) -> tuple[int, ...]:
        """Stored shape of one tensor (no data read)."""
        return self._shapes[name]

    def read(
        self, name: str, dim: int = 0, start: int = 0, stop: int | None = None
    ) -> torch.Tensor:
        """Rows ``[start, stop)`` of the stored tensor along ``dim`` (0 or 1); only those bytes
        are read (safetensors) or paged in (mmap'd .bin). Returns a contiguous CPU tensor."""
        file = self._file_of[name]
        handle = self._handle(file)
        shape = self._shapes[name]
        name = self._stored.get(name, name)
        stop = shape[dim] if stop is None else stop
        if file.endswith(".safetensors"):
            sl = handle.get_slice(name)
            if len(shape) == 0:
                return sl[()]
            index = (slice(start, stop),) if dim == 0 else (slice(None), slice(start, stop))
            return sl[index].contiguous()
        tensor = handle[name]
        return tensor.narrow(dim, start, stop - start).clone() if len(shape) else tensor.clone()

    def close(self) -> None:
        """Release open files."""
        self._open.clear()


def _read_index(path: str) -> dict[str, str]:
    """The ``weight_map`` (tensor name -> shard file) of a sharded folder's index file.

    Raises:
        ValueError: not JSON, or no ``weight_map`` of names to file names (names the file).
    """
    try:
        with open(path) as f:
            weight_map = json.load(f).get("weight_map")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
        raise ValueError(f"{path}: not a weights index (JSON with a weight_map): {e}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{path}: not a weights index: no weight_map of tensor names to files")
    return weight_map


def _safetensors_problem(path: str, error: Exception) -> str:
    """Why safetensors refused a file, in words: its size against what its header describes
    (8-byte header length, JSON header, then the data its offsets cover), else safetensors'
    own reason."""
    size = os.path.getsize(path)
    expected = None
    with open(path, "rb") as f:
        header_bytes = int.from_bytes(f.read(8), "little")
        if size >= 8 + header_bytes:
            try:
                header = json.loads(f.read(header_bytes))
                expected = (
                    8
                    + header_bytes
                    + max(
                        (v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"),
                        default=0,
                    )
                )
            except (ValueError, KeyError, TypeError, IndexError, AttributeError):
                pass
    if expected is not None and expected != size:
        how = "cut short" if size < expected else "longer than that"
        return (
            f"not a complete safetensors file: {size} bytes, its header describes {expected} "
            f"({how}: copy or download it again)"
        )
    return f"not a readable safetensors file (corrupt or another format): {error}"


def write_safetensors_shards(
    tensors: Iterable[tuple[str, torch.Tensor]], out_dir: str, max_shard_bytes: int = 5 * 1024**3
) -> list[str]:
    """Write (name, tensor) pairs, in order, to ``model-0000x-of-0000y.safetensors`` files of at
    most ``max_shard_bytes`` each (one tensor larger than that gets a shard of its own) plus
    ``model.safetensors.index.json``. Tensors are consumed one at a time; a shard is held in
    memory only until it is written.

    Returns the shard file names.
    """
    from safetensors.torch import save_file

    shards: list[list[str]] = []
    weight_map: dict[str, str] = {}
    total = 0
    current: dict[str, torch.Tensor] = {}
    current_bytes = 0
    tmp_names: list[str] = []

    def flush():
        nonlocal current, current_bytes
        if not current:
            return
        tmp = f"shard-{len(tmp_names):05d}.tmp.safetensors"
        save_file(current, os.path.join(out_dir, tmp), metadata={"format": "pt"})
        # safetensors creates the file owner-only (0600); weights are shared like config.json.
        os.chmod(os.path.join(out_dir, tmp), 0o644)
        tmp_names.append(tmp)
        shards.append(list(current))
        current, current_bytes = {}, 0

    for name, tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        if current and current_bytes + size > max_shard_bytes:
            flush()
        current[name] = tensor.contiguous()
        current_bytes += size
        total += size
    flush()
    n = len(tmp_names)
    final = []
    for k, (tmp, names) in enumerate(zip(tmp_names, shards)):
        shard = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        os.rename(os.path.join(out_dir, tmp), os.path.join(out_dir, shard))
        final.append(shard)
        weight_map.update({name: shard for name in names})
    with open(os.path.join(out_dir, SAFE_INDEX), "w") as f:
        json.dump(
            {"metadata": {"total_size": total}, "weight_map": weight_map},
            f,
            indent=2,
            sort_keys=True,
        )
    return final
