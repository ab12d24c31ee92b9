"""Records for the agent's files (status.json, result.json, a process's identity) without the
dataclasses module.

Why: `ctl status` and `ctl tail` start the container's python for one agent call
(agent/runview.py), and importing dataclasses — which imports inspect, ast, dis and tokenize —
was ≈ 13–15 ms of that call's ≈ 35 ms of imports (docs/benchmarks.md, "Shared SSH connection").
A record is what those classes used of a dataclass, and behaves the same there: construction by
position or keyword, defaults (:class:`Factory` for a fresh list or dict per record), equality,
repr, frozen records that refuse assignment and hash by value, :func:`fields` and :func:`asdict`.
tests/test_records.py holds it to dataclasses' behaviour.
"""

from __future__ import annotations

_MISSING = object()


class FrozenRecordError(AttributeError):
    """Assignment to a field of a frozen record (dataclasses.FrozenInstanceError's place)."""


class Factory:
    """A field default made anew for each record (``Factory(list)``: dataclasses'
    ``field(default_factory=list)``)."""

    __slots__ = ("make",)

    def __init__(self, make):
        self.make = make


class Field:
    __slots__ = ("name", "type", "default")

    def __init__(self, name: str, type_: object, default: object):
        self.name, self.type, self.default = name, type_, default

    def __repr__(self) -> str:
        return f"Field(name={self.name!r}, type={self.type!r})"


def fields(record_or_class) -> tuple[Field, ...]:
    """The fields, in the order the class declares them."""
    return record_or_class.__record_fields__


def asdict(obj):
    """The record as a dict, records, lists, tuples and dicts inside it converted too."""
    if hasattr(type(obj), "__record_fields__"):
        return {f.name: asdict(getattr(obj, f.name)) for f in obj.__record_fields__}
    if isinstance(obj, (list, tuple)):
        return type(obj)(asdict(v) for v in obj)
    if isinstance(obj, dict):
        return {asdict(k): asdict(v) for k, v in obj.items()}
    return obj


def record(cls=None, *, frozen: bool = False):
    """``@record`` or ``@record(frozen=True)`` on a class with annotated fields."""
    def wrap(cls):
        own = cls.__dict__.get("__annotations__", {})
        flds = tuple(Field(name, own[name], cls.__dict__.get(name, _MISSING)) for name in own)
        seen_default = False
        for f in flds:
            if f.default is _MISSING and seen_default:
                raise TypeError(f"non-default argument {f.name!r} follows default argument")
            seen_default = seen_default or f.default is not _MISSING
            if isinstance(f.default, Factory):
                delattr(cls, f.name)
        names = tuple(f.name for f in flds)
        name = cls.__qualname__

        def __init__(self, *args, **kwargs):
            if len(args) > len(flds):
                raise TypeError(f"{name}.__init__() takes {len(flds) + 1} positional arguments but "
                                f"{len(args) + 1} were given")
            for i, f in enumerate(flds):
                if i < len(args):
                    if f.name in kwargs:
                        raise TypeError(f"{name}.__init__() got multiple values for argument {f.name!r}")
                    value = args[i]
                elif f.name in kwargs:
                    value = kwargs.pop(f.name)
                elif f.default is _MISSING:
                    raise TypeError(f"{name}.__init__() missing 1 required positional argument: {f.name!r}")
                elif isinstance(f.default, Factory):
                    value = f.default.make()
                else:
                    value = f.default
                object.__setattr__(self, f.name, value)
            if kwargs:
                raise TypeError(f"{name}.__init__() got an unexpected keyword argument {next(iter(kwargs))!r}")

        def __repr__(self):
            return f"{name}(" + ", ".join(f"{n}={getattr(self, n)!r}" for n in names) + ")"

        def __eq__(self, other):
            if other.__class__ is not self.__class__:
                return NotImplemented
            return tuple(getattr(self, n) for n in names) == tuple(getattr(other, n) for n in names)

        cls.__record_fields__ = flds
        cls.__init__, cls.__repr__, cls.__eq__ = __init__, __repr__, __eq__
        if frozen:
            def __setattr__(self, key, value):
                raise FrozenRecordError(f"cannot assign to field {key!r}")

            def __delattr__(self, key):
                raise FrozenRecordError(f"cannot delete field {key!r}")

            cls.__setattr__, cls.__delattr__ = __setattr__, __delattr__
            cls.__hash__ = lambda self: hash(tuple(getattr(self, n) for n in names))
        else:
            cls.__hash__ = None  # mutable and compared by value: unhashable, as a dataclass is
        return cls

    return wrap if cls is None else wrap(cls)
