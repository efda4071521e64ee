"""Version specifiers compare the installed torch by its release, without importing torch."""

import pytest

from torchpatch import _versions


@pytest.mark.parametrize(
    "spec, version, expected",
    [
        (">=2.0", "2.1.2+cu121", True),
        (">=2.0", "1.13.1", False),
        ("<2.5", "2.5.0a0+git123", False),  # a 2.5 nightly has 2.5 features: compares as 2.5.0
        (">=2.1,<2.5", "2.4.1", True),
        (">=2.1,<2.5", "2.5.0", False),
        ("==2.1", "2.1.0", True),
        ("!=2.1.2", "2.1.2+cpu", False),
        ("", "1.0", True),
        ("~=2.1", "2.3.0", True),  # not a plain clause: packaging decides
        ("~=2.1.0", "2.2.0", False),
        (">=1.0", None, False),
    ],
)
def test_matches(spec, version, expected):
    assert _versions.matches(spec, version) is expected


def test_plain_clauses_agree_with_packaging():
    from packaging.specifiers import SpecifierSet

    for spec in (">=1.13", "<2.0", ">=2.1,<2.5", "==2.4.1", "!=2.9", ">2.1.2", "<=2.4"):
        for version in ("1.13.1", "2.0.0", "2.1.2", "2.4.1", "2.5.0", "2.9.0", "2.13.0"):
            assert _versions.matches(spec, version) is SpecifierSet(spec).contains(version), (spec, version)


def test_torch_version_from_metadata_without_importing_torch():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", "import sys; from torchpatch import _versions; "
                          "print(_versions.torch_version(), 'torch' in sys.modules)"],
                         capture_output=True, text=True).stdout.split()
    import torch

    assert out[1] == "False"
    assert _versions.release(out[0]) == _versions.release(torch.__version__)


@pytest.mark.torch_independent
@pytest.mark.parametrize("spec, words", [
    (">=2.2,<2.8", "2.2-2.7"), (">=2.4,<2.5", "2.4"), (">=2.4", "2.4 and later"), ("<2.1", "1.13-2.0"),
    ("<2.0", "1.13"), (">=1.13", "1.13 and later"), (">=2.10,<2.15", "2.10-2.14"),
])
def test_range_in_words(spec, words):
    assert _versions.in_words(spec) == words


@pytest.mark.torch_independent
@pytest.mark.parametrize("spec", [">=2.4.1", "==2.4", ">=2.4,<2.4", "~=2.1"])
def test_only_ranges_of_minor_versions_have_words(spec):
    with pytest.raises(ValueError):
        _versions.in_words(spec)
