"""The versions the series is tested with (constraints.txt's pins) and the oldest it supports
(pyproject.toml's floors), read in one place for ``python -m ddp_helpers.doctor`` and tools/torch_matrix.py.

Standard library only, and importing it imports no torch: the torch matrix runs it with the system's python3
before any environment exists.
"""

from __future__ import annotations

import re
from pathlib import Path


def read_pins(path: Path) -> dict[str, str]:
    """``name==version`` lines of a constraints file, names lower-cased; comments and other lines ignored."""
    pins = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        name, sep, version = line.split("#")[0].split(";")[0].strip().partition("==")
        if sep and name.strip() and version.strip():
            pins[name.strip().lower().replace("_", "-")] = version.strip()
    return pins


def read_dependencies(pyproject: Path) -> list[str]:
    """pyproject.toml's dependencies, as written there (``torch>=2.8``)."""
    # imported here: Python 3.10, which pyproject.toml allows, has no tomllib, and the doctor must start there
    import tomllib

    return tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]["dependencies"]


def read_floors(pyproject: Path) -> dict[str, str]:
    """The oldest supported release of each dependency: its ``name>=X`` in pyproject.toml's dependencies."""
    floors = {}
    for req in read_dependencies(pyproject):
        name, sep, version = req.partition(">=")
        if sep:
            floors[name.strip().lower()] = version.split(",")[0].strip()
    return floors


def release(version: str) -> tuple[int, ...]:
    """'2.14.1+cu130' -> (2, 14, 1): the release numbers, before any local or pre-release suffix."""
    return tuple(int(n) for n in re.match(r"\d+(?:\.\d+)*", version)[0].split("."))
