"""Reading ``torch.save`` files (a Hugging Face ``pytorch_model.bin``, the reference DPO repo's
``policy.pt``) without running code from them.

Unpickling runs code: a pickle may name any importable function (opcode ``GLOBAL posix
system``) and call it (``REDUCE``). A file of tensors needs only torch's tensor machinery
(:func:`is_tensor_global`: its rebuild functions, storages, dtypes, ``torch.Size``, ``Parameter``)
and ``collections.OrderedDict``. :func:`load_tensor_file` first disassembles the file's pickle
with the standard library's :mod:`pickletools`, which executes nothing, and refuses a file that
names any other global (:class:`UnsafePickleError`, naming the file and the globals); only then
is the file loaded, and with ``torch.load(weights_only=True)``, torch's restricted unpickler, as
a second guard. The verdict is read from the file's opcodes, never from the wording of torch's
errors (which changes between torch versions), and nothing the file holds is unpickled before
it.
"""

from __future__ import annotations

import io
import os
import pickle
import pickletools
import zipfile
from typing import IO, Any

import torch

_STRING_OPS = frozenset(
    {"STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE", "SHORT_BINUNICODE"}
    | {"BINUNICODE8"}
)
_PUT_OPS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})
_GET_OPS = frozenset({"GET", "BINGET", "LONG_BINGET"})
_ZIP_MAGIC = b"PK\x03\x04"
_LEGACY_PICKLES = 5
"""Pickles at the start of a legacy (pre-zip) ``torch.save`` file: magic number, protocol, system
info, the object, its storage keys; its raw tensor data follows, which is not disassembled."""
_TENSOR_GLOBALS = frozenset(
    {
        "collections.OrderedDict",  # what state_dict() returns
        "_codecs.encode",  # how protocol 2 stores bytes
        "torch._tensor._rebuild_from_type_v2",
        "torch.nn.parameter.Parameter",
        "torch.serialization._get_layout",
        "torch.storage.TypedStorage",
        "torch.storage.UntypedStorage",
        "torch.Size",
        "torch.Tensor",
        "torch.device",
    }
)


class TorchFileError(ValueError):
    """A ``torch.save`` file that cannot be used; ``str()`` names the file and the reason."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason


class UnsafePickleError(TorchFileError):
    """The file's pickle names ``globals`` beyond tensors and plain containers: loading it would
    call them. Nothing of the file was unpickled."""

    def __init__(self, path: str, globals_: list[str]):
        self.globals = globals_
        shown = ", ".join(globals_[:5]) + (" ..." if len(globals_) > 5 else "")
        super().__init__(
            path,
            f"refused: its pickle calls {shown}, not only tensors and plain containers (dict, "
            f"list, tuple, str, numbers); loading it would run that code",
        )


class UnreadableTorchFileError(TorchFileError):
    """Damage rather than danger: a truncated or corrupt file, or not a ``torch.save`` file."""


def is_tensor_global(name: str) -> bool:
    """Whether a pickle global (``module.name``) belongs to torch's tensor serialization: the
    tensor rebuild functions (``torch._utils._rebuild_*``), storage and tensor types, dtypes,
    quantization schemes, ``torch.Size`` / ``device`` / ``Parameter``, ``OrderedDict``."""
    if name in _TENSOR_GLOBALS:
        return True
    module, _, attr = name.rpartition(".")
    if module == "torch._utils":
        return attr.startswith("_rebuild_")
    if module in ("torch", "torch.cuda", "torch.sparse", "torch.cuda.sparse"):
        if attr.endswith(("Storage", "Tensor")):
            return True
        # the module's own attributes only: no lazy import of a name the file chose
        return module == "torch" and isinstance(vars(torch).get(attr), (torch.dtype, torch.qscheme))
    return False


def pickle_globals(stream: IO[bytes]) -> list[str]:
    """The globals (``module.name``) one pickle names, in order, read from its opcodes with
    :func:`pickletools.genops` (nothing is executed); the stream is left after its ``STOP``.
    ``STACK_GLOBAL`` (protocol 4+) takes the last two strings pushed, directly or from the memo;
    operands built any other way are reported as ``<computed global>``.

    Raises:
        ValueError: the stream is not a complete pickle (pickletools' error).
    """
    found: list[str] = []
    strings: list[str] = []  # string operands, in push order
    memo: dict[int, Any] = {}
    top: Any = None  # the value the last op pushed, when it was a string
    for op, arg, _ in pickletools.genops(stream):
        if op.name in ("GLOBAL", "INST"):
            found.append(str(arg).replace(" ", "."))
        elif op.name == "STACK_GLOBAL":
            found.append(".".join(strings[-2:]) if len(strings) >= 2 else "<computed global>")
            strings = strings[:-2]
        if op.name in _STRING_OPS:
            top = arg if isinstance(arg, str) else arg.decode("latin-1")
            strings.append(top)
        elif op.name in _PUT_OPS:
            memo[arg] = top
        elif op.name == "MEMOIZE":
            memo[len(memo)] = top
        elif op.name in _GET_OPS:
            top = memo.get(arg)
            if isinstance(top, str):
                strings.append(top)
        else:
            top = None
    return found


def file_globals(path: str) -> list[str]:
    """Every global the pickles of a ``torch.save`` file name (see :func:`pickle_globals`): the
    ``data.pkl`` record of the zip format (torch >= 1.6), or the consecutive pickles at the
    start of a legacy file or a plain ``pickle.dump``.

    Raises:
        UnreadableTorchFileError: the zip is damaged or has no ``data.pkl``, or the file does
            not start with a complete pickle.
    """
    if zipfile.is_zipfile(path):
        try:
            with zipfile.ZipFile(path) as archive:
                record = next(
                    (n for n in archive.namelist() if n.rsplit("/", 1)[-1] == "data.pkl"), None
                )
                if record is None:
                    raise UnreadableTorchFileError(path, "a zip file without torch's data.pkl")
                return pickle_globals(io.BytesIO(archive.read(record)))
        except (zipfile.BadZipFile, ValueError, EOFError, OSError) as e:
            if isinstance(e, TorchFileError):
                raise
            raise _unreadable(path, e) from None
    found: list[str] = []
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        if f.read(4) == _ZIP_MAGIC:
            raise _unreadable(path, "a zip archive cut short or damaged (no end-of-archive record)")
        f.seek(0)
        complete = 0
        while f.tell() < size and complete < _LEGACY_PICKLES:
            try:
                found += pickle_globals(f)
            except (ValueError, EOFError) as e:
                if complete == 0:
                    raise _unreadable(path, e) from None
                break  # a legacy file's raw tensor data follows its pickles
            complete += 1
    return found


def foreign_globals(path: str) -> list[str]:
    """The globals a ``torch.save`` file names beyond tensors (:func:`is_tensor_global`),
    each once, in order.

    Raises:
        UnreadableTorchFileError: as :func:`file_globals`.
    """
    return list(dict.fromkeys(g for g in file_globals(path) if not is_tensor_global(g)))


def load_tensor_file(path: str, mmap: bool = False) -> Any:
    """``torch.load`` of a file of tensors and plain containers, on the CPU, refusing any other
    pickled object before anything is unpickled (module docstring). ``mmap``: map the tensors'
    storage instead of reading it (zip-format files).

    Raises:
        UnsafePickleError: the pickle names globals beyond tensors (named in the message).
        UnreadableTorchFileError: a missing, truncated or corrupt file, or not a ``torch.save``
            file (the cause in the message).
    """
    if not os.path.isfile(path):
        raise UnreadableTorchFileError(path, "no such file")
    foreign = foreign_globals(path)
    if foreign:
        raise UnsafePickleError(path, foreign)
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError:
        # Its message advises weights_only=False, i.e. running the file: not repeated here.
        raise UnreadableTorchFileError(
            path,
            "not a readable torch.save file (corrupt, truncated or another format): torch's "
            "weights-only unpickler refused it",
        ) from None
    except Exception as e:  # a cut zip, a legacy file asked for mmap, a storage read past EOF
        raise _unreadable(path, e) from None


def _unreadable(path: str, cause: BaseException | str) -> UnreadableTorchFileError:
    if isinstance(cause, BaseException):
        cause = f"{type(cause).__name__}: {(str(cause).strip().splitlines() or [''])[0][:200]}"
    return UnreadableTorchFileError(
        path, f"not a readable torch.save file (corrupt, truncated or another format): {cause}"
    )
