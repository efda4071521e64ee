"""dcp-fsspec-filesystem: ``torch.distributed.checkpoint.fsspec_filesystem`` and the package's
``FsspecReader``/``FsspecWriter`` on torch 2.4-2.14, with 2.15's signatures.

One script saves a state dict through ``FsspecWriter`` (its eight positional arguments as 2.15 orders
them, and an fsspec storage option), loads it back through ``FsspecReader`` and compares bitwise; it
runs served (TORCHPATCH=1) where the patch applies and natively on torch 2.15. Where the 2.15 matrix
venv exists (``~/.cache/torchpatch/nox/matrix-torch-2-15-0``), the checkpoint written by the served
writer is also loaded by 2.15's own ``FsspecReader`` in a subprocess of that venv; the test skips
that part otherwise.
"""

import pytest

from conftest import clean_env, only_torch, run_json, run_newest_torch_json, run_py, torch_matches, where_patch_applies

pytest.importorskip("fsspec")

SAVE_LOAD = """
import json, sys, warnings, torch, torchpatch
warnings.simplefilter("ignore")
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FsspecReader, FsspecWriter
from torch.distributed.checkpoint import fsspec_filesystem
from pathlib import Path
torch.manual_seed(0)
saved = {"w": torch.randn(4, 3), "step": torch.tensor(7), "h": torch.randn(5, dtype=torch.bfloat16), "extra": {"lr": 0.5}}
path = sys.argv[1]
# 2.15's order: path, single_file_per_rank, sync_files, thread_count, per_thread_copy_ahead,
# cache_staged_state_dict, overwrite; then an fsspec storage option of the local file system
writer = FsspecWriter(path, True, True, 2, 1000, False, True, auto_mkdir=True)
dcp.save(saved, storage_writer=writer)
loaded = {"w": torch.zeros(4, 3), "step": torch.tensor(0), "h": torch.zeros(5, dtype=torch.bfloat16), "extra": {"lr": 0.0}}
dcp.load(loaded, storage_reader=FsspecReader(path, auto_mkdir=True))
print(json.dumps({
    "equal": all(torch.equal(loaded[k], saved[k]) for k in ("w", "step", "h")) and loaded["extra"] == saved["extra"],
    "same": FsspecWriter is fsspec_filesystem.FsspecWriter and FsspecReader is fsspec_filesystem.FsspecReader,
    "subclass": issubclass(FsspecWriter, dcp.FileSystemWriter) and issubclass(FsspecReader, dcp.FileSystemReader),
    "all": sorted(fsspec_filesystem.__all__), "cache": writer.cache_staged_state_dict,
    "valid": [FsspecWriter.validate_checkpoint_id(path), FsspecReader.validate_checkpoint_id(Path(path))],
    "module": FsspecWriter.__module__, "status": torchpatch.status().get("dcp-fsspec-filesystem"),
}))
"""

READ_215 = """
import json, sys, torch
from torch.distributed.checkpoint import FsspecReader, load
loaded = {"w": torch.zeros(4, 3), "step": torch.tensor(0), "h": torch.zeros(5, dtype=torch.bfloat16), "extra": {"lr": 0.0}}
load(loaded, storage_reader=FsspecReader(sys.argv[1]))
torch.manual_seed(0)
saved = {"w": torch.randn(4, 3), "step": torch.tensor(7), "h": torch.randn(5, dtype=torch.bfloat16)}
print(json.dumps(all(torch.equal(loaded[k], saved[k]) for k in saved) and loaded["extra"] == {"lr": 0.5}))
"""


def _check(out: dict) -> None:
    assert out["equal"] and out["same"] and out["subclass"] and out["cache"] is False
    assert out["all"] == ["FsspecReader", "FsspecWriter"] and out["valid"] == [True, False]
    assert out["module"] == "torch.distributed.checkpoint.fsspec_filesystem"


@where_patch_applies("dcp-fsspec-filesystem", "torch 2.15 made the module public")
def test_native_failure():
    proc = run_py("import torch.distributed.checkpoint.fsspec_filesystem")
    assert "ModuleNotFoundError: No module named 'torch.distributed.checkpoint.fsspec_filesystem'" in proc.stderr
    proc = run_py("from torch.distributed.checkpoint import FsspecWriter")
    assert "ImportError: cannot import name 'FsspecWriter'" in proc.stderr


@where_patch_applies("dcp-fsspec-filesystem")
def test_served_round_trip(tmp_path):
    out = run_json(SAVE_LOAD, env=clean_env(TORCHPATCH="1"), args=(str(tmp_path / "ckpt"),))
    _check(out)
    assert out["status"] == "applied"
    assert run_newest_torch_json(READ_215, str(tmp_path / "ckpt")) is True


@where_patch_applies("dcp-fsspec-filesystem")
def test_newer_writer_argument_this_torch_lacks(tmp_path):
    proc = run_py(
        """
        import sys
        from torch.distributed.checkpoint import FsspecWriter
        FsspecWriter(sys.argv[1], _extensions=[object()])
        """,
        env=clean_env(TORCHPATCH="1"), args=(str(tmp_path),),
    )
    if torch_matches("<2.7"):
        assert proc.returncode != 0 and "needs torch >= 2.7" in proc.stderr
    else:
        assert "needs torch" not in proc.stderr


@only_torch(">=2.15", "torch's own fsspec_filesystem: the same results, nothing served")
def test_native_on_215(tmp_path):
    out = run_json(SAVE_LOAD, env=clean_env(TORCHPATCH="1"), args=(str(tmp_path / "ckpt"),))
    _check(out)
    assert out["status"] is None
