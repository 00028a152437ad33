"""Typed launch-config schemas: one frozen dataclass per op, validated field by field.

A schema subclasses ``KernelConfig``, declares every field with its type and default, lists the shape
features a table entry may match on in ``MATCH`` (name -> type), and may add range checks in ``check``.
``from_fields`` builds an instance from a table entry or an override and raises ``ValueError`` naming any
unknown field, wrong type or out-of-range value, so a misspelled entry never passes silently.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Literal, get_args, get_origin, get_type_hints

from triton.runtime.errors import OutOfResources

__all__ = ["KernelConfig", "check_match_key", "names_config", "TILES", "WARPS"]

TILES = (16, 32, 64, 128)  # tile widths the kernels take (powers of two; tl.dot needs >= 16)
WARPS = (1, 2, 4, 8, 16)


def _type_ok(value: Any, tp: Any) -> bool:
    if get_origin(tp) is tuple:  # tuple[X, ...]: a list or tuple of X (JSON gives lists)
        return isinstance(value, (list, tuple)) and all(_type_ok(v, get_args(tp)[0]) for v in value)
    if get_origin(tp) is Literal:
        return any(value == a and type(value) is type(a) for a in get_args(tp))
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    raise TypeError(f"unsupported config field type {tp!r}")


def _freeze(value: Any) -> Any:
    return tuple(_freeze(v) for v in value) if isinstance(value, (list, tuple)) else value


def _type_name(tp: Any) -> str:
    if get_origin(tp) is tuple:
        return f"a list of {_type_name(get_args(tp)[0])}"
    if get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    return tp.__name__


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Base of every op's launch-config schema (see the module docstring)."""

    OP: ClassVar[str] = ""
    MATCH: ClassVar[Mapping[str, Any]] = {}
    # entries that hold one GPU's own measurements rather than kernel choices: never shared with another GPU
    MEASURED: ClassVar[bool] = False

    def check(self) -> None:
        """Range checks beyond the field types (``one_of`` / ``within``); raise ``ValueError`` naming the field."""

    def one_of(self, names, allowed) -> None:
        """Each field of ``names`` (a name or several) holds one of ``allowed``."""
        for name in (names,) if isinstance(names, str) else names:
            if getattr(self, name) not in allowed:
                raise ValueError(f"{self.OP} config: {name!r} must be one of {tuple(allowed)}, got {getattr(self, name)}")

    def within(self, names, lo, hi=None, *, open_lo: bool = False) -> None:
        """Each field of ``names`` lies in ``[lo, hi]`` (``(lo, hi]`` with ``open_lo``; no upper bound for None)."""
        for name in (names,) if isinstance(names, str) else names:
            v = getattr(self, name)
            if v != v or (v <= lo if open_lo else v < lo) or (hi is not None and v > hi):  # NaN fails every bound
                span = f"{'(' if open_lo else '['}{lo}, {hi if hi is not None else 'inf'}{']' if hi is not None else ')'}"
                raise ValueError(f"{self.OP} config: {name!r} must lie in {span}, got {v}")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            tp = _hints(type(self))[f.name]
            if not _type_ok(value, tp):
                raise ValueError(f"{self.OP} config: field {f.name!r} expects {_type_name(tp)}, got {value!r}")
            if isinstance(value, (list, tuple)):  # frozen and hashable like every other field
                object.__setattr__(self, f.name, _freeze(value))
        self.check()

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_fields(cls, fields: Mapping[str, Any], *, base: KernelConfig | None = None, where: str = ""):
        """``base`` (or the defaults) updated with ``fields``; unknown names are a ``ValueError``."""
        if not isinstance(fields, Mapping):
            raise ValueError(f"{cls.OP} config{where}: expected an object of fields, got {type(fields).__name__}")
        known = cls.field_names()
        unknown = sorted(set(fields) - set(known), key=str)  # names of any type (an in-process override)
        if unknown:
            raise ValueError(f"{cls.OP} config{where}: unknown field(s) {unknown}; the fields are {sorted(known)}")
        start = dataclasses.asdict(base) if base is not None else {}
        try:
            return cls(**{**start, **fields})
        except ValueError as e:
            raise ValueError(f"{e}{where}") from None

    def replace(self, **fields: Any):
        return self.from_fields(fields, base=self)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def check_match_key(schema: type[KernelConfig], key: Mapping[str, Any], *, where: str) -> None:
    """A ``match`` object of a table entry (or a caller's key) uses only the schema's ``MATCH`` names and types."""
    for name, value in key.items():
        if name not in schema.MATCH:
            raise ValueError(f"{schema.OP} config{where}: unknown match key {name!r}; the keys are "
                             f"{sorted(schema.MATCH)}")
        tp = schema.MATCH[name]
        if not _type_ok(value, tp):
            raise ValueError(f"{schema.OP} config{where}: match key {name!r} expects {_type_name(tp)}, got {value!r}")
        if tp is int and value < 0:  # shape features are counts and sizes: a negative one matches no call
            raise ValueError(f"{schema.OP} config{where}: match key {name!r} expects an int >= 0, got {value!r}")


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = get_type_hints(cls, vars(typing) | vars(__import__(cls.__module__, fromlist=["_"])))
    return _HINTS[cls]


def names_config(op: str) -> Callable:
    """Decorator of a launcher whose kernels take their tiles and stages from ``op``'s config without a shared-memory
    model of their own: Triton's ``OutOfResources`` (a kernel asks for more shared memory or registers than the
    GPU's block holds; raised before it runs, so nothing is written) becomes a ``ValueError`` naming the config
    that asked (a table entry or an override: ``GQLA_TRITON_CONFIG``, ``config_override``). The shipped tables fit
    (``python -m tools.audit_shared``)."""
    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def launcher(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except OutOfResources as e:
                raise ValueError(f"{op} config: a kernel needs {e.required} of {e.name}, more than this GPU's "
                                 f"{e.limit}: the table entry or override in force asks for tiles or stages that "
                                 "do not fit; lower its tile (*_bv, *_bk) or *_num_stages fields") from e
        return launcher
    return wrap

