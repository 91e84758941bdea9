"""Frozen copies of a config tree: what a run resolved, which nothing may change afterwards.

The config sections are ordinary (mutable) dataclasses, owned by their packages. :func:`freeze`
copies a tree of them into instances of frozen twins: subclasses (``isinstance`` still holds;
``dataclasses.fields`` / ``asdict`` and OmegaConf read them as the originals) whose attributes
cannot be assigned or deleted (``dataclasses.FrozenInstanceError``, as a ``frozen=True``
dataclass; lists and mappings inside are copies, held as a frozen dataclass holds them). A
changed tree is a new one: ``dataclasses.replace`` of a frozen section gives a frozen section,
its nested sections frozen too. :func:`thaw` gives back an ordinary copy. Copies and pickles of a
frozen tree stay frozen.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, TypeVar

T = TypeVar("T")

_TWINS: dict[type, type] = {}
"""Each config class's frozen twin, made once."""
_OPEN: set[int] = set()
"""The ids of frozen instances being built (their ``__init__`` assigns the fields)."""


def _is_dataclass_instance(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def is_frozen(value: Any) -> bool:
    """Whether ``value`` is an instance of a frozen twin (:func:`freeze`)."""
    return type(value) in _TWINS.values()


def _twin(cls: type) -> type:
    """The frozen subclass of the dataclass ``cls``."""
    if cls in _TWINS:
        return _TWINS[cls]

    def __init__(self, *args, **kwargs):  # dataclasses.replace builds through here
        _OPEN.add(id(self))
        try:
            cls.__init__(self, *args, **kwargs)
            for f in dataclasses.fields(cls):
                value = getattr(self, f.name, None)
                if _is_dataclass_instance(value) and not is_frozen(value):
                    object.__setattr__(self, f.name, freeze(value))
        finally:
            _OPEN.discard(id(self))

    def __setattr__(self, name, value):
        if id(self) not in _OPEN:
            raise dataclasses.FrozenInstanceError(
                f"cannot assign to field {name!r} of a resolved {cls.__name__}: the run's config "
                "is never changed; build a changed copy with dataclasses.replace"
            )
        object.__setattr__(self, name, value)

    def __delattr__(self, name):
        raise dataclasses.FrozenInstanceError(
            f"cannot delete field {name!r} of a resolved {cls.__name__}"
        )

    def __eq__(self, other):
        if not isinstance(other, cls):
            return NotImplemented
        names = [f.name for f in dataclasses.fields(cls) if f.compare]
        return all(getattr(self, n) == getattr(other, n) for n in names)

    def __reduce__(self):  # copy.deepcopy and pickle: a frozen copy of the ordinary one
        return freeze, (thaw(self),)

    twin = type(
        cls.__name__,
        (cls,),
        {
            "__init__": __init__,
            "__setattr__": __setattr__,
            "__delattr__": __delattr__,
            "__eq__": __eq__,
            "__hash__": None,
            "__reduce__": __reduce__,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "__doc__": cls.__doc__,
        },
    )
    _TWINS[cls] = twin
    return twin


def freeze(tree: T) -> T:
    """A frozen copy of the dataclass ``tree`` and of every dataclass in its fields (module
    docstring); a frozen tree is returned as it is.

    Raises:
        TypeError: ``tree`` is not a dataclass instance.
    """
    if is_frozen(tree):
        return tree
    if not _is_dataclass_instance(tree):
        raise TypeError(f"freeze takes a dataclass instance, not {type(tree).__name__}")
    frozen = object.__new__(_twin(type(tree)))
    for name, value in vars(tree).items():
        value = freeze(value) if _is_dataclass_instance(value) else copy.deepcopy(value)
        object.__setattr__(frozen, name, value)
    return frozen


def thaw(tree: T) -> T:
    """An ordinary (mutable) deep copy of the dataclass ``tree``, frozen or not."""
    if not _is_dataclass_instance(tree):
        return copy.deepcopy(tree)
    cls = type(tree).__mro__[1] if is_frozen(tree) else type(tree)
    plain = object.__new__(cls)
    for name, value in vars(tree).items():
        object.__setattr__(plain, name, thaw(value))
    return plain
