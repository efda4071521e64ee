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

import subprocess
import sys

from conftest import REPO, clean_env, only_torch

FUZZ = [sys.executable, str(REPO / "tools" / "dtensor_fuzz.py"), "check", "--python", sys.executable]


def _check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(FUZZ + list(args), env=clean_env(), capture_output=True, text=True, timeout=900)


@only_torch(">=2.4,<2.15", "The DTensor correctness patches apply from torch 2.4 (the fuzzer needs 2.4's DTensor API).")
def test_every_corpus_program_gives_what_torch_2_15_gives_with_torchpatch():
    proc = _check()
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert " 0 break the rule" in proc.stdout


@only_torch("==2.15.*", "The corpus records torch 2.15.0's outcomes.")
def test_the_corpus_is_what_torch_2_15_does_natively():
    proc = _check("--native")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
