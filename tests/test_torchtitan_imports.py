"""torchpatch breaks no module of torchtitan's releases: each module outside ``experiments`` that imports
natively imports with TORCHPATCH=1 too (the import survey, in forked interpreters: every module with
TORCHPATCH=1, and natively those that fail with it, which is what tells torchpatch's breakage apart), what
still fails is torch's (a feature the catalogue cannot serve) or a CUDA-only package's, and every module
of 0.1.0 imports on torch 2.4+.

The releases are the ones tests/test_torchtitan.py trains (``TORCHTITAN_TEST_RELEASES``); without them
every test here skips. A file of its own so that pytest-xdist runs the survey (one process at a time) beside
the training runs (which fill the cores), not after them.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

import survey
from conftest import TORCH, torch_matches, torchpatch_command
from test_torchtitan import RELEASES

pytestmark = pytest.mark.skipif(not RELEASES, reason="no torchtitan release installed (TORCHTITAN_TEST_RELEASES)")

# (release, torch specifier): every module outside ``experiments`` imports with TORCHPATCH=1.
IMPORTS_ALL = [("0.1.0", ">=2.4")]
# Third-party packages a release imports that its wheel does not require (CUDA-only or optional; 'fla':
# flash-linear-attention, the Triton kernels of 0.3.0's Qwen3.5).
NOT_TORCH = ("triton", "torchvision", "transformers", "DeepEP", "deep_ep", "torch_checkpointing.", "'fla'")

# release -> the torches whose sessions survey its imports: 0.1.0's on 2.4 and 2.15 (25-35 s a torch), 0.2.2's
# and 0.3.0's on 2.13 (the torchtitan-on-2.13 session; 270 modules with TORCHPATCH=1, natively those that fail
# with it: 166 s in that session). The 2.4.1 and 2.9.0 sessions install 0.2.2 and 0.3.0 to train them, not to
# survey them again; TORCHTITAN_TEST_SURVEY=1 surveys every installed release.
SURVEYED = {"0.1.0": (">=2.4,<2.5", "==2.15.*"), "0.2.2": ("==2.13.*",), "0.3.0": ("==2.13.*",)}


@pytest.fixture(scope="module")
def result() -> survey.Survey:
    everything = os.environ.get("TORCHTITAN_TEST_SURVEY") == "1"
    releases = [path for release, path in RELEASES.items()
                if everything or any(torch_matches(spec) for spec in SURVEYED.get(release, ()))]
    if not releases:
        pytest.skip(f"no installed release's import survey runs on torch {TORCH} (TORCHTITAN_TEST_SURVEY=1: all)")
    names = [survey.installed(path, "torchtitan", exclude=("experiments",)) for path in releases]
    outcome = survey.run_survey(sys.executable, names, natively="failures")
    print("\n" + survey.format_table(outcome))
    return outcome


def _release(package: str) -> str:
    return next(v for v, path in RELEASES.items() if package == f"torchtitan@{Path(path).name}")


def test_nothing_that_imports_natively_breaks(result):
    for name, pkg in result.packages.items():
        broken = {m: r.error for m, r in pkg.failures("on").items() if pkg.results["off"][m].ok}
        assert not broken, f"{name}: import natively, fail with TORCHPATCH=1: {broken}"
        failed = {m: [p for p, s in r.patches.items() if s == "failed"] for m, r in pkg.results["on"].items()}
        assert not any(failed.values()), f"{name}: patches failed while applying: {failed}"


def test_failures_with_torchpatch_are_torchs(result):
    """What still fails with TORCHPATCH=1 is a torch feature the catalogue cannot serve (or a CUDA-only
    third-party package), never something torchpatch broke or half-served."""
    for name, pkg in result.packages.items():
        for module, r in pkg.failures("on").items():
            assert "torch" in r.error or any(t in r.error for t in NOT_TORCH), (name, module, r.error)


@pytest.mark.parametrize("release, spec", IMPORTS_ALL)
def test_every_module_imports(result, release, spec):
    if release not in RELEASES or not torch_matches(spec):
        pytest.skip(f"torchtitan {release} on torch {spec} only")
    pkg = next(p for n, p in result.packages.items() if _release(n) == release)
    ok, total = pkg.rate("on")
    assert ok == total, {m: r.error for m, r in pkg.failures("on").items()}


# what ``torchpatch check`` of each release leaves unresolved on torch 2.4 (the oldest torch 0.2.2 and 0.3.0 train
# on), each name with the configuration that reaches it: none is on the path the docs table's runs train
CHECKED = (">=2.4,<2.5", Path(__file__).parent / "fixtures" / "torchtitan_check_24.json")


@pytest.mark.parametrize("release", ["0.1.0", "0.2.2", "0.3.0"])
def test_check_leaves_unresolved_only_what_no_run_reaches(release):
    """``torchpatch check`` agrees with the runs: what it cannot resolve is what the declared list names
    (configurations the runs do not use), no more (a new gap on the trained path) and no less (a stale entry)."""
    spec, fixture = CHECKED
    if release not in RELEASES or not torch_matches(spec):
        pytest.skip(f"torchtitan {release}'s check is recorded for torch {spec}")
    package = Path(RELEASES[release]) / "torchtitan"
    paths = sorted(str(p) for p in package.iterdir() if p.name not in ("experiments", "__pycache__"))
    proc = torchpatch_command("check", "--json", *paths)
    assert proc.returncode in (0, 1), proc.stderr
    unresolved = {row["name"] for row in json.loads(proc.stdout)["rows"] if row["kind"] == "unresolved"}
    declared = set(json.loads(fixture.read_text())[release])
    assert unresolved == declared, {"not declared": sorted(unresolved - declared), "stale": sorted(declared - unresolved)}
