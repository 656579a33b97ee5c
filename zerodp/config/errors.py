"""The error every config problem ends in, and the report that collects problems before it is raised.

Every check of `load_config` adds to one `Report`; `load_config` raises one `ConfigError` with all
of them (see [Note: order of checks] in zerodp/config/load.py).
"""

from __future__ import annotations

import json
from typing import Any


class ConfigError(ValueError):
    """A DeepSpeed config zerodp cannot use. `problems` lists each one, naming its dotted key path.

    str(err) is a header line ("3 problems in DeepSpeed config 'ds.json':") then one problem a line.
    """

    def __init__(self, problems: list[str] | str, source: str | None = None) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        self.source = source
        super().__init__(self._render())

    def _render(self) -> str:
        count = len(self.problems)
        where = f" {self.source}" if self.source else ""
        header = f"{count} problem{'' if count == 1 else 's'} in DeepSpeed config{where}:"
        return "\n".join([header, *(f"  - {problem}" for problem in self.problems)])

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.problems, self.source))


def join_path(path: str, key: str | int) -> str:
    """The dotted key path of `key` inside `path` ("a.b" + "c" -> "a.b.c"; an int is a list index)."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


class Report:
    """Problems found so far, the dotted key paths whose value could not be used, and whether every
    unknown key is an error (`strict_keys`, see zerodp/config/unknown.py; default False)."""

    def __init__(self, strict_keys: bool = False) -> None:
        self.problems: list[str] = []
        self.failed: set[str] = set()
        self.strict_keys = strict_keys

    def add(self, path: str, message: str, failed: bool = True) -> None:
        """Record "path: message"; `failed` marks the key's value as unusable for later checks."""
        self.problems.append(f"{path}: {message}")
        if failed:
            self.failed.add(path)

    def usable(self, *paths: str) -> bool:
        """False if any of `paths`, a key inside one, or a section holding one failed."""
        return not any(f == p or f.startswith(p + ".") or p.startswith(f + ".")
                       for f in self.failed for p in paths)


def show_value(value: Any) -> str:
    """A value as the user wrote it in JSON (true, null, "abc"), shortened if long."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
