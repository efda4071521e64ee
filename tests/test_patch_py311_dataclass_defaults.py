"""py311-dataclass-defaults: torch 1.13's fsdp / _shard import on Python 3.11, with the
metadata dataclass behaving as torch 2.x's (own TensorProperties per instance), and a sharded
tensor across 2 gloo ranks. (torch 1.13's FSDP itself needs CUDA: its compute device is
``torch.cuda.current_device()``, so on CPU only its config dataclasses are exercised.)"""

import sys

import pytest

from conftest import (
    RESULT, clean_env, rank_result, run_json, run_ranks, torch_matches, where_patch_applies,
    where_patch_does_not_apply
)

pytestmark = pytest.mark.skipif(sys.version_info < (3, 11), reason="Python 3.11's dataclasses reject the default")

FIXED = [
    "torch.distributed._shard.sharded_tensor.metadata",
    "torch.distributed._shard",
    "torch.distributed._shard.sharded_tensor",
    "torch.distributed._shard.sharding_spec",
    "torch.distributed._shard.sharded_optim",
    "torch.distributed.fsdp",
]

IMPORTS = """
import importlib, json
out = {}
for name in %r:
    try:
        importlib.import_module(name)
        out[name] = "ok"
    except ValueError as exc:
        out[name] = str(exc)
print(json.dumps(out))
""" % (FIXED,)

# The dataclass as torch >= 2.0 defines it (field(default_factory=TensorProperties)): compared
# field by field, instance by instance, on the patched 1.13 and on torch's own fixed versions.
SEMANTICS = """
import copy, dataclasses, json, pickle, warnings
process_class = dataclasses._process_class  # before torch: the hook must leave no wrapper behind
dataclass_fn = dataclasses.dataclass
import torch, torchpatch
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties
from torch.distributed._shard.metadata import ShardMetadata

field = {f.name: f for f in dataclasses.fields(ShardedTensorMetadata)}["tensor_properties"]
a, b = ShardedTensorMetadata(), ShardedTensorMetadata()
a.tensor_properties.requires_grad = True  # mutate one instance's default object
c = ShardedTensorMetadata(shards_metadata=[ShardMetadata([0, 0], [2, 3], "rank:0/cpu")], size=torch.Size([2, 3]),
                          tensor_properties=TensorProperties(dtype=torch.float64))
out = {
    "factory_is_class": field.default_factory is TensorProperties,
    "no_default": field.default is dataclasses.MISSING,
    "independent": a.tensor_properties is not b.tensor_properties and b.tensor_properties.requires_grad is False,
    "fresh_default": ShardedTensorMetadata().tensor_properties == TensorProperties(),
    "equality": [ShardedTensorMetadata() == ShardedTensorMetadata(), a == b, copy.deepcopy(c) == c],
    "repr": repr(ShardedTensorMetadata()),
    "pickle": pickle.loads(pickle.dumps(c)) == c,
    "process_class_restored": dataclasses._process_class is process_class,
    "dataclass_untouched": dataclasses.dataclass is dataclass_fn,
    "status": torchpatch.status().get("py311-dataclass-defaults"),
}
# torch 1.13's deprecated package re-runs metadata.py under its old name: fixed there too.
if torch.__version__.startswith("1."):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import torch.distributed._sharded_tensor.metadata as old
    out["old_name"] = [old.ShardedTensorMetadata is not ShardedTensorMetadata,
                       old.ShardedTensorMetadata().tensor_properties == old.TensorProperties()]
from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
mp = MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32)
out["fsdp_configs"] = [CPUOffload(offload_params=True).offload_params, mp.param_dtype == torch.float16,
                       ShardingStrategy.FULL_SHARD.name, BackwardPrefetch.BACKWARD_PRE.name]
print(json.dumps(out))
"""

# torch 2.15's TensorProperties ends with an optional strides field: https://github.com/pytorch/pytorch/pull/194251
# (its description matches 2.15's code; https://github.com/pytorch/pytorch/pull/175011 was a first try).
EXPECTED_REPR = ("ShardedTensorMetadata(shards_metadata=[], size=torch.Size([]), tensor_properties=TensorProperties("
                 "dtype=torch.float32, layout=torch.strided, requires_grad=False, memory_format=torch.contiguous_format, "
                 "pin_memory=False" + (", strides=None" if torch_matches(">=2.15") else "") + "))")

# A sharded tensor over 2 gloo ranks (builds ShardedTensorMetadata / TensorProperties), gathered on
# rank 0 and compared with the same tensor made on one process.
SHARDED = """
import json, torch, torch.distributed as dist
dist.init_process_group("gloo")
from torch.distributed._shard import sharded_tensor
from torch.distributed._shard.sharding_spec import ChunkShardingSpec
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties
rank = dist.get_rank()
full = torch.arange(30, dtype=torch.float32).reshape(6, 5) / 7  # the single-process reference
spec = ChunkShardingSpec(dim=0, placements=["rank:0/cpu", "rank:1/cpu"])
st = sharded_tensor.empty(spec, 6, 5)
shard = st.local_shards()[0]
start = shard.metadata.shard_offsets[0]
shard.tensor.copy_(full[start:start + shard.tensor.shape[0]])
out = torch.zeros(6, 5) if rank == 0 else None
st.gather(dst=0, out=out)
md = st.metadata()
if rank == 0:
    print(RESULT + json.dumps({
        "gathered": torch.equal(out, full), "size": list(md.size),
        "shards": sorted(m.shard_offsets + m.shard_sizes for m in md.shards_metadata),
        "properties": md.tensor_properties == TensorProperties.create_from_tensor(full),
    }))
dist.destroy_process_group()
""".replace("RESULT", repr(RESULT))


@where_patch_applies("py311-dataclass-defaults", "torch 2.0 has the upstream fix")
def test_native_imports_fail():
    out = run_json(IMPORTS)
    message = ("mutable default <class 'torch.distributed._shard.sharded_tensor.metadata.TensorProperties'> "
               "for field tensor_properties is not allowed: use default_factory")
    assert out == {name: message for name in FIXED}


@where_patch_applies("py311-dataclass-defaults", "torch 2.0 has the upstream fix")
def test_imports_and_dataclass_as_upstream():
    assert run_json(IMPORTS, env=clean_env(TORCHPATCH="1")) == {name: "ok" for name in FIXED}
    out = run_json(SEMANTICS, env=clean_env(TORCHPATCH="1"))
    check_semantics(out)
    assert out["status"] == "applied" and out["old_name"] == [True, True]


@where_patch_applies("py311-dataclass-defaults", "torch 2.0 has the upstream fix")
def test_sharded_tensor_on_two_ranks(tmp_path):
    proc = run_ranks(SHARDED, env=clean_env(TORCHPATCH="1"), tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert rank_result(proc) == {"gathered": True, "size": [6, 5], "shards": [[0, 0, 3, 5], [3, 0, 3, 5]],
                                 "properties": True}


@where_patch_does_not_apply("py311-dataclass-defaults", "torch's own default_factory: the reference; nothing hooked")
def test_inactive_where_torch_is_fixed():
    out = run_json(SEMANTICS, env=clean_env(TORCHPATCH="1"))
    check_semantics(out)
    assert out["status"] is None


def check_semantics(out):
    assert out["factory_is_class"] and out["no_default"]
    assert out["independent"] and out["fresh_default"]
    assert out["equality"] == [True, False, True]
    assert out["repr"] == EXPECTED_REPR
    assert out["pickle"]
    assert out["process_class_restored"] and out["dataclass_untouched"]
    assert out["fsdp_configs"] == [True, True, "FULL_SHARD", "BACKWARD_PRE"]
