"""``fast_init``: a quicker constructor for the frozen, slotted dataclasses made per key.

Why: a frozen dataclass's generated ``__init__`` stores each field with
``object.__setattr__``, a generic attribute lookup per field: about 0.7 µs for a six-field
``Placement`` or ``ObjectCommitted``, made for every key a put, a read or a restore touches.
Storing through the slots' own descriptors does the same in about half the time.

Rules of this file:
- Only the constructor changes: the class stays a frozen dataclass (assignment after
  construction raises ``FrozenInstanceError``; equality, hashing, ``repr``, ``replace`` and
  the signature's names and defaults are the dataclass's own).
- Only plain fields are accepted (a default value or none): a class with a default factory,
  ``__post_init__``, init-only or keyword-only fields is refused at import, not mis-built.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

T = TypeVar("T")


def fast_init(cls: type[T]) -> type[T]:
    """Give the frozen, slotted dataclass ``cls`` a constructor that stores each field
    through its slot descriptor (see the module docstring); returns ``cls``."""
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen or "__slots__" not in vars(cls) \
            or hasattr(cls, "__post_init__"):
        raise TypeError(f"{cls.__name__}: fast_init takes a frozen, slotted dataclass "
                        "without __post_init__")
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    names: dict[str, Any] = {}
    arguments, body = [], []
    for index, f in enumerate(fields):
        if f.default_factory is not dataclasses.MISSING or f.kw_only or not f.init:
            raise TypeError(f"{cls.__name__}.{f.name}: fast_init takes plain fields only")
        names[f"_set{index}"] = getattr(cls, f.name).__set__
        if f.default is dataclasses.MISSING:
            arguments.append(f.name)
        else:
            names[f"_default{index}"] = f.default
            arguments.append(f"{f.name}=_default{index}")
        body.append(f"    _set{index}(self, {f.name})")
    source = f"def __init__(self, {', '.join(arguments)}):\n" + "\n".join(body) + "\n"
    exec(source, names)  # the same technique dataclasses itself uses to build __init__
    init = names["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__doc__ = cls.__init__.__doc__
    cls.__init__ = init  # type: ignore[method-assign]
    return cls
