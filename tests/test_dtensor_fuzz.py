"""The DTensor differential fuzzer's fixed-seed corpus (``tools/dtensor_fuzz.py``,
``tests/fixtures/dtensor_fuzz_corpus.json``): random DTensor programs (pointwise, reductions and
norms, in-place and foreach ops over Shard/Replicate/Partial on 1-D and 2x1 meshes, AdamW/SGD steps,
``clip_grad_norm_``, tensor-parallel MLPs, norm layers, loss parallel), each run on 2 gloo ranks and
compared with the same computation on full tensors in the rank.

The corpus holds torch 2.15.0's outcome of each program (right, or its error's type); no value is
stored. With ``TORCHPATCH=1`` every torch from 2.4 must give a right value wherever 2.15.0 does, never
a wrong one, and never fail on one rank only; the 2.15.0 session checks that the corpus still says
what 2.15.0 does. A long run, by category, is ``tools/dtensor_fuzz.py compare`` (docs/silent-bugs.md,
"Silent wrong results")."""

import itertools
import json
import subprocess
import sys

import pytest

from conftest import PATCH_TORCH, REPO, clean_env, only_torch, torch_matches
from torchpatch import _versions

sys.path.insert(0, str(REPO / "tools"))
import dtensor_fuzz  # noqa: E402

FUZZ = [sys.executable, str(REPO / "tools" / "dtensor_fuzz.py"), "check", "--python", sys.executable]
# The last DTensor correctness patch whose range ends: where it (and the ones ending before it) applies,
# the whole corpus runs with TORCHPATCH=1 (2.4.1, 2.9.0, 2.13.0 in CI). A newer torch before 2.15 (2.14.1)
# has only the open-ended ones, which 2.13.0 runs the whole corpus with: it runs the corpus's first
# SAMPLE programs (drawn at random like the rest), a check of its own DTensor against 2.15.0's outcomes.
LAST_BOUNDED = "dtensor-reduction-strategy"
SAMPLE = 50


def _check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(FUZZ + list(args), env=clean_env(), capture_output=True, text=True, timeout=900)


@only_torch(">=2.4,<2.15", "The DTensor correctness patches apply from torch 2.4 (the fuzzer needs 2.4's DTensor API).")
def test_every_corpus_program_gives_what_torch_2_15_gives_with_torchpatch():
    _first, end = _versions.minor_range(PATCH_TORCH[LAST_BOUNDED])
    whole = torch_matches("<%d.%d" % end)
    proc = _check() if whole else _check("--first", str(SAMPLE))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert " 0 break the rule" in proc.stdout
    corpus = json.loads((REPO / "tests" / "fixtures" / "dtensor_fuzz_corpus.json").read_text())
    assert f": {corpus['count'] if whole else SAMPLE} programs," in proc.stdout, proc.stdout


@only_torch("==2.15.*", "The corpus records torch 2.15.0's outcomes.")
def test_the_corpus_is_what_torch_2_15_does_natively():
    proc = _check("--native")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]


@pytest.mark.torch_independent
def test_the_rule_needs_no_native_run_of_a_program_right_with_torchpatch():
    """``check`` runs natively only the programs whose TORCHPATCH=1 outcome is not ``right``: whatever
    such a program did natively and whatever 2.15.0 does, a right outcome never breaks the rule."""
    kinds = ["right", "wrong", "split", "invalid", "error:RuntimeError", "error:ValueError", "missing"]
    for native, oracle in itertools.product(kinds, kinds[:-1]):
        category = dtensor_fuzz.category(native, "right", oracle)
        assert category not in dtensor_fuzz.BAD and (native == "missing" or "missing" not in category)
        assert dtensor_fuzz.breaks_rule({}, {0: "right"}, {0: oracle}) == []  # not run natively: not missing
    assert [dtensor_fuzz.needs_native(kind) for kind in kinds] == [False] + [True] * (len(kinds) - 1)
