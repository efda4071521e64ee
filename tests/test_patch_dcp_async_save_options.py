"""dcp-async-save-options: ``dcp.async_save``'s 2.9+ arguments and ``AsyncCheckpointerType`` /
``AsyncSaveResponse`` on torch 2.4-2.8.

One script, in a 1-rank gloo group, async-saves a state dict (a) with an asynchronous
``DefaultStager`` and ``AsyncCheckpointerType.PROCESS`` (an ``AsyncSaveResponse`` whose futures
complete, the upload's with the checkpoint's ``Metadata``), (b) with a synchronous stager and
``no_dist=True`` (a ``Future``), (c) with ``PROCESS`` alone (a ``Future``); updates the tensors in
place after each call; loads each checkpoint back and compares bitwise with the state at the call.
It runs served (TORCHPATCH=1) where the patch applies and natively on torch >= 2.9 (whose ``PROCESS``
checkpoints in a spawned process).
"""

from conftest import clean_env, only_torch, run_json, run_py, where_patch_applies

USE = """
import json, os, sys, tempfile, warnings, torch, torch.distributed as dist, torchpatch
warnings.simplefilter("ignore")
import torch.distributed.checkpoint as dcp
from concurrent.futures import Future
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse
root = sys.argv[1]
os.environ["MASTER_ADDR"] = "127.0.0.1"
dist.init_process_group("gloo", init_method="file://" + os.path.join(root, "store"), rank=0, world_size=1)
torch.manual_seed(0)
state = {"w": torch.randn(4, 3), "b": torch.randn(3, dtype=torch.bfloat16), "step": torch.tensor(5)}
out = {}
def bump():
    with torch.no_grad():
        for v in state.values():
            v.add_(1)
def restored(path, snapshot):
    loaded = {k: torch.zeros_like(v) for k, v in snapshot.items()}
    dcp.load(loaded, checkpoint_id=path)
    return all(torch.equal(loaded[k], snapshot[k]) for k in snapshot)
stager = DefaultStager(StagingOptions(False, False, True, False))
snap = {k: v.clone() for k, v in state.items()}
response = dcp.async_save(state, checkpoint_id=os.path.join(root, "a"), async_stager=stager,
                          async_checkpointer_type=AsyncCheckpointerType.PROCESS)
response.staging_completion.result(timeout=120)
bump()
metadata = response.upload_completion.result(timeout=120)
out["a"] = [type(response).__name__, isinstance(response, AsyncSaveResponse), type(metadata).__name__,
            restored(os.path.join(root, "a"), snap)]
stager.close()
snap = {k: v.clone() for k, v in state.items()}
future = dcp.async_save(state, checkpoint_id=os.path.join(root, "b"), no_dist=True,
                        async_stager=DefaultStager(StagingOptions(False, False, False, False)))
bump()
out["b"] = [isinstance(future, Future), type(future.result(timeout=120)).__name__, restored(os.path.join(root, "b"), snap)]
snap = {k: v.clone() for k, v in state.items()}
future = dcp.async_save(state, checkpoint_id=os.path.join(root, "c"), async_checkpointer_type=AsyncCheckpointerType.PROCESS)
bump()
out["c"] = [isinstance(future, Future), type(future.result(timeout=120)).__name__, restored(os.path.join(root, "c"), snap)]
out["kinds"] = [AsyncCheckpointerType.THREAD.value, AsyncCheckpointerType.PROCESS.value]
out["status"] = torchpatch.status().get("dcp-async-save-options")
print(json.dumps(out), flush=True)
os._exit(0)
"""


def _check(out: dict) -> None:
    assert out["a"] == ["AsyncSaveResponse", True, "Metadata", True]
    assert out["b"] == [True, "Metadata", True] and out["c"] == [True, "Metadata", True]
    assert out["kinds"] == ["thread", "process"]


@where_patch_applies("dcp-async-save-options", "torch 2.9 added AsyncSaveResponse and async_stager")
def test_native_failure():
    proc = run_py("from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse")
    assert "ImportError: cannot import name 'AsyncSaveResponse'" in proc.stderr
    proc = run_py("import torch.distributed.checkpoint as dcp; dcp.async_save({}, checkpoint_id='x', async_stager=None)")
    assert "TypeError" in proc.stderr and "async_stager" in proc.stderr


@where_patch_applies("dcp-async-save-options")
def test_served(tmp_path):
    out = run_json(USE, env=clean_env(TORCHPATCH="1"), args=(str(tmp_path),), timeout=300)
    _check(out)
    assert out["status"] == "applied"


@where_patch_applies("dcp-async-save-options")
def test_use_collectives_false_needs_29(tmp_path):
    proc = run_py(
        """
        import sys, torch, torch.distributed.checkpoint as dcp
        dcp.async_save({"w": torch.zeros(2)}, checkpoint_id=sys.argv[1], use_collectives=False)
        """,
        env=clean_env(TORCHPATCH="1"), args=(str(tmp_path / "c"),),
    )
    assert proc.returncode != 0 and "use_collectives=False) needs torch >= 2.9" in proc.stderr


@only_torch(">=2.9", "torch's own async_save: the same results, nothing served")
def test_native(tmp_path):
    out = run_json(USE, env=clean_env(TORCHPATCH="1"), args=(str(tmp_path),), timeout=300)
    _check(out)
    assert out["status"] is None
