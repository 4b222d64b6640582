"""Typed reading of YAML mappings that records every problem instead of stopping at the first.

A ``Section`` wraps one mapping and its dotted path. Each accessor validates one field and
returns either the typed value or the default, recording a problem when the value is wrong.
``Section.finish()`` reports unknown fields with a did-you-mean. The loader collects all problems
and raises ``ConfigError`` once, so a user sees every mistake in one run.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from typing import Any, Iterable, Sequence

__all__ = ["ConfigError", "Problems", "Section", "REQUIRED", "expand_env", "did_you_mean"]


class _Required:
    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return "REQUIRED"


REQUIRED: Any = _Required()


class ConfigError(Exception):
    """Raised once with every problem found in a configuration."""

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


class Problems:
    def __init__(self) -> None:
        self.items: list[str] = []
        self.settled: set[str] = set()  # paths already reported at their root cause (a missing ${VAR})

    def add(self, path: str, message: str) -> None:
        if path in self.settled:
            return
        self.items.append(f"{path}: {message}" if path else message)

    def raise_if_any(self) -> None:
        if self.items:
            raise ConfigError(self.items)

    def __bool__(self) -> bool:
        return bool(self.items)


def did_you_mean(value: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` when a choice is close to value, else an empty string."""
    close = difflib.get_close_matches(str(value).strip().lower(), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def expand_env(data: Any, problems: Problems, path: str = "", env: dict[str, str] | None = None) -> Any:
    """Replace ``${VAR}`` in every string of a loaded YAML tree; a missing variable is a problem."""
    env = os.environ if env is None else env
    if isinstance(data, str):
        if "${" not in data:
            return data

        def sub(m: re.Match[str]) -> str:
            name = m.group(1)
            if name not in env:
                problems.add(path, f"environment variable {name!r} is not set (referenced as ${{{name}}})")
                problems.settled.add(path)
                return ""
            return env[name]

        return _ENV_REF.sub(sub, data)
    if isinstance(data, dict):
        return {k: expand_env(v, problems, _join(path, str(k)), env) for k, v in data.items()}
    if isinstance(data, list):
        return [expand_env(v, problems, f"{path}[{i}]", env) for i, v in enumerate(data)]
    return data


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return type(value).__name__


class Section:
    """One YAML mapping under a dotted path; accessors record problems and return defaults."""

    def __init__(self, data: Any, path: str, problems: Problems):
        self.path = path
        self.problems = problems
        self._seen: set[str] = set()
        self._retired: set[str] = set()  # reported by retired(), never listed as valid
        if data is None:
            data = {}
        if not isinstance(data, dict):
            problems.add(path, f"expected a mapping, got {_type_name(data)}")
            data = {}
        self.data: dict[str, Any] = data

    # -- helpers -----------------------------------------------------------------------------
    def where(self, key: str) -> str:
        return _join(self.path, key)

    def has(self, key: str) -> bool:
        return key in self.data

    def _get(self, key: str, default: Any) -> tuple[bool, Any]:
        self._seen.add(key)
        if key not in self.data or self.data[key] is None:
            if default is REQUIRED:
                self.problems.add(self.where(key), "required field is missing")
            return False, default
        return True, self.data[key]

    def error(self, key: str, message: str) -> None:
        self.problems.add(self.where(key), message)

    # -- scalar accessors ------------------------------------------------------------------------
    def raw(self, key: str, default: Any = None) -> Any:
        return self._get(key, default)[1]

    def str(self, key: str, default: Any = REQUIRED, *, allow_empty: bool = False) -> Any:
        present, value = self._get(key, default)
        if not present:
            return value
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            self.error(key, f"expected a string, got {_type_name(value)}")
            return None if default is REQUIRED else default
        value = str(value)
        if not allow_empty and not value.strip():
            self.error(key, "must not be empty")
            return None if default is REQUIRED else default
        return value

    def enum(self, key: str, choices: Sequence[str], default: Any = REQUIRED) -> Any:
        """A string normalised (strip, lower-case) and checked against choices; errors show it as given."""
        present, value = self._get(key, default)
        if not present:
            return value
        if not isinstance(value, str):
            self.error(key, f"{value!r} is not a valid choice; choose one of: {', '.join(choices)}")
            return None if default is REQUIRED else default
        norm = value.strip().lower()
        if norm not in choices:
            self.error(key, f"{value!r} is not a valid choice; choose one of: {', '.join(choices)}{did_you_mean(value, choices)}")
            return None if default is REQUIRED else default
        return norm

    def bool(self, key: str, default: Any = REQUIRED) -> Any:
        present, value = self._get(key, default)
        if not present:
            return value
        if not isinstance(value, bool):
            self.error(key, f"expected true or false, got {value!r}")
            return False if default is REQUIRED else default
        return value

    def int(self, key: str, default: Any = REQUIRED, *, min: int | None = None, max: int | None = None) -> Any:
        present, value = self._get(key, default)
        if not present:
            return value
        if isinstance(value, bool) or not isinstance(value, int):
            self.error(key, f"expected an integer, got {value!r}")
            return None if default is REQUIRED else default
        if (min is not None and value < min) or (max is not None and value > max):
            self.error(key, f"{value!r} is out of range; must be {_range(min, max, False, False)}")
            return None if default is REQUIRED else default
        return value

    def number(
        self,
        key: str,
        default: Any = REQUIRED,
        *,
        min: float | None = None,
        max: float | None = None,
        exclusive: bool = False,
    ) -> Any:
        """A real number; with exclusive=True the bounds themselves are refused."""
        present, value = self._get(key, default)
        if not present:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            self.error(key, f"expected a number, got {value!r}")
            return None if default is REQUIRED else default
        low_bad = min is not None and (value <= min if exclusive else value < min)
        high_bad = max is not None and (value >= max if exclusive else value > max)
        if low_bad or high_bad:
            self.error(key, f"{value!r} is out of range; must be {_range(min, max, exclusive, exclusive)}")
            return None if default is REQUIRED else default
        return float(value)

    def str_list(self, key: str, default: Any = REQUIRED) -> Any:
        present, value = self._get(key, default)
        if not present:
            return list(value) if isinstance(value, (list, tuple)) else value
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list):
            self.error(key, f"expected a list of strings, got {_type_name(value)}")
            return [] if default is REQUIRED else list(default)
        out: list[str] = []
        for i, item in enumerate(value):
            if isinstance(item, bool) or not isinstance(item, (str, int, float)):
                self.problems.add(f"{self.where(key)}[{i}]", f"expected a string, got {_type_name(item)}")
                continue
            out.append(str(item))
        return out

    def retired(self, key: str, replaced_by: str) -> None:
        """A setting that existed once: an error that says what replaced it, never a silent ignore."""
        self._retired.add(key)
        if key in self.data:
            self.error(key, f"this setting was retired; {replaced_by}")

    # -- nested --------------------------------------------------------------------------------
    def section(self, key: str) -> "Section":
        self._seen.add(key)
        return Section(self.data.get(key), self.where(key), self.problems)

    def sections(self, key: str) -> list["Section"]:
        """A list of mappings; a single mapping is accepted as a list of one."""
        self._seen.add(key)
        value = self.data.get(key)
        if value is None:
            return []
        if isinstance(value, dict):
            value = [value]
        if not isinstance(value, list):
            self.error(key, f"expected a list, got {_type_name(value)}")
            return []
        return [Section(item, f"{self.where(key)}[{i}]", self.problems) for i, item in enumerate(value)]

    def finish(self) -> None:
        """Report every field that no accessor asked for: a typo must not pass silently."""
        valid = sorted(self._seen)
        for key in self.data:
            if key in self._seen or key in self._retired:
                continue
            hint = did_you_mean(str(key), valid)
            self.problems.add(self.where(str(key)), f"unknown field{hint}; valid fields: {', '.join(valid)}")


def _range(lo: float | None, hi: float | None, lo_excl: bool, hi_excl: bool) -> str:
    parts = []
    if lo is not None:
        parts.append(f"{'>' if lo_excl else '>='} {lo:g}")
    if hi is not None:
        parts.append(f"{'<' if hi_excl else '<='} {hi:g}")
    return " and ".join(parts)
