"""c10d-backend-queries: ``get_backend_impl`` (torch 2.4-2.13), ``get_default_backend_for_device`` and
``is_xccl_available`` (torch 2.4-2.5) in ``torch.distributed`` and ``distributed_c10d``.

One gloo process: from torch 2.4 on with TORCHPATCH=1 (served, torch's own from 2.6 / 2.14, the
reference on 2.15) ``get_backend_impl`` returns the group's own CPU backend object for the default
group, a ``new_group``, the group's name and an explicit device; ``get_default_backend_for_device``
reads ``Backend.default_device_backend_map`` (and raises 2.15's ValueError for a device without
one); ``is_xccl_available`` says whether ``ProcessGroupXCCL`` is built in. Natively before the range
ends ``get_backend_impl`` is missing.
"""

from conftest import clean_env, run_json, through_patch_range, until_patch_range_ends, where_patch_does_not_apply

NAMES = ("get_backend_impl", "get_default_backend_for_device", "is_xccl_available")

SCRIPT = """
import json, torch, torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
sub = dist.new_group([0])
cpu = torch.device("cpu")
out = {"same": [getattr(dist, n) is getattr(c10d, n) for n in NAMES]}
out["impl"] = [
    dist.get_backend_impl() is dist.group.WORLD._get_backend(cpu),
    dist.get_backend_impl(sub) is sub._get_backend(cpu),
    dist.get_backend_impl(sub.group_name) is sub._get_backend(cpu),
    dist.get_backend_impl(device=cpu) is dist.group.WORLD._get_backend(cpu),
    type(dist.get_backend_impl()).__name__,
]
out["default"] = [dist.get_default_backend_for_device(d) == c10d.Backend.default_device_backend_map[torch.device(d).type]
                  for d in ("cpu", torch.device("cpu"), "cuda:1", torch.device("cuda"))]
out["default_of"] = {d: dist.get_default_backend_for_device(d) for d in ("cpu", "cuda")}
try:
    dist.get_default_backend_for_device("meta")
except ValueError as exc:
    out["meta"] = str(exc)
out["xccl"] = dist.is_xccl_available() == hasattr(torch._C._distributed_c10d, "ProcessGroupXCCL")
import torchpatch
out["status"] = torchpatch.status().get("c10d-backend-queries")
print(json.dumps(out))
""".replace("NAMES", repr(NAMES))


@through_patch_range("c10d-backend-queries", "served, then torch's own (2.15: the reference)")
def test_served_as_torch_2_15_computes_them():
    out = run_json(SCRIPT, env=clean_env(TORCHPATCH="1"))
    assert out["same"] == [True] * 3 and out["impl"] == [True] * 4 + ["ProcessGroupGloo"], out
    assert out["default"] == [True] * 4 and out["default_of"] == {"cpu": "gloo", "cuda": "nccl"}, out
    assert out["meta"] == "Default backend not registered for device : meta" and out["xccl"] is True, out


PROBE = """
import json, torch.distributed as dist
import torchpatch
print(json.dumps({"names": [hasattr(dist, n) for n in NAMES], "status": torchpatch.status().get("c10d-backend-queries")}))
""".replace("NAMES", repr(NAMES))


@until_patch_range_ends("c10d-backend-queries", since="2.4")
def test_missing_natively():
    assert run_json(PROBE, env=clean_env())["names"][0] is False  # get_backend_impl; the others from 2.6
    assert run_json(PROBE, env=clean_env(TORCHPATCH="1")) == {"names": [True] * 3, "status": "applied"}


@where_patch_does_not_apply("c10d-backend-queries")
def test_inactive_where_torch_has_them():
    assert run_json(PROBE, env=clean_env(TORCHPATCH="1"))["status"] is None
