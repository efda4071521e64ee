"""dtensor-strided-shard-uneven: gathering an FSDP+TP parameter whose rows do not divide by the ranks.

On 4 real ranks (gloo, a (dp 2, tp 2) CPU mesh), float64: a Linear of 10 rows (uneven: 10 rows in 4
shards) and one of 12 (even), TP-sharded column-wise and then fully_shard over dp, as torch's own
FSDP2 + TP does (placements ``(_StridedShard(0, sf=2), Shard(0))``). Its ``full_tensor()``, its
redistribution to ``(Replicate(), Replicate())`` and ``distribute_tensor`` of the full weight with its
placements (each rank splitting its copy: 2.13-2.15's scatter of an uneven ``_StridedShard`` raises an
``AssertionError``) are compared with the weight before sharding (every rank holds it) and with the local shard
FSDP2 stores. Torch 2.9.0 natively gets the uneven ones wrong, silently; with TORCHPATCH=1 they raise
the patch's ``NotImplementedError``, the even ones stay right; torch 2.13+ gets them right natively.
"""

import pytest

from conftest import (
    LEAVE_WITHOUT_TEARDOWN, RESULT, clean_env, patch_applies_here, ranks_result, through_patch_range,
    where_patch_applies
)

ID = "dtensor-strided-shard-uneven"

SCRIPT = """
import datetime, json, torch, torch.distributed as dist, torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
torch.set_default_dtype(torch.float64)
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
out = {}


def outcome(compute, want):
    try:
        got = compute()
    except NotImplementedError as exc:
        return "refused" if "uneven shards in another order than FSDP2" in str(exc) else str(exc)
    return "right" if got.shape == want.shape and torch.equal(got, want) else "wrong"


for rows in (10, 12):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, rows))
    full = model[0].weight.detach().clone()
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    weight = model[0].weight
    out[f"{rows}/placements"] = [type(p).__name__ for p in weight.placements]
    with torch.no_grad():
        out[f"{rows}/full_tensor"] = outcome(weight.full_tensor, full)
        out[f"{rows}/redistribute"] = outcome(
            lambda: weight.redistribute(mesh, [Replicate(), Replicate()]).to_local(), full)
        out[f"{rows}/distribute_tensor"] = outcome(
            lambda: distribute_tensor(full, mesh, weight.placements, src_data_rank=None).to_local(), weight.to_local())
import torchpatch
out["status"] = torchpatch.status().get(ID)
gathered = [None] * dist.get_world_size()
dist.all_gather_object(gathered, out)
if dist.get_rank() == 0:
    print(RESULT + json.dumps(gathered), flush=True)
""".replace("RESULT", repr(RESULT)).replace("ID", repr(ID)) + LEAVE_WITHOUT_TEARDOWN

EVEN = {"12/placements": ["_StridedShard", "Shard"], "12/full_tensor": "right", "12/redistribute": "right",
        "12/distribute_tensor": "right"}


def _run(tmp_path, **env) -> list:
    return ranks_result(SCRIPT, nproc=4, tmp_path=tmp_path, env=clean_env(**env), timeout=240)


@where_patch_applies(ID, "torch 2.9.0 splits uneven _StridedShard rows in another order than FSDP2 stores them")
@pytest.mark.parametrize("env", [{}, {"TORCHPATCH": "1", "TORCHPATCH_DTENSOR_STRIDED_SHARD_UNEVEN": "0"}],
                         ids=["unset", "opted-out"])
def test_native_uneven_gather_is_wrong(tmp_path, env):
    outs = _run(tmp_path, **env)
    for out in outs:
        assert out.pop("status") is None
        assert out.pop("10/placements") == ["_StridedShard", "Shard"], out
        assert {k: v for k, v in out.items() if k.startswith("12/")} == EVEN, out
    # full_tensor() and the redistribution give every rank the same wrong rows; distribute_tensor puts other
    # rows than FSDP2 stores on the ranks of tp 1
    assert {out["10/full_tensor"] for out in outs} == {out["10/redistribute"] for out in outs} == {"wrong"}, outs
    assert "wrong" in {out["10/distribute_tensor"] for out in outs}, outs


@through_patch_range(ID, since="2.9")
def test_uneven_gather_refused_where_torch_gets_it_wrong(tmp_path):
    applies = patch_applies_here(ID)
    for out in _run(tmp_path, TORCHPATCH="1"):
        assert out.pop("status") == ("applied" if applies else None)
        assert out == {**EVEN, "10/placements": ["_StridedShard", "Shard"],
                       **{f"10/{k}": "refused" if applies else "right"
                          for k in ("full_tensor", "redistribute", "distribute_tensor")}}, out
