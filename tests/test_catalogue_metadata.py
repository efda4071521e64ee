"""A patch's torch range and upstream link are written once, in its ``Patch(...)``: its module's
docstring states them as the Patch declares them, and the tests of its module gate on torch versions
wholly inside or wholly outside its range, or on the range itself (conftest's ``where_patch_applies``
and kin read it)."""

import importlib
import re

import pytest

from conftest import HERE, TORCH_MINORS
from torchpatch import _versions
from torchpatch._registry import _patches_in, catalogue_modules

pytestmark = pytest.mark.torch_independent  # the catalogue's source and the tests' text

MODULES = {name: importlib.import_module(f"torchpatch.patches.{name}") for name in catalogue_modules()}
PATCHES = [(name, patch) for name, module in MODULES.items() for patch in _patches_in(module)]
RANGE_IN_WORDS = re.compile(r"\btorch (\d+\.\d+(?:[-–]\d+\.\d+| and later)?)")
FIELD = re.compile(r"^[A-Z][A-Za-z ]*:\s")  # a docstring field: "Torch:", "Fix:", "Upstream:"
LITERAL_GATE = re.compile(r"""\bonly_torch\(\s*(["'])(.*?)\1""")


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


def straddles(gate: str, patch_range: str) -> bool:
    """Whether some torch minor version in ``gate`` is in ``patch_range`` and another is not."""
    inside = {_versions.matches(patch_range, v) for v in TORCH_MINORS if _versions.matches(gate, v)}
    return inside == {True, False}


@pytest.mark.parametrize("gate, patch_range, expected", [
    (">=2.3,<2.7", ">=2.2,<2.8", False), (">=2.8", ">=2.2,<2.8", False), (">=2.2", ">=2.2,<2.8", True),
    ("<2.3", ">=2.2,<2.8", True), (">=2.4,!=2.4.*", ">=2.4,<2.5", False),
])
def test_straddles(gate, patch_range, expected):
    assert straddles(gate, patch_range) is expected


def test_literal_gates_of_a_patchs_tests_lie_inside_or_outside_its_range():
    """A literal ``only_torch("<spec>")`` in tests/test_patch_<module>.py that covers torches both
    where the patch applies and where it does not is a gate that drifted from the patch's range: gate
    on the range itself (``where_patch_applies``, ``where_patch_does_not_apply``, ``through_patch_range``,
    ``until_patch_range_ends``) or on torches wholly inside or outside it."""
    ranges = {name.split(".")[-1]: patch.torch for name, patch in PATCHES}
    wrong = []
    for path in sorted(HERE.glob("test_patch_*.py")):
        patch_range = ranges.get(path.stem[len("test_patch_"):])
        if patch_range is None:  # tests of several patches together (test_patch_dtensor_mixed.py)
            continue
        text = path.read_text()
        for found in LITERAL_GATE.finditer(text):
            if straddles(found.group(2), patch_range):
                line = text.count("\n", 0, found.start()) + 1
                wrong.append(f"{path.name}:{line}: only_torch({found.group(2)!r}) straddles the patch's {patch_range}")
    assert not wrong, "\n".join(wrong)


SUMMARY_ENDS_WITH_A_RANGE = re.compile(r"(,| on| before)( torch)? (\d+\.\d+([-–]\d+\.\d+)?\+?|\d+\.\d+ and \d+\.\d+)$")


def test_summary_leaves_the_range_to_the_patch():
    """The tables print a patch's range beside its summary, from ``Patch.torch``: a summary that ended
    with a range of its own would say it twice, and could drift."""
    assert not [p.summary for _, p in PATCHES if SUMMARY_ENDS_WITH_A_RANGE.search(p.summary)]
