"""dtensor-strided-shard-pointwise: pointwise ops on a ``_StridedShard`` DTensor, on 2 real ranks (gloo,
CPU mesh of 2).

A DTensor placed ``_StridedShard(0, split_factor=2)`` (what FSDP2 labels a parameter that TP shards on
the same dim, here on a 1-D mesh: rank r holds rows chunks r and r + 2 of 4) gets a replicated tensor
copied in (``copy_``: ``nn.Module.load_state_dict`` of a gathered value), added, and is multiplied by 2;
each result is compared with the same computed on the full tensor (every rank holds it). On torch 2.9.0
natively (and with the patch switched off) ``copy_`` and the addition use the rows of a ``Shard(0)``
chunk and ``dt * 2`` is labelled ``Shard(0)``; with TORCHPATCH=1 they are right, as natively on torch
2.13+, and a copy into an uneven ``_StridedShard`` (6 rows in 4 pieces) raises the patch's
``NotImplementedError`` (this patch's, or dtensor-strided-shard-uneven's in the split before it: torch 2.9
splits uneven strided shards in another order than FSDP2 stores them).
"""

import pytest

from conftest import (
    DTENSOR_RANK_SETUP, LEAVE_WITHOUT_TEARDOWN, RESULT, clean_env, only_torch, patch_applies_here,
    ranks_result, through_patch_range
)

SCRIPT = DTENSOR_RANK_SETUP + """
from torch.distributed.tensor.placement_types import _StridedShard
SS = [_StridedShard(0, split_factor=2)]

def strided(rows, local):
    return DTensor.from_local(local, mesh, SS, run_check=False, shape=torch.Size([rows, 2]), stride=(2, 1))

def expected(full):
    chunks = full.chunk(4)  # even: rank r holds chunks r and r + 2
    return torch.cat([chunks[rank], chunks[rank + 2]])

def outcome(got, want):
    return "ok" if got.shape == want.shape and torch.equal(got, want) else f"wrong: {got.tolist()} != {want.tolist()}"

full = torch.arange(16, dtype=torch.float64).reshape(8, 2)
rep = DTensor.from_local(full, mesh, [Replicate()], run_check=False)
out = {}
with torch.no_grad():
    dt = strided(8, torch.zeros(4, 2, dtype=torch.float64))
    dt.copy_(rep)
    out["copy_"] = outcome(dt._local_tensor, expected(full))
    dt = strided(8, expected(full).clone())
    out["strided+replicated"] = outcome((dt + rep)._local_tensor, expected(full) * 2)
    doubled = dt * 2
    out["strided*2 full_tensor"] = outcome(doubled.full_tensor(), full * 2)
    out["strided*2 placement"] = type(doubled.placements[0]).__name__
    uneven = DTensor.from_local(torch.arange(12, dtype=torch.float64).reshape(6, 2), mesh, [Replicate()], run_check=False)
    try:
        want = uneven.redistribute(mesh, SS)._local_tensor  # this torch's own split
        target = strided(6, torch.zeros_like(want))
        target.copy_(uneven)
        out["uneven copy_"] = outcome(target._local_tensor, want)
    except NotImplementedError as exc:
        out["uneven copy_"] = "refused" if "uneven shards in another order than FSDP2" in str(exc) else str(exc)
    except RuntimeError as exc:
        out["uneven copy_"] = "error"
import torchpatch
out["status"] = torchpatch.status().get("dtensor-strided-shard-pointwise")
gathered = [None] * world
dist.all_gather_object(gathered, out)
if rank == 0:
    print(RESULT + json.dumps(gathered), flush=True)
""".replace("RESULT", repr(RESULT)) + LEAVE_WITHOUT_TEARDOWN

RIGHT = {"copy_": "ok", "strided+replicated": "ok", "strided*2 full_tensor": "ok",
         "strided*2 placement": "_StridedShard"}


def _run(tmp_path, **env) -> list:
    return ranks_result(SCRIPT, tmp_path=tmp_path, env=clean_env(**env), timeout=180)


@only_torch(">=2.9,<2.12", "torch 2.9.0 maps _StridedShard to Shard in its pointwise strategy")
@pytest.mark.parametrize("env", [{}, {"TORCHPATCH": "1", "TORCHPATCH_DTENSOR_STRIDED_SHARD_POINTWISE": "0"}],
                         ids=["unset", "opted-out"])
def test_native_pointwise_ops_use_shard_rows(tmp_path, env):
    for out in _run(tmp_path, **env):
        assert out.pop("status") is None
        assert out.pop("strided*2 placement") == "Shard", out
        out.pop("uneven copy_")
        # the ranks' rows [0:2]+[4:6] and [2:4]+[6:8] as Shard(0)'s [0:4] and [4:8]: wrong on both ranks
        assert all(v.startswith("wrong") for v in out.values()), out


@through_patch_range("dtensor-strided-shard-pointwise", "DTensor's pointwise strategy as the patch knows it", since="2.9")
def test_pointwise_ops_keep_the_strided_shard(tmp_path):
    for out in _run(tmp_path, TORCHPATCH="1"):
        assert out.pop("status") == ("applied" if patch_applies_here("dtensor-strided-shard-pointwise") else None)
        uneven = out.pop("uneven copy_")
        assert uneven == ("refused" if patch_applies_here("dtensor-strided-shard-pointwise") else "ok"), uneven
        assert out == RIGHT, out
