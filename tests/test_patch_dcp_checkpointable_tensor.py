"""dcp-checkpointable-tensor: ``torch.distributed.checkpoint.protocol.CheckpointableTensor`` on torch
2.4-2.13: plain local tensors carrying ``global_shape``, ``global_offsets``, ``local_offsets`` and
``local_sizes`` are saved and loaded by DCP as shards of a global tensor, as on torch 2.14+.

2 gloo ranks hold shards of two global tensors built in the run: ``a`` (6x4, one row block per rank)
and ``b`` (8 elements, two shards per rank; rank 0's buffer has padding between and after them,
marked -1). They ``dcp.save``, then ``dcp.load`` into buffers of the same layout (the shards equal the
global tensor's slices, the padding is untouched) and into meta tensors held by a ``Stateful`` (DCP
materialises them, keeping the fields); one process then loads full tensors from the checkpoint,
and torch 2.15's own DCP reads the same checkpoint (``run_newest_torch_json``). The save plans and
the errors on invalid fields are compared with torch 2.15's. Everything runs served (TORCHPATCH=1)
where the patch applies and natively on torch >= 2.14.
"""

from conftest import (LEAVE_WITHOUT_TEARDOWN, RESULT, clean_env, only_torch, ranks_result, run_json,
                      run_newest_torch_json, run_py, where_patch_applies)

LAYOUT = """
import torch
GLOBAL_SHAPES = {"a": (6, 4), "b": (8,)}
# per tensor, per rank: the local buffer's shape and its shards (global offset, local offset, size)
SHARDS = {
    "a": {0: ((3, 4), [((0, 0), (0, 0), (3, 4))]), 1: ((3, 4), [((3, 0), (0, 0), (3, 4))])},
    "b": {0: ((6,), [((0,), (0,), (2,)), ((4,), (3,), (2,))]), 1: ((4,), [((2,), (0,), (2,)), ((6,), (2,), (2,))])},
}

def global_tensors():
    torch.manual_seed(0)
    return {"a": torch.randn(6, 4), "b": torch.randn(8)}

def region(offsets, sizes):
    return tuple(slice(o, o + s) for o, s in zip(offsets, sizes))

def with_fields(tensor, name, rank):
    shards = SHARDS[name][rank][1]
    tensor.global_shape = GLOBAL_SHAPES[name]
    tensor.global_offsets = tuple(g for g, _, _ in shards)
    tensor.local_offsets = tuple(l for _, l, _ in shards)
    tensor.local_sizes = tuple(s for _, _, s in shards)
    return tensor

def local_tensor(name, rank, full=None):
    '''Rank's buffer: its shards of ``full`` (zeros without it), -1 in the padding.'''
    shape, shards = SHARDS[name][rank]
    tensor = torch.full(shape, -1.0)
    for g, l, s in shards:
        tensor[region(l, s)] = full[region(g, s)] if full is not None else 0.0
    return with_fields(tensor, name, rank)
"""

RANKS = LAYOUT + """
import datetime, json, os, warnings
warnings.simplefilter("ignore")
import torch.distributed as dist, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.protocol import CheckpointableTensor
from torch.distributed.checkpoint.stateful import Stateful
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
path = os.environ["CKPT"]
full = global_tensors()
saved = {name: local_tensor(name, rank, full[name]) for name in SHARDS}
dcp.save({**saved, "step": torch.tensor(7), "holder": {"a": saved["a"]}}, checkpoint_id=path)

class Holder(Stateful):
    def __init__(self):
        self.loaded = None
    def state_dict(self):
        return {"a": with_fields(torch.empty(SHARDS["a"][rank][0], device="meta"), "a", rank)}
    def load_state_dict(self, state_dict):
        self.loaded = state_dict

holder = Holder()
loaded = {**{name: local_tensor(name, rank) for name in SHARDS}, "step": torch.tensor(0), "holder": holder}
dcp.load(loaded, checkpoint_id=path)
meta = holder.loaded["a"]
flags = {"same_layout": all(torch.equal(loaded[n], saved[n]) for n in SHARDS) and loaded["step"].item() == 7,
         "protocol": all(isinstance(saved[n], CheckpointableTensor) for n in SHARDS),
         "meta": meta.device.type == "cpu" and torch.equal(meta, saved["a"]) and meta.global_offsets == saved["a"].global_offsets}
gathered = [None] * dist.get_world_size()
dist.all_gather_object(gathered, flags)
if rank == 0:
    print(RESULT + json.dumps(gathered), flush=True)
""".replace("RESULT", repr(RESULT)) + LEAVE_WITHOUT_TEARDOWN

FULL = LAYOUT + """
import json, sys, warnings
warnings.simplefilter("ignore")
import torch.distributed.checkpoint as dcp
full = global_tensors()
out = {"a": torch.zeros(6, 4), "b": torch.zeros(8), "step": torch.tensor(0)}
dcp.load(out, checkpoint_id=sys.argv[1])
print(json.dumps(all(torch.equal(out[n], full[n]) for n in SHARDS) and out["step"].item() == 7))
"""

# save plans of rank 1's tensors, and the errors of invalid fields, planning and finding shards
PLANS_AND_ERRORS = LAYOUT + """
import json
from torch.distributed.checkpoint.default_planner import create_default_local_load_plan, create_default_local_save_plan
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.utils import find_tensor_shard

def fields(tensor, global_shape, global_offsets, local_offsets, local_sizes):
    tensor.global_shape, tensor.global_offsets = global_shape, global_offsets
    tensor.local_offsets, tensor.local_sizes = local_offsets, local_sizes
    return tensor

def error(call):
    try:
        call()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None

plan = create_default_local_save_plan({n: local_tensor(n, 1, global_tensors()[n]) for n in SHARDS}, True)
items = [[i.index.fqn, list(i.index.offset), i.index.index, i.type.name, list(i.tensor_data.size),
          list(i.tensor_data.chunk.offsets), list(i.tensor_data.chunk.sizes)] for i in plan.items]
bad = {
    "local_offsets_length": fields(torch.zeros(4), (8,), ((0,), (4,)), ((0,),), ((4,), (4,))),
    "local_sizes_length": fields(torch.zeros(4), (8,), ((0,),), ((0,),), ((2,), (2,))),
    "global_offset_dims": fields(torch.zeros(4), (8,), ((0, 0),), ((0,),), ((4,),)),
    "local_offset_dims": fields(torch.zeros(4), (8,), ((0,),), ((0, 0),), ((4,),)),
    "local_size_dims": fields(torch.zeros(4), (8,), ((0,),), ((0,),), ((4, 1),)),
    "local_size_local_dims": fields(torch.zeros(8), (2, 4), ((0, 0),), ((0,),), ((2, 4),)),
    "outside_global": fields(torch.zeros(4), (8,), ((6,),), ((0,),), ((4,),)),
    "outside_local": fields(torch.zeros(4), (8,), ((0,),), ((2,),), ((4,),)),
}
errors = {k: error(lambda t=t: create_default_local_save_plan({"w": t}, True)) for k, t in bad.items()}
two = fields(torch.zeros(4), (8,), ((0,), (4,)), ((0,), (2,)), ((2,), (2,)))
errors["no_offset"] = error(lambda: find_tensor_shard(two, MetadataIndex("w")))
errors["unknown_offset"] = error(lambda: find_tensor_shard(two, MetadataIndex("w", torch.Size([2]))))
chunk = ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([8]))
md = Metadata(state_dict_metadata={"w": TensorStorageMetadata(
    properties=TensorProperties(dtype=torch.float32), size=torch.Size([8]), chunks=[chunk])})
errors["size_mismatch"] = error(lambda: create_default_local_load_plan(
    {"w": fields(torch.zeros(4), (6,), ((0,),), ((0,),), ((4,),))}, md))
shard = find_tensor_shard(two, MetadataIndex("w", torch.Size([4])))
print(json.dumps({"items": items, "errors": errors, "shard_is_view": shard.data_ptr() == two[2:].data_ptr()}))
"""


def _check_ranks(out: list) -> None:
    assert out == [{"same_layout": True, "protocol": True, "meta": True}] * 2


def _check_full(path: str) -> None:
    assert run_json(FULL, env=clean_env(TORCHPATCH="1"), args=(path,)) is True
    assert run_newest_torch_json(FULL, path) is True


@where_patch_applies("dcp-checkpointable-tensor", "torch 2.14 brought the protocol")
def test_native_failure():
    proc = run_py("import torch.distributed.checkpoint.protocol")
    assert "ModuleNotFoundError: No module named 'torch.distributed.checkpoint.protocol'" in proc.stderr


@where_patch_applies("dcp-checkpointable-tensor")
def test_served_save_load(tmp_path):
    path = str(tmp_path / "ckpt")
    _check_ranks(ranks_result(RANKS, tmp_path=tmp_path, env=clean_env(TORCHPATCH="1", CKPT=path)))
    _check_full(path)


@where_patch_applies("dcp-checkpointable-tensor")
def test_served_plans_and_errors_equal_215():
    served = run_json(PLANS_AND_ERRORS, env=clean_env(TORCHPATCH="1"))
    assert served["shard_is_view"] and None not in served["errors"].values()
    assert served == run_newest_torch_json(PLANS_AND_ERRORS)


@where_patch_applies("dcp-checkpointable-tensor")
def test_served_exports_and_switch_off():
    code = """
import json, torchpatch, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.protocol import CheckpointableTensor
print(json.dumps({"same": dcp.CheckpointableTensor is CheckpointableTensor, "all": dcp.protocol.__all__,
                  "status": torchpatch.status().get("dcp-checkpointable-tensor")}))
"""
    assert run_json(code, env=clean_env(TORCHPATCH="1")) == {
        "same": True, "all": ["CheckpointableTensor"], "status": "applied"}
    proc = run_py("import torch.distributed.checkpoint.protocol",
                  env=clean_env(TORCHPATCH="1", TORCHPATCH_DCP_CHECKPOINTABLE_TENSOR="0"))
    assert "No module named 'torch.distributed.checkpoint.protocol'" in proc.stderr


@only_torch(">=2.14", "torch's own protocol and planner: the same checkpoint and values")
def test_native_save_load(tmp_path):
    path = str(tmp_path / "ckpt")
    _check_ranks(ranks_result(RANKS, tmp_path=tmp_path, env=clean_env(TORCHPATCH="1", CKPT=path)))
    _check_full(path)
    out = run_json("import json, torchpatch, torch.distributed.checkpoint.protocol as p\n"
                   "print(json.dumps([p.__name__, torchpatch.status().get('dcp-checkpointable-tensor')]))",
                   env=clean_env(TORCHPATCH="1"))
    assert out == ["torch.distributed.checkpoint.protocol", None]
