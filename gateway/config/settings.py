"""One definition per setting.

A config dataclass declares each field it reads from YAML with ``setting(default, doc, ...)``:
its type (the annotation), default, bounds or choices, and one sentence. From that one place:

- ``read_fields(cls, section)`` reads every plain field (boolean, integer, number, string, choice,
  list of strings) with ``Section``'s accessors, so the messages are the loader's usual ones;
- ``gateway config reference`` and ``gateway config schema`` (``config/reference.py``) print the
  Markdown reference and the JSON Schema.

A field whose YAML form needs its own parser (``gpus``, ``max_wait``, a domain list, ...) declares
``custom=`` (its JSON Schema and a short type name); its section reader reads it by hand. Nested
sections are dataclass-typed fields; their readers are called by the enclosing reader. Fields that
are not YAML settings (derived or bookkeeping) are declared with ``internal()``. A class may list
settings it once had in ``RETIRED`` (name -> what replaced it): ``read_fields`` reports each one a
user still writes, and the reference lists them.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import MISSING, dataclass
from typing import Any, Callable, Mapping

from .fields import REQUIRED, Section

__all__ = ["Setting", "setting", "internal", "declared", "kind_of", "read_fields", "default_of"]


@dataclass(frozen=True)
class Setting:
    doc: str
    min: float | None = None
    max: float | None = None
    exclusive: bool = False  # the bounds themselves are refused (numbers only)
    # Allowed values, normalised (lower case); a mapping gives the value stored for each.
    choices: tuple[str, ...] | Mapping[str, Any] | None = None
    custom: Mapping[str, Any] | None = None  # JSON Schema of a field read by hand
    type_name: str | None = None  # the reference's type cell for a custom field
    shown_default: str | None = None  # the reference's default cell, where repr would mislead
    where: str | None = None  # the table this section appears in, when it is not its field's path
    list_of_one: bool = True  # sections: a single mapping is taken as a list of one
    # sections: a sibling field whose entries stand in this list too, each as {<its name>: {...}}
    # (``backends`` holds URL backends and ``{discover: ...}`` entries)
    alternative: str | None = None


def setting(
    default: Any = MISSING,
    doc: str = "",
    *,
    default_factory: Callable[[], Any] | Any = MISSING,
    **rules: Any,
) -> Any:
    """A dataclass field read from YAML; ``doc`` is its one sentence in the reference."""
    if not doc:
        raise ValueError("a setting needs its one sentence")
    return dataclasses.field(default=default, default_factory=default_factory, metadata={"setting": Setting(doc, **rules)})


def internal(default: Any = MISSING, *, default_factory: Callable[[], Any] | Any = MISSING, **kw: Any) -> Any:
    """A dataclass field that is not a YAML setting (derived at load, or bookkeeping)."""
    return dataclasses.field(default=default, default_factory=default_factory, metadata={"internal": True}, **kw)


def declared(cls: type) -> list[tuple[dataclasses.Field, Setting]]:
    return [(f, f.metadata["setting"]) for f in dataclasses.fields(cls) if "setting" in f.metadata]


def default_of(f: dataclasses.Field) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return REQUIRED


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _strip_optional(tp: Any) -> Any:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def kind_of(cls: type, f: dataclasses.Field) -> tuple[str, Any]:
    """What a declared field is: ``boolean``, ``integer``, ``number``, ``string``, ``strings``,
    ``section`` / ``sections`` / ``mapping`` (with the dataclass inside), or ``custom``."""
    meta: Setting = f.metadata["setting"]
    if meta.custom is not None:
        return "custom", None
    tp = _strip_optional(_hints(cls)[f.name])
    if tp is bool:
        return "boolean", None
    if tp is int:
        return "integer", None
    if tp is float:
        return "number", None
    if tp is str:
        return "string", None
    if dataclasses.is_dataclass(tp):
        return "section", tp
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        if args[0] is str:
            return "strings", None
        if dataclasses.is_dataclass(args[0]):
            return "sections", args[0]
    if origin is dict and len(args) == 2 and args[0] is str and dataclasses.is_dataclass(args[1]):
        return "mapping", args[1]
    raise TypeError(f"{cls.__name__}.{f.name}: type {tp!r} needs custom= (its JSON Schema) and a reader")


def read_fields(cls: type, s: Section, defaults: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Every plain setting of ``cls`` read from ``s`` (problems recorded on it), by field name.

    Sections and custom fields are left to the caller. ``defaults`` replaces a field's default
    for this read (e.g. ``None``, to tell "not set" from the default).
    """
    out: dict[str, Any] = {}
    for name, replaced_by in getattr(cls, "RETIRED", {}).items():
        s.retired(name, replaced_by)
    for f, meta in declared(cls):
        kind, _ = kind_of(cls, f)
        if kind in ("section", "sections", "mapping", "custom"):
            continue
        default = defaults[f.name] if defaults and f.name in defaults else default_of(f)
        if kind == "boolean":
            out[f.name] = s.bool(f.name, default)
        elif kind == "integer":
            out[f.name] = s.int(f.name, default, min=_int(meta.min), max=_int(meta.max))
        elif kind == "number":
            out[f.name] = s.number(f.name, default, min=meta.min, max=meta.max, exclusive=meta.exclusive)
        elif kind == "strings":
            value = s.str_list(f.name, default)
            out[f.name] = tuple(value) if isinstance(value, list) else value
        elif meta.choices is not None:
            value = s.enum(f.name, tuple(meta.choices), _choice_key(meta.choices, default))
            out[f.name] = meta.choices[value] if isinstance(meta.choices, Mapping) and value is not None else value
        else:
            out[f.name] = s.str(f.name, default)
    return out


def _choice_key(choices: tuple[str, ...] | Mapping[str, Any], default: Any) -> Any:
    """The input spelling of a default stored under a mapping's value (``"DLSlime"`` -> ``"dlslime"``)."""
    if isinstance(choices, Mapping):
        for key, value in choices.items():
            if value == default:
                return key
    return default


def _int(v: float | None) -> int | None:
    return None if v is None else int(v)
