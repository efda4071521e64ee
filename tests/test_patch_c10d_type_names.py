"""c10d-type-names: ``torch.distributed.GroupName`` (torch 2.4-2.9, also in ``distributed_c10d``) and
``torch.distributed.RankType`` (torch 2.4-2.10).

From torch 2.4 on with TORCHPATCH=1 (served, torch's own from 2.10 / 2.11, the reference on 2.15):
``GroupName`` is one ``NewType`` of ``str`` named ``GroupName`` of module ``distributed_c10d`` that
returns its argument, and ``RankType`` equals ``int | torch.SymInt``. Natively before the range ends
both are missing.
"""

from conftest import clean_env, run_json, through_patch_range, until_patch_range_ends, where_patch_does_not_apply

SCRIPT = """
import json, typing, torch, torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
out = {"names": [hasattr(dist, "GroupName"), hasattr(c10d, "GroupName"), hasattr(dist, "RankType")]}
if all(out["names"]):
    name = dist.GroupName("7")
    out["group_name"] = [dist.GroupName is c10d.GroupName, dist.GroupName.__name__, dist.GroupName.__module__,
                         dist.GroupName.__supertype__ is str, name == "7" and type(name) is str]
    out["rank_type"] = dist.RankType == typing.Union[int, torch.SymInt]
import torchpatch
out["status"] = torchpatch.status().get("c10d-type-names")
print(json.dumps(out))
"""


@through_patch_range("c10d-type-names", "served, then torch's own (2.15: the reference)")
def test_type_names_as_torch_2_15_defines_them():
    out = run_json(SCRIPT, env=clean_env(TORCHPATCH="1"))
    assert out["group_name"] == [True, "GroupName", "torch.distributed.distributed_c10d", True, True], out
    assert out["rank_type"] is True, out


@until_patch_range_ends("c10d-type-names", since="2.4")
def test_missing_natively_served_with_torchpatch():
    assert run_json(SCRIPT, env=clean_env())["names"][2] is False  # RankType; GroupName from 2.10
    assert run_json(SCRIPT, env=clean_env(TORCHPATCH="1"))["status"] == "applied"


@where_patch_does_not_apply("c10d-type-names")
def test_inactive_where_torch_has_them():
    assert run_json(SCRIPT, env=clean_env(TORCHPATCH="1"))["status"] is None
