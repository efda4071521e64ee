"""dcp-hf-storage: ``torch.distributed.checkpoint.hf_storage``'s ``HuggingFaceStorageWriter`` and
``HuggingFaceStorageReader`` on torch 2.4-2.7 (2.9+'s API; 2.8's own, older classes are left alone).

Scripts save through the writer and load through the reader, comparing bitwise with the saved
tensors: on one process (two model files by ``fqn_to_index_mapping``) and on 2 gloo ranks (a
``Shard(0)`` DTensor with ``save_distributed`` and ``enable_consolidation``: the consolidated files hold
the full tensors). They run served (TORCHPATCH=1) where the patch applies and natively on torch >= 2.9.
Where the 2.15 matrix venv exists (``~/.cache/torchpatch/nox/matrix-torch-2-15-0``), the files written
by the served writer are also read by 2.15's own ``HuggingFaceStorageReader`` in a subprocess of that
venv (skipped otherwise). Needs the ``safetensors`` package (skipped without it).
"""

import pytest

from conftest import (LEAVE_WITHOUT_TEARDOWN, RESULT, clean_env, only_torch, ranks_result, run_json,
                      run_newest_torch_json, run_py, where_patch_applies)

pytest.importorskip("safetensors")

STATE = """
import torch
def state():
    torch.manual_seed(0)
    return {"embed": torch.randn(6, 4), "norm": torch.randn(4, dtype=torch.bfloat16), "step": torch.arange(3)}
"""

ONE_PROCESS = STATE + """
import json, os, sys, warnings, torchpatch
warnings.simplefilter("ignore")
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
path = sys.argv[1]
saved = state()
dcp.save(saved, storage_writer=HuggingFaceStorageWriter(path, fqn_to_index_mapping={"embed": 1, "norm": 2, "step": 2}))
loaded = {k: torch.zeros_like(v) for k, v in saved.items()}
dcp.load(loaded, storage_reader=HuggingFaceStorageReader(path, thread_count=2))
with open(os.path.join(path, "model.safetensors.index.json")) as f:
    index = json.load(f)
print(json.dumps({"equal": all(torch.equal(loaded[k], saved[k]) for k in saved), "index": index,
                  "files": sorted(os.listdir(path)), "module": HuggingFaceStorageWriter.__module__,
                  "status": torchpatch.status().get("dcp-hf-storage")}))
"""

READ_215 = STATE + """
import json, sys, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader
saved = state()
loaded = {k: torch.zeros_like(v) for k, v in saved.items()}
dcp.load(loaded, storage_reader=HuggingFaceStorageReader(sys.argv[1]), no_dist=True)
print(json.dumps(all(torch.equal(loaded[k], saved[k]) for k in saved)))
"""

RANKS = STATE + """
import datetime, json, os, sys, warnings
warnings.simplefilter("ignore")
import torch.distributed as dist, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
try:
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh
except ImportError:  # torch 2.4 without TORCHPATCH
    from torch.distributed._tensor import Shard, distribute_tensor, init_device_mesh
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
path = os.environ["CKPT"]
full = {k: v for k, v in state().items() if k != "step"}  # 2.15's consolidation takes floating tensors only
sharded = {"embed": distribute_tensor(full["embed"], mesh, [Shard(0)]), "norm": full["norm"]}
dcp.save(sharded, storage_writer=HuggingFaceStorageWriter(path, save_distributed=True, enable_consolidation=True))
loaded = {"embed": distribute_tensor(torch.zeros(6, 4), mesh, [Shard(0)]), "norm": torch.zeros(4, dtype=torch.bfloat16)}
dcp.load(loaded, storage_reader=HuggingFaceStorageReader(path))
local_equal = torch.equal(loaded["embed"].to_local(), sharded["embed"].to_local()) and all(
    torch.equal(loaded[k], full[k]) for k in ("norm",))
flags = [None] * dist.get_world_size()
dist.all_gather_object(flags, local_equal)
if rank == 0:
    from safetensors.torch import load_file
    consolidated = load_file(os.path.join(path, "model-00001-of-00001.safetensors"))
    print(RESULT + json.dumps({"loaded": all(flags), "consolidated": sorted(consolidated) == sorted(full) and all(
        torch.equal(consolidated[k], full[k]) for k in full),
        "shards": sorted(os.listdir(os.path.join(path, "sharded")))}), flush=True)
""".replace("RESULT", repr(RESULT)) + LEAVE_WITHOUT_TEARDOWN

INDEX_KEYS = {"embed": "model-00001-of-00002.safetensors", "norm": "model-00002-of-00002.safetensors",
              "step": "model-00002-of-00002.safetensors"}


def _check_one_process(out: dict) -> None:
    assert out["equal"] and out["module"] == "torch.distributed.checkpoint.hf_storage"
    assert out["files"] == sorted(set(INDEX_KEYS.values())) + ["model.safetensors.index.json"]
    assert out["index"]["weight_map"] == INDEX_KEYS
    assert out["index"]["metadata"]["total_size"] == 6 * 4 * 4 + 4 * 2 + 3 * 8


def _check_ranks(out: dict) -> None:
    assert out == {"loaded": True, "consolidated": True, "shards": [
        "shard-00001-model-00001-of-00001.safetensors", "shard-00002-model-00001-of-00001.safetensors"]}


@where_patch_applies("dcp-hf-storage", "torch 2.8 brought hf_storage")
def test_native_failure():
    proc = run_py("import torch.distributed.checkpoint.hf_storage")
    assert "ModuleNotFoundError: No module named 'torch.distributed.checkpoint.hf_storage'" in proc.stderr


@where_patch_applies("dcp-hf-storage")
def test_served_one_process(tmp_path):
    out = run_json(ONE_PROCESS, env=clean_env(TORCHPATCH="1"), args=(str(tmp_path / "hf"),))
    _check_one_process(out)
    assert out["status"] == "applied"
    assert run_newest_torch_json(READ_215, str(tmp_path / "hf")) is True


@where_patch_applies("dcp-hf-storage")
def test_served_distributed_consolidated(tmp_path):
    _check_ranks(ranks_result(RANKS, tmp_path=tmp_path, env=clean_env(TORCHPATCH="1", CKPT=str(tmp_path / "hf"))))


@only_torch(">=2.9", "torch's own hf_storage with the same API: the same files and results")
def test_native_one_process(tmp_path):
    out = run_json(ONE_PROCESS, env=clean_env(TORCHPATCH="1"), args=(str(tmp_path / "hf"),))
    _check_one_process(out)
    assert out["status"] is None


@only_torch(">=2.9", "torch's own hf_storage with the same API")
def test_native_distributed_consolidated(tmp_path):
    _check_ranks(ranks_result(RANKS, tmp_path=tmp_path, env=clean_env(TORCHPATCH="1", CKPT=str(tmp_path / "hf"))))
