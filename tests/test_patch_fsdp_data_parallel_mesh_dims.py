"""fsdp-data-parallel-mesh-dims: the value class ``torch.distributed.fsdp.DataParallelMeshDims``.

One process builds it with one and several names, compares instances, reads ``shard_names`` and
``replicate_names`` and lists its fields, and builds it with neither name. With TORCHPATCH=1 on torch 2.9
the report must equal torch 2.15's native one (run in its venv by the same test); natively 2.9 has no
such class (``ImportError``).
"""

from conftest import clean_env, run_json, run_newest_torch_json, through_patch_range, where_patch_applies

SCRIPT = """
import dataclasses, json
try:
    from torch.distributed.fsdp import DataParallelMeshDims
except ImportError:
    out = {"import": "ImportError"}
else:
    one, many = DataParallelMeshDims(shard="dp_shard"), DataParallelMeshDims(shard=("dp_shard", "cp"), replicate="dp")
    out = {"fields": [(f.name, repr(f.default)) for f in dataclasses.fields(DataParallelMeshDims)],
           "one": [one.shard_names, one.replicate_names, repr(one)],
           "many": [many.shard_names, many.replicate_names, repr(many)],
           "equal": DataParallelMeshDims(shard="dp_shard") == one,
           "module": DataParallelMeshDims.__module__}
    try:
        DataParallelMeshDims()
    except ValueError as exc:
        out["neither"] = str(exc)
print(json.dumps(out))
"""


@where_patch_applies("fsdp-data-parallel-mesh-dims", "no DataParallelMeshDims")
def test_native_lacks_the_class():
    assert run_json(SCRIPT, env=clean_env()) == {"import": "ImportError"}


@through_patch_range("fsdp-data-parallel-mesh-dims", "the value class")
def test_class_as_the_newest_torch():
    assert run_json(SCRIPT, env=clean_env(TORCHPATCH="1")) == run_newest_torch_json(SCRIPT)
