"""The installed torch's version, read from its distribution metadata without importing torch,
version specifiers matched against it, and a patch's torch specifier in words."""

from __future__ import annotations

import functools
import os
import re
import sys
from typing import List, Optional, Tuple

_RELEASE = re.compile(r"^\s*v?(\d+(?:\.\d+)*)")
_CLAUSE = re.compile(r"^\s*(>=|<=|==|!=|<|>)\s*(\d+(?:\.\d+)*)\s*$")


def _from_dist_info(directory: str) -> Optional[str]:
    try:
        names = os.listdir(directory)
    except OSError:
        return None
    for name in names:
        if name.startswith("torch-") and name.endswith(".dist-info"):
            try:
                with open(os.path.join(directory, name, "METADATA"), encoding="utf-8") as fh:
                    for line in fh:
                        if line.startswith("Version:"):
                            return line.split(":", 1)[1].strip()
                        if not line.strip():
                            break
            except OSError:
                continue
    return None


@functools.lru_cache(maxsize=None)
def torch_version() -> Optional[str]:
    """The installed torch's version string (e.g. ``2.1.2+cu121``), or ``None`` if torch is absent.

    Scans ``sys.path`` for ``torch-*.dist-info`` the way the import system would find torch (first
    entry wins), falling back to :mod:`importlib.metadata` for other install layouts.
    """
    for entry in sys.path:
        if os.path.isdir(os.path.join(entry or ".", "torch")):
            found = _from_dist_info(entry or ".")
            if found:
                return found
    if sys.version_info >= (3, 10):
        from importlib import metadata
    else:
        import importlib_metadata as metadata
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def release(version: str) -> Optional[Tuple[int, ...]]:
    """The release part: ``2.1.2+cu121`` and ``2.5.0a0+git123`` are (2, 1, 2) and (2, 5, 0)."""
    found = _RELEASE.match(version)
    return tuple(int(x) for x in found.group(1).split(".")) if found else None


def _pad(a: Tuple[int, ...], b: Tuple[int, ...]) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    n = max(len(a), len(b))
    return a + (0,) * (n - len(a)), b + (0,) * (n - len(b))


_OPS = {
    ">=": lambda a, b: a >= b, "<=": lambda a, b: a <= b, "==": lambda a, b: a == b,
    "!=": lambda a, b: a != b, "<": lambda a, b: a < b, ">": lambda a, b: a > b,
}


def matches(specifier: str, version: Optional[str]) -> bool:
    """Whether ``version``'s release (local and pre-release parts dropped) satisfies ``specifier``.

    ``""`` matches any version. Plain clauses (``>=2.1,<2.5``) are compared here; anything else
    (``~=``, wildcards) goes to :mod:`packaging`, which is otherwise not imported: activation runs
    in every process.
    """
    if version is None:
        return False
    base = release(version)
    if base is None:
        return False
    if not specifier.strip():
        return True
    clauses = [_CLAUSE.match(part) for part in specifier.split(",")]
    if all(clauses):
        return all(
            _OPS[c.group(1)](*_pad(base, tuple(int(x) for x in c.group(2).split(".")))) for c in clauses  # type: ignore[union-attr]
        )
    from packaging.specifiers import SpecifierSet

    return SpecifierSet(specifier).contains(".".join(map(str, base)), prereleases=True)


OLDEST = (1, 13)  # the oldest torch the catalogue covers: a range without a lower bound starts there
_LAST_MINOR = {1: 13}  # the last minor release of a torch major: 1.13 precedes 2.0
Minor = Tuple[int, int]


def minor_range(specifier: str) -> Tuple[Minor, Optional[Minor]]:
    """The torch minor versions ``specifier`` covers as (first, end): from ``first`` (1.13 where it has
    no lower bound) up to ``end``, excluded (``None`` where it has no upper bound). Only ``>=X.Y`` and
    ``<X.Y`` clauses, the form of the catalogue's specifiers; anything else is a ValueError."""
    first: Minor = OLDEST
    ends: List[Minor] = []
    for part in filter(str.strip, specifier.split(",")):
        clause = _CLAUSE.match(part)
        numbers = clause.group(2).split(".") if clause else []
        if not (clause and clause.group(1) in (">=", "<") and len(numbers) == 2):
            raise ValueError(f"not a range of torch minor versions: {specifier!r}")
        version = (int(numbers[0]), int(numbers[1]))
        if clause.group(1) == ">=":
            first = max(first, version)
        else:
            ends.append(version)
    return first, min(ends) if ends else None


def _previous(minor: Minor) -> Minor:
    major, number = minor
    if number:
        return major, number - 1
    if major - 1 not in _LAST_MINOR:
        raise ValueError(f"no torch release known before {major}.0")
    return major - 1, _LAST_MINOR[major - 1]


def in_words(specifier: str) -> str:
    """``specifier`` as a patch's docstring states it: ``>=2.2,<2.8`` is ``2.2-2.7``, ``>=2.4,<2.5``
    ``2.4``, ``>=2.4`` ``2.4 and later``, ``<2.1`` ``1.13-2.0`` (see :func:`minor_range`)."""
    first, end = minor_range(specifier)
    if end is None:
        return "%d.%d and later" % first
    last = _previous(end)
    if last < first:
        raise ValueError(f"no torch matches {specifier!r}")
    return "%d.%d" % first if last == first else "%d.%d-%d.%d" % (first + last)


def python_version() -> str:
    return "%d.%d.%d" % sys.version_info[:3]
