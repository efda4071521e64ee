"""dcp-consolidate-hf-safetensors: ``torch.distributed.checkpoint._consolidate_hf_safetensors`` on torch 2.4
(2.9 brought it). One process saves a state with ``HuggingFaceStorageWriter(save_distributed=True)``
(shard files), then ``consolidate_safetensors_files`` and ``consolidate_safetensors_files_on_every_rank``
(one process: every file, and no index, as 2.15) each write model files by ``fqn_to_index_mapping`` into
their own folder: the files read back with ``safetensors`` hold the saved tensors bitwise, and the first's
index lists them. Served on
2.4 and natively from 2.9 (the same script); natively on 2.4 the module is missing. Needs ``safetensors``."""

import pytest

from conftest import clean_env, run_json, run_py, through_patch_range, where_patch_applies

pytest.importorskip("safetensors")

SCRIPT = """
import json, os, sys, warnings
warnings.simplefilter("ignore")
import torch, torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.checkpoint._consolidate_hf_safetensors import (
    consolidate_safetensors_files, consolidate_safetensors_files_on_every_rank)
root = sys.argv[1]
torch.manual_seed(0)
saved = {"embed": torch.randn(6, 4), "norm": torch.randn(4), "out": torch.randn(3, 4)}
mapping = {"embed": 1, "norm": 2, "out": 2}
shards = os.path.join(root, "shards")
dcp.save(saved, storage_writer=HuggingFaceStorageWriter(shards, save_distributed=True, fqn_to_index_mapping=mapping))  # no process group: one process
out = {}
for name, consolidate in (("files", consolidate_safetensors_files), ("every_rank", consolidate_safetensors_files_on_every_rank)):
    target = os.path.join(root, name)
    os.makedirs(target)
    consolidate(shards, target, mapping)
    index_file = os.path.join(target, "model.safetensors.index.json")
    index = json.load(open(index_file)) if os.path.exists(index_file) else None
    loaded = {file: load_file(os.path.join(target, file)) for file in sorted(os.listdir(target)) if file.endswith(".safetensors")}
    every = {k: t for tensors in loaded.values() for k, t in tensors.items()}
    out[name] = {"equal": sorted(every) == sorted(saved) and all(torch.equal(every[k], saved[k]) for k in saved),
                 "files": {k: file for file, tensors in loaded.items() for k in tensors}, "index": index}
print(json.dumps(out))
"""


@where_patch_applies("dcp-consolidate-hf-safetensors", "torch 2.9 brought the module")
def test_native_module_missing():
    proc = run_py("import torch.distributed.checkpoint._consolidate_hf_safetensors\n", env=clean_env())
    assert "No module named 'torch.distributed.checkpoint._consolidate_hf_safetensors'" in proc.stderr, proc.stderr[-2000:]


@through_patch_range("dcp-consolidate-hf-safetensors", "torch's own from 2.9")
def test_consolidated_files_hold_the_saved_tensors(tmp_path):
    out = run_json(SCRIPT, args=[str(tmp_path)], env=clean_env(TORCHPATCH="1"))
    files = {"embed": "model-00001-of-00002.safetensors", "norm": "model-00002-of-00002.safetensors",
             "out": "model-00002-of-00002.safetensors"}
    index = {"metadata": {"total_size": (24 + 4 + 12) * 4}, "weight_map": files}
    assert out["files"] == {"equal": True, "files": files, "index": index}, out["files"]
    # without a process group 2.15 writes every file and no index (rank 0 of a group writes it)
    assert out["every_rank"] == {"equal": True, "files": files, "index": None}, out["every_rank"]
