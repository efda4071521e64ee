"""torchtitan's releases from the package index on the installed torch: its own trainer trains
(examples/torchtitan_cpu.py) with the losses and gradient norms of one process over
the same global batch (each data-parallel rank reads its own part), from bitwise the same weights; and
a gradient scaled by 1.01 on one rank is seen. (That every module imports: tests/test_torchtitan_imports.py.)

The releases are installed by the nox matrix sessions of torch >= 2.4 (``pip install --no-deps
--target DIR torchtitan==X`` plus its light dependencies in the venv) and named in
``TORCHTITAN_TEST_RELEASES`` (``0.1.0=DIR,0.2.2=DIR,...``); without it (the README's quick
``nox -s tests``) every test here skips. Which release is installed on which torch is the noxfile's
``TORCHTITAN``. The full release x torch x parallelism table, against the newest torch's native run, is
made by ``tools/torchtitan_table.py`` (docs/torchtitan.md); CI runs the subset in ``TRAIN``, against one
process on the same torch and, for 0.1.0, the recorded run of 2.15.0 natively (``NEWEST_NATIVE``): a
subset that exercises the patches each release needs where they apply (named beside each entry, and in
docs/torchtitan.md): 0.1.0 on torch 2.4 and 2.9 (FSDP+TP+SAC on 4 ranks: from the seed checkpoint, with
DCP save + resume on 2.4 (``RESUME``: the training run saves, a second run resumes); on 2.9 also without
checkpointing, ``TRAIN_FROM_SCRATCH``), 0.2.2 and 0.3.0 on 2.4, 2.9 and 2.13 (with the Triton that 2.13's CUDA
builds bring).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from typing import Dict, List, Tuple

import pytest

import forkserver
from conftest import TORCH, REPO, launch, matrix_python, torch_matches

sys.path.insert(0, str(REPO / "tools"))
import torchtitan_table as table  # noqa: E402


def forked(cmd: List[str], env: Dict[str, str], ranks: int, timeout: float, cwd: str) -> subprocess.CompletedProcess:
    """The example's ranks forked from a warm interpreter (tests/forkserver.py) instead of torchrun's fresh
    ones (``table.Launch``): the same environment and torchrun's variables (examples/launch.py), the ranks'
    output joined; one process forked as ``python example args``. A run computes bitwise what it computes
    under torchrun (losses, gradient norms, weights digest; 0.1.0's fsdp and fsdp+tp+sac on 2.9.0 checked);
    it saves the ~5 s of CPU each rank spends importing torch and torch._dynamo. The release's torchtitan is
    not imported before the fork: it imports pyarrow (through datasets), which starts threads at import,
    and a process forked from one running threads is not a fresh one (the server refuses it)."""
    if ranks == 1:
        return forkserver.run(cmd, env=env, timeout=timeout, cwd=cwd)
    done = launch(cmd[1], ranks, cmd[2:], env=env, timeout=timeout, python=cmd[0], popen=forkserver.popen,
                  cwd=cwd, inherit=False)
    if any(r.timed_out for r in done):
        raise subprocess.TimeoutExpired(cmd, timeout)
    return subprocess.CompletedProcess(cmd, max(abs(r.returncode) for r in done), "".join(r.stdout or "" for r in done),
                                       "".join(r.stderr or "" for r in done))


run_example = functools.partial(table.run_example, launch=forked)

RELEASES: Dict[str, str] = dict(
    item.split("=", 1) for item in os.environ.get("TORCHTITAN_TEST_RELEASES", "").split(",") if "=" in item
)
pytestmark = pytest.mark.skipif(not RELEASES, reason="no torchtitan release installed (TORCHTITAN_TEST_RELEASES)")

# (release, torch specifier) -> the parallelisms CI trains there; one process on the same torch over the
# same global batch is the reference.
TRAIN: Dict[Tuple[str, str], Tuple[str, ...]] = {
    # fsdp+tp+sac on 4 ranks: the 2-D state dict (fsdp2-2d-state-dict), the embedding's gradient
    # (fsdp2-tp-grad-placements: without it the first gradient norm is 0.14% above one process's), and
    # the TP of 2.4 (dtensor-public, tp-prepare-module-input-output). TP alone (clip_grad_norm_ of its
    # partial gradients, dtensor-inplace-placement-change, 2.2-2.12) is 0.2.2's `tp` on 2.4 in CI; 0.1.0's
    # `tp` cells (2.4.1, 2.9.0) are the docs table's. 2.4.1's `fsdp` (and its DCP save + resume) is the docs
    # table's too: 2.4.1's FSDP trains 8 steps and saves in the 2.15 session (DCP_FROM_OLDER), and
    # fsdp+tp+sac here trains and resumes through the same FSDP2 patches
    ("0.1.0", ">=2.4,<2.5"): ("pp", "fsdp+tp+sac"),
    # FSDP+TP+SAC on 4 ranks. Its PP trained here too until CI's time was cut (issue 42): 2.9's P2P warm-up,
    # which aborts gloo natively (pipelining-gloo-warmup), is 0.2.2's PP below (without the patch:
    # `op.preamble.length <= op.nbytes. 8 vs 4`, SIGABRT)
    ("0.1.0", "==2.9.*"): ("fsdp+tp+sac",),
    # 0.2.2 and 0.3.0 on 2.4, the oldest torch they train on: what they import (the context-parallel module
    # dtensor-context-parallel-210 serves, custom-op-string-annotations, sdpa-enable-gqa, ...); 0.2.2's TP
    # (clip_grad_norm_ of its partial gradients, dtensor-inplace-placement-change, 2.2-2.12); 0.3.0's PP
    # (pipelining-stage-kwargs: 2.4 ran the later stages without the block mask's kwargs,
    # pipelining-stage-get-mesh, pipelining-step-loss-kwargs). The other cells of 2.4.1's rows are the docs
    # table's.
    ("0.2.2", ">=2.4,<2.5"): ("tp",),
    ("0.3.0", ">=2.4,<2.5"): ("pp",),
    # 0.2.2 and 0.3.0 on 2.9: what they import (varlen, inductor-wrap-compiled-regions, spmd_types' layouts
    # and local-tensor helpers ...); 0.2.2's PP (pipelining-return-outputs, pipelining-context,
    # pipelining-gloo-warmup); 0.3.0's FSDP (fsdp2-dp-mesh-dims, fsdp2-partial-group-forward,
    # dtensor-spec-aliasing). Their TP and PP cells of 2.9.0 trained here too until 2.4 took them over.
    ("0.2.2", "==2.9.*"): ("pp",),
    ("0.3.0", "==2.9.*"): ("fsdp",),
    ("0.2.2", "==2.13.*"): ("fsdp",),  # fsdp2-gloo-divide-factor
    # 0.3.0: FSDP of spmd_types-annotated parameters (fsdp2-spmd-types); PP with pre-split microbatches
    # (pipelining-presplit-inputs). Its 8-rank cells (hsdp+tp, pp+fsdp+tp: 2-4 min each here) and FSDP+TP+SAC
    # are the docs table's; CI's 8-rank job on 2.13 is tests/test_cluster_shapes.py's (the same patches,
    # fsdp2-spmd-types and fsdp2-gloo-divide-factor, on a 3-D mesh in 15-80 s).
    ("0.3.0", "==2.13.*"): ("fsdp", "pp"),
}
# release -> torch 2.15.0's native run on one process (TORCHPATCH unset; its fsdp, tp, pp and fsdp+tp+sac runs
# equal it to 1e-5) from the seed checkpoint made on torch 2.9.0 with TORCHPATCH=1: the digest of the weights it
# loads, its losses and gradient norms. The torches whose sessions train 0.1.0 (2.4, 2.9) make a seed checkpoint
# that loads to bitwise these weights; 2.15.0 initialises other weights (its seed checkpoint differs), which
# is why the docs' table makes one seed checkpoint on the oldest torch. Recorded with
# ``python examples/torchtitan_cpu.py --parallel single --steps 8 --seed-checkpoint SEED`` on 2.15.0 (torch
# 2.15.0 runs it bit for bit like 2.9.0). 0.2.2's and 0.3.0's are not recorded: 2.15.0's native FSDP fails on
# gloo (PREMUL_SUM), and the docs' table compares them with 2.15.0's one process.
NEWEST_NATIVE: Dict[str, table.Run] = {
    "0.1.0": table.Run(
        [6.626339912414551, 6.335608005523682, 5.375094413757324, 4.6519775390625,
         3.7562148571014404, 3.681603193283081, 3.1478872299194336, 3.375253438949585],
        [2.609593246509583, 2.6063962330089683, 2.861338708397727, 2.6794495666387728,
         2.7509528566829093, 2.345009943848604, 2.5949050046225524, 2.8601980480600417],
        "e0a099c1dc37f75b05f875333128809319aa8e647a20b3790d21e9bbd9d8b46a", ""),
}
# (release, parallelism) -> torch 2.15.0's native run, where that is the reference instead of one process:
# torchtitan 0.2.2's PP backpropagates the microbatches' summed token losses without dividing them by the
# token count (it divides only the loss it reports; its schedule has scale_grads=False): gradients 128
# times one process's (4 microbatches of 32 tokens) on every torch, 2.15 natively too, which AdamW all but
# cancels (losses within 2.4e-5 of one process's over 8 steps). 0.3.0 divides. Recorded by
# tools/torchtitan_table.py from the seed checkpoint made on torch 2.9.0 (docs/torchtitan.md's 0.2.2 rows).
NEWEST_NATIVE_OF: Dict[Tuple[str, str], table.Run] = {
    ("0.2.2", "pp"): table.Run(
        [8.403205871582031, 7.896839141845703, 7.032036781311035, 6.085141181945801,
         4.95649528503418, 4.702698230743408, 4.264625072479248, 4.465010166168213],
        [330.6112943514789, 326.599713752465, 374.23320913049474, 381.3750782150103,
         396.60206585756606, 349.46046104196944, 422.8238470833955, 429.4978003994812],
        "1c34dc8301f7621f03596fe540730dd74d7b8dbe52eb82768df9ec869f6de0d1", ""),
}
# (release, torch specifier) -> the parallelisms CI trains there from torchtitan's own seeded
# initialisation with checkpointing off (what a user training without checkpoints runs). On CPU each rank
# draws its shards from the same seed (DTensor's RNG tracker serves CUDA only), so one process starts
# elsewhere; the reference is the same run on torch 2.9.0 with TORCHPATCH=1, recorded in FROM_SCRATCH,
# which the 2.9.0 session runs again (there the same configuration from the seed checkpoint equals one
# process and 2.15.0's native run). 2.15.0 initialises other weights (its own run from scratch starts
# elsewhere), so it cannot be the reference. Torch 2.4.1 trained it here until it could load the seed
# checkpoint (fsdp2-2d-state-dict): its first gradient norm was 0.14% above 2.9.0's, all of it the
# embedding's (fsdp2-tp-grad-placements); with both patches it equals this record (1.1e-7), and its
# fsdp+tp+sac from the seed checkpoint (TRAIN) sees the same wrong gradient without the second.
TRAIN_FROM_SCRATCH: Dict[Tuple[str, str], Tuple[str, ...]] = {
    ("0.1.0", "==2.9.*"): ("fsdp+tp+sac",),  # the recorded reference, still what 2.9.0 computes
}
FROM_SCRATCH: Dict[Tuple[str, str], table.Run] = {
    ("0.1.0", "fsdp+tp+sac"): table.Run(
        [6.523015022277832, 6.104269981384277, 5.17910099029541, 4.78825044631958,
         4.252833843231201, 4.18123197555542, 3.631288766860962, 3.8927674293518066],
        [2.5889809267336332, 2.5607957039821287, 2.7853221088432707, 2.713814158957799,
         3.2611847602581046, 2.911201471237523, 2.9843192611625096, 3.0867108614272007],
        "174558dca20986cbbff2a68652020583e19194ff705f34f867908276ab283431", ""),
}
STEPS = 8
WRONG_GRADIENT = 1.01  # rank 1's gradient of the model output, scaled: the comparison must see it
# where CI shows it: 0.2.2's FSDP on 2.13, whose gradient division fsdp2-gloo-divide-factor serves
WRONG_GRADIENT_CELL = ("0.2.2", "==2.13.*")
DCP_STEPS = 4  # save at step 2, resume for steps 3 and 4
# (release, torch specifier) -> the older torch whose matrix venv saves the checkpoint this torch resumes
# (docs/torchtitan.md's "DCP older to newer"): its session runs earlier in the same `nox -t matrix`. The
# older torch makes the seed checkpoint (2.15 initialises other weights) and trains FSDP from it for STEPS
# steps, saving at step 2; this torch resumes, its steps 3.. against its recorded native run from that seed.
# 2.4's optimizer and scheduler state lacks entries 2.7 added (dcp-older-state-keys).
DCP_FROM_OLDER: Dict[Tuple[str, str], str] = {("0.1.0", "==2.15.*"): "2.4.1"}


@pytest.fixture(scope="module")
def seeds(tmp_path_factory) -> Dict[str, str]:
    """One seed checkpoint per release, made by torchtitan's own seed-checkpoint feature on this torch."""
    out = {}
    for release, path in RELEASES.items():
        seed = str(tmp_path_factory.mktemp(f"seed-{release}") / "seed")
        error = run_example(sys.executable, path, ["--make-seed-checkpoint", seed], 1, True).error
        out[release] = error or seed
    return out


_ONE_PROCESS: Dict[str, table.Run] = {}  # release -> the single-process run from its seed checkpoint


def _one_process(seeds: Dict[str, str], release: str) -> table.Run:
    """One process over the global batch, from the release's seed checkpoint: one run per release."""
    if release not in RELEASES:
        pytest.skip(f"torchtitan {release} is not installed")
    assert os.path.isdir(seeds[release]), f"seed checkpoint: {seeds[release]}"
    if release not in _ONE_PROCESS:
        _ONE_PROCESS[release] = run_example(sys.executable, RELEASES[release], [
            "--parallel", "single", "--steps", str(STEPS), "--seed-checkpoint", seeds[release]], 1, True)
    reference = _ONE_PROCESS[release]
    assert not reference.error and len(reference.losses) == STEPS, reference.error
    return reference


def _train_cases() -> List[Tuple[str, str]]:
    return [(release, parallel) for (release, spec), parallels in TRAIN.items() for parallel in parallels
            if torch_matches(spec)]


_TRAINED: Dict[Tuple[str, str], Tuple[table.Run, str]] = {}  # (release, parallel) -> its run, its checkpoints


def _trained(seeds: Dict[str, str], release: str, parallel: str,
             folders: pytest.TempPathFactory) -> Tuple[table.Run, str]:
    """``parallel``'s STEPS steps from the release's seed checkpoint, once per session; where
    test_dcp_save_and_resume resumes it (``_resume_cases``), saving a DCP checkpoint every 2 steps into the
    folder returned: the resumed run repeats this one, which is then not run a second time to save."""
    if (release, parallel) not in _TRAINED:
        args = ["--parallel", parallel, "--steps", str(STEPS), "--seed-checkpoint", seeds[release]]
        folder = str(folders.mktemp(f"ckpt-{release}-{parallel}") / "ckpt")  # torchtitan: not there yet
        if (release, parallel) in _resume_cases():
            args += ["--checkpoint-dir", folder, "--checkpoint-interval", "2"]
        _TRAINED[(release, parallel)] = (run_example(sys.executable, RELEASES[release], args,
                                                           table.RANKS[parallel], True), folder)
    return _TRAINED[(release, parallel)]


@pytest.mark.parametrize("release, parallel", _train_cases() or [pytest.param("-", "-", marks=pytest.mark.skip(
    reason=f"no training run is recorded for torch {TORCH}"))])
def test_trains_like_one_process(seeds, release, parallel, tmp_path_factory):
    reference = _one_process(seeds, release)
    run, _ = _trained(seeds, release, parallel, tmp_path_factory)
    assert not run.error and len(run.losses) == STEPS, run.error
    assert run.weights == reference.weights, "the run and one process start from other weights"
    # where the release's own arithmetic differs from one process's, 2.15.0's native run of the parallelism
    newest = NEWEST_NATIVE_OF.get((release, parallel))
    if newest is None:  # float32 sums in another order (sharded matmuls, reduce-scatter); torch 2.4-2.6's
        # pipeline schedules average the microbatches' gradients as 2.7+ do with pipelining-scale-grads
        assert table.compare(run, reference) <= table.TOLERANCE, (run, reference)
        newest = NEWEST_NATIVE.get(release)
    assert run.losses[-1] < run.losses[0] - 1.0, f"the loss should fall over {STEPS} steps: {run.losses}"
    if newest is not None:  # and the newest torch's native run, from bitwise the same weights
        assert run.weights == newest.weights, "this torch's seed checkpoint loads other weights than 2.15.0's run"
        assert table.compare(run, newest) <= table.TOLERANCE, (run, newest)


def test_sees_a_wrong_gradient(request):
    """FSDP with rank 1's gradient scaled by 1.01 (``--debug-grad-scale``): the comparison with one
    process fails (the gradient norms differ by about 0.5%; the losses of two steps by about 1e-6 only)."""
    release, spec = WRONG_GRADIENT_CELL
    if not torch_matches(spec):
        pytest.skip(f"CI shows it with torchtitan {release} on torch {spec}")
    seeds = request.getfixturevalue("seeds")  # after the skip: where nothing trains, no seed checkpoint is made
    reference = _one_process(seeds, release)
    run = run_example(sys.executable, RELEASES[release], [
        "--parallel", "fsdp", "--steps", "2", "--seed-checkpoint", seeds[release],
        "--debug-grad-scale", str(WRONG_GRADIENT)], 2, True)
    assert not run.error and len(run.losses) == 2 and run.weights == reference.weights, run
    assert table.compare(run, reference) > table.TOLERANCE, (run, reference)


@pytest.mark.parametrize("release, parallel", [
    (release, parallel) for (release, spec), parallels in TRAIN_FROM_SCRATCH.items() for parallel in parallels
    if torch_matches(spec)] or [pytest.param("-", "-", marks=pytest.mark.skip(
        reason=f"no training run without a checkpoint is recorded for torch {TORCH}"))])
def test_trains_without_checkpoint(release, parallel):
    """No seed checkpoint, checkpointing off: the losses of the same run on torch 2.9.0 (recorded)."""
    if release not in RELEASES:
        pytest.skip(f"torchtitan {release} is not installed")
    run = run_example(sys.executable, RELEASES[release], ["--parallel", parallel, "--steps", str(STEPS)],
                            table.RANKS[parallel], True)
    assert not run.error and len(run.losses) == STEPS, run.error
    reference = FROM_SCRATCH[(release, parallel)]
    assert run.weights == reference.weights, "torchtitan's seeded initialisation gives other weights than on 2.9.0"
    assert table.compare(run, reference) <= table.TOLERANCE, (run, reference)
    assert run.losses[-1] < run.losses[0] - 1.0, f"the loss should fall over {STEPS} steps: {run.losses}"


# (release, torch specifier) -> parallelisms besides FSDP whose DCP save + resume CI runs there: 0.1.0's
# FSDP+TP+SAC on 2.4 (the 2-D state dict, fsdp2-2d-state-dict; 2.5 has it natively)
RESUME: Dict[Tuple[str, str], Tuple[str, ...]] = {("0.1.0", ">=2.4,<2.5"): ("fsdp+tp+sac",)}


def _resume_cases() -> List[Tuple[str, str]]:
    fsdp = sorted({(r, "fsdp") for (r, spec), p in TRAIN.items() if torch_matches(spec) and "fsdp" in p})
    return fsdp + [(r, p) for (r, spec), parallels in RESUME.items() if torch_matches(spec) for p in parallels]


@pytest.mark.parametrize("release, parallel", _resume_cases() or [("-", "fsdp")])
def test_dcp_save_and_resume(seeds, release, parallel, tmp_path, tmp_path_factory):
    """The training run (test_trains_like_one_process's, from the seed checkpoint) saved a DCP checkpoint at
    step 2; a second run resumes from it: steps 3 and 4 repeat the training run's (losses, gradient norms)."""
    if release not in RELEASES:
        pytest.skip(f"no torchtitan release trains on torch {TORCH} here")
    whole, saved = _trained(seeds, release, parallel, tmp_path_factory)
    assert not whole.error and len(whole.losses) == STEPS, whole.error
    folder = tmp_path / "ckpt"  # a copy of step 2 alone: the resumed run saves its last step into it
    shutil.copytree(os.path.join(saved, "step-2"), folder / "step-2")
    rest = run_example(sys.executable, RELEASES[release], ["--parallel", parallel, "--steps", str(DCP_STEPS),
                                                                 "--checkpoint-dir", str(folder), "--load-step", "2"],
                             table.RANKS[parallel], True)
    assert not rest.error and len(rest.losses) == DCP_STEPS - 2, rest.error
    assert table.compare(rest, whole, 2) <= table.TOLERANCE, (rest, whole)


@pytest.mark.parametrize("release, older", [
    (release, older) for (release, spec), older in DCP_FROM_OLDER.items() if torch_matches(spec)] or [
    pytest.param("-", "-", marks=pytest.mark.skip(reason=f"no checkpoint of an older torch is resumed on torch {TORCH}"))])
def test_dcp_resumes_what_an_older_torch_saved(release, older, tmp_path):
    """FSDP from the seed checkpoint the older torch makes, saved there at step 2 and resumed here (both with
    TORCHPATCH=1): steps 3.. equal this torch's native run from that seed checkpoint, recorded."""
    python = matrix_python(older)
    if release not in RELEASES or not python.exists():
        pytest.skip(f"torchtitan {release} or the torch {older} venv ({python}) is missing")
    seed = str(tmp_path / "seed")
    error = run_example(str(python), RELEASES[release], ["--make-seed-checkpoint", seed], 1, True).error
    assert not error, error
    outcome = table.dcp_from_older({older: str(python), TORCH: sys.executable}, RELEASES[release], seed, tmp_path,
                                   STEPS, {TORCH: NEWEST_NATIVE[release]}, launch=forked)[TORCH]
    assert not outcome["error"] and outcome["same_weights"], outcome
    assert len(outcome["losses"]) == STEPS and outcome["vs_uninterrupted"] <= table.TOLERANCE, outcome
