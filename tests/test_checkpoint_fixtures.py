"""Checkpoints across torch versions, without a cross-venv run: this torch resumes the trainer state that
every torch of the matrix saved (``tests/fixtures/checkpoints/<torch>``, written by
``tools/checkpoint_fixtures.py``; what is saved: ``tests/checkpoint_programs.py``), and its next step
equals, bit for bit, the same state loaded through this torch's own ``load_state_dict`` from the
``torch.save`` copy saved beside it (computed here, in the run).

Older to newer is what ``dcp-older-state-keys`` serves (the newer optimizers' and schedulers' entries);
newer to older is what ``dcp-metadata-strides`` and ``lr-scheduler-state-verbose`` serve; a fixture
whose tensors do not fit the trainer still fails with torch's own error."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from packaging.version import Version

from checkpoint_programs import LOAD
from conftest import TORCH, clean_env, only_torch, run_json, run_ranks, patch_applies_here, where_patch_applies

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "checkpoints"
SAVERS = sorted((p.name for p in FIXTURES.iterdir()), key=Version)
HERE = Version(TORCH).base_version


def resume(saver: str, **env: str) -> dict:
    return run_json(LOAD, args=(str(FIXTURES / saver),), env=clean_env(**env), timeout=240)


def assert_resumes(out: dict) -> None:
    assert out["parts"] == {"load": "ok", "model": "ok", "optim": "ok", "sched": "ok", "loop": "ok"}, out
    assert set(out["step"].values()) == {"same"}, out["step"]


@only_torch(">=2.4", "DCP's get_state_dict/set_state_dict and the served loads")
@pytest.mark.parametrize("saver", SAVERS)
def test_resumes_every_matrix_torchs_checkpoint(saver):
    out = resume(saver, TORCHPATCH="1")
    assert out["saved_by"] == saver
    assert_resumes(out)


@only_torch(">=2.5", "the reference: torch 2.4's set_optimizer_state_dict(full_state_dict=True) leaves an FSDP2 "
                    "optimizer's state unsharded (full tensors beside sharded parameters)")
def test_fsdp2_ranks_resume_torch_2_4s_sharded_checkpoint(tmp_path):
    """The issue's case: FSDP2 on 2 gloo ranks, AdamW, saved with get_state_dict + dcp.save on torch
    2.4.1, resumed by FSDP2 on 2 ranks here; each rank's shards equal its reference's after a step."""
    script = f"import sys; sys.argv[1:] = [{str(FIXTURES / '2.4.1')!r}]\n" + LOAD
    proc = run_ranks(script, nproc=2, env=clean_env(TORCHPATCH="1"), tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(ranks) == 2
    for out in ranks:
        assert_resumes(out)


@where_patch_applies("dcp-older-state-keys")
@pytest.mark.parametrize("saver", [s for s in SAVERS if Version(s) < Version(HERE)])
def test_natively_older_optimizer_and_scheduler_entries_are_missing(saver):
    out = resume(saver)
    if Version(saver) < Version("2.4"):
        if Version(HERE) < Version("2.5"):  # torch 2.4 reads no older layout: dcp-pre-2-4-checkpoints
            assert out["parts"]["load"] == "RuntimeError: Missing key in checkpoint state_dict: loop.data.epoch.", out
        else:  # torch 2.5+ reads it, and its non-tensor subtrees (param groups, schedulers) come whole
            assert_resumes(out)
    elif Version(saver) < Version("2.7") <= Version(HERE):
        assert out["parts"]["load"].startswith("RuntimeError: Missing key in checkpoint state_dict: "), out
        key = out["parts"]["load"].split(": ")[-1].rstrip(".")
        assert key.rsplit(".", 1)[-1] in ("decoupled_weight_decay", "_is_initial"), key
    else:
        assert_resumes(out)


@only_torch(">=2.4", "DCP's get_state_dict/set_state_dict")
def test_a_checkpoint_that_does_not_fit_fails_with_torchs_own_error():
    """A fixture of an older torch, loaded into a trainer whose models have one more layer: torch's
    own missing-key error for the layer (not one of the entries the patch leaves out), nothing loaded."""
    older = SAVERS[1]  # torch 2.4.1: its optimizers lack entries that newer torch added
    code = LOAD.replace("nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))",
                        "nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4), nn.Linear(4, 4))")
    assert code != LOAD
    out = run_json(code, args=(str(FIXTURES / older),), env=clean_env(TORCHPATCH="1"), timeout=240)
    assert list(out["parts"]) == ["load"], out
    assert re.fullmatch(r"RuntimeError: Missing key in checkpoint state_dict: (adamw|adam|sgd)\.model\.3\.(weight|bias)\.",
                        out["parts"]["load"]), out


@only_torch(">=2.0,<2.4", "DCP's load_state_dict before torch 2.4")
@pytest.mark.parametrize("saver", SAVERS)
def test_before_2_4_resumes_its_own_and_names_the_torch_for_newer_checkpoints(saver):
    out = resume(saver, TORCHPATCH="1")
    if Version(saver) < Version("2.3"):
        assert_resumes(out)
    else:
        assert out["parts"]["load"].startswith(
            "RuntimeError: This distributed checkpoint was saved by torch 2.3 or newer: its metadata needs "
            "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING"), out


READ_METADATA = """
import json, sys, torch.distributed.checkpoint as dcp
try:
    dcp.FileSystemReader(sys.argv[1]).read_metadata()
    print(json.dumps({"error": None}))
except Exception as exc:
    print(json.dumps({"error": f"{type(exc).__name__}: {exc}", "cause": type(exc.__cause__).__name__}))
"""


@where_patch_applies("dcp-newer-metadata-error")
def test_natively_a_newer_checkpoints_metadata_fails_without_naming_a_torch():
    newer = str(FIXTURES / "2.4.1" / "dcp")
    native = run_json(READ_METADATA, args=(newer,))
    assert native["error"].startswith("AttributeError: Can't get attribute '_MEM_FORMAT_ENCODING'"), native
    served = run_json(READ_METADATA, args=(newer,), env=clean_env(TORCHPATCH="1"))
    assert served["error"].startswith("RuntimeError: This distributed checkpoint was saved by torch 2.3 or newer")
    assert "dcp_to_torch_save" in served["error"] and served["cause"] == "AttributeError"
    assert run_json(READ_METADATA, args=(str(FIXTURES / "2.1.2" / "dcp"),), env=clean_env(TORCHPATCH="1")) == {"error": None}


def test_each_checkpoint_patch_is_on_where_it_applies_and_nowhere_else():
    out = run_json("""
        import json, torch, torchpatch
        import torch.distributed.checkpoint.filesystem, torch.distributed.checkpoint.default_planner
        status = torchpatch.status()
        print(json.dumps({p: status.get(p) for p in ("dcp-older-state-keys", "dcp-pre-2-4-checkpoints",
                                                     "dcp-newer-metadata-error")}))
    """, env=clean_env(TORCHPATCH="1"))
    # in its range each finds what it fixes (on_import does not say "not needed"); outside, none loads
    assert out == {p: "applied" if patch_applies_here(p) else None for p in out}
