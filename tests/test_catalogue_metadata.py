"""A patch's torch range and upstream link are written once, in its ``Patch(...)``: its module's
docstring states them as the Patch declares them."""

import importlib
import re

import pytest

from torchpatch import _versions
from torchpatch._registry import _patches_in, catalogue_modules

pytestmark = pytest.mark.torch_independent  # the catalogue's source

MODULES = {name: importlib.import_module(f"torchpatch.patches.{name}") for name in catalogue_modules()}
PATCHES = [(name, patch) for name, module in MODULES.items() for patch in _patches_in(module)]
RANGE_IN_WORDS = re.compile(r"\btorch (\d+\.\d+(?:[-–]\d+\.\d+| and later)?)")
FIELD = re.compile(r"^[A-Z][A-Za-z ]*:\s")  # a docstring field: "Torch:", "Fix:", "Upstream:"


def header(docstring: str) -> str:
    """The docstring's first paragraph on one line: ``<patch id>: <what>, torch <range>.``"""
    return " ".join(docstring.split("\n\n", 1)[0].split())


def field(docstring: str, name: str) -> str:
    """The docstring field ``name`` (``Upstream:``) on one line, up to the next field; "" if absent."""
    lines = docstring.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(f"{name}:")), None)
    if start is None:
        return ""
    end = next((i for i in range(start + 1, len(lines)) if FIELD.match(lines[i])), len(lines))
    return " ".join(" ".join(lines[start:end]).split())


def test_docstring_header_states_the_id_and_the_patchs_range():
    """A module holds one patch (named after it): its docstring's header is that patch's."""
    wrong = []
    for name, patch in PATCHES:
        first = header(MODULES[name].__doc__ or "")
        words = _versions.in_words(patch.torch)
        if not first.startswith(f"{patch.id}: ") or words not in RANGE_IN_WORDS.findall(first):
            wrong.append(f"{name}: expected '{patch.id}: ..., torch {words}.' ({patch.torch}), found {first!r}")
    assert not wrong, "\n".join(wrong)


def test_docstring_upstream_field_holds_the_patchs_link():
    wrong = []
    for name, patch in PATCHES:
        upstream = field(MODULES[name].__doc__ or "", "Upstream")
        if not upstream or patch.upstream not in upstream:
            wrong.append(f"{name}: {patch.upstream!r} not in its Upstream field {upstream!r}")
    assert not wrong, "\n".join(wrong)
