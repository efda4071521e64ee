"""dtensor-reduction-strategy: DTensor reductions over Partial inputs, unevenly sharded means,
``all()`` and ``max(dim)`` indices over sharded dimensions, on 2 real ranks (gloo, CPU mesh).

Every rank computes each reduction on DTensors and the same reduction on the plain global tensor
(every rank knows every rank's input): the reference is computed in the same run, in one process.
On torch 2.4.1 and 2.9.0 natively (and with the patch switched off) the DTensor results are wrong,
on 2.13.0 the sum of a ``_NormPartial``; with TORCHPATCH=1 they equal the reference. On torch 2.14
and later torch is right by itself and the patch is not applied.
"""

import pytest

from conftest import (
    DTENSOR_RANK_SETUP, LEAVE_WITHOUT_TEARDOWN, RESULT, clean_env, only_torch, patch_applies_here,
    ranks_result, through_patch_range, torch_matches
)

SCRIPT = DTENSOR_RANK_SETUP + """
def summand(r):  # what rank r holds of a Partial("sum") tensor: every rank can compute every rank's
    base = torch.tensor([[1.0, -3.0, 2.0], [2.5, 0.5, -4.0]], dtype=torch.float64)
    return (base if r % 2 == 0 else base.flip(1)) * (r + 1) - 2 * r

def partial():
    return DTensor.from_local(summand(rank), mesh, [Partial()])

total = sum(summand(r) for r in range(world))  # the global value of partial()
B = torch.tensor([[3.0, -1.0, 7.0, 2.0, -5.0, 4.0], [0.5, 9.0, -2.0, 8.0, 1.0, -6.0],
                  [2.0, 2.5, -7.5, 3.0, 6.0, 0.0]], dtype=torch.float64)  # 3 rows: uneven on 2 ranks
mask = B > -3.0  # row 0 is all True in rank 0's columns, not in rank 1's

def full(x):
    return x.full_tensor() if isinstance(x, DTensor) else x

cases = {  # name: (DTensor computation, the same on the global tensor, tolerance)
    "norm_of_partial": (lambda: partial().norm(), lambda: total.norm()),
    "vector_norm_of_partial_dim": (lambda: torch.linalg.vector_norm(partial(), 2, dim=1), lambda: torch.linalg.vector_norm(total, 2, dim=1)),
    "max_of_partial": (lambda: partial().max(), lambda: total.max()),
    "amax_of_partial": (lambda: partial().amax(1), lambda: total.amax(1)),
    "sum_of_norm_partial": (lambda: torch.linalg.vector_norm(distribute_tensor(B, mesh, [Shard(1)]), 2, dim=1).sum(),
                            lambda: torch.linalg.vector_norm(B, 2, dim=1).sum()),
    "mean_uneven": (lambda: distribute_tensor(B, mesh, [Shard(0)]).mean(), lambda: B.mean()),
    "mean_uneven_keepdim": (lambda: distribute_tensor(B, mesh, [Shard(0)]).mean(0, keepdim=True), lambda: B.mean(0, keepdim=True)),
    "all_sharded_dim": (lambda: distribute_tensor(mask, mesh, [Shard(1)]).all(1), lambda: mask.all(1)),
    "all": (lambda: distribute_tensor(B > -7.0, mesh, [Shard(0)]).all(), lambda: (B > -7.0).all()),  # rank 0's rows all True
    "max_dim_indices": (lambda: distribute_tensor(B, mesh, [Shard(1)]).max(1).indices, lambda: B.max(1).indices),
    "min_dim_indices": (lambda: distribute_tensor(B, mesh, [Shard(1)]).min(dim=1, keepdim=True).indices, lambda: B.min(1, keepdim=True).indices),
    # reductions that were right already stay right
    "sum_of_partial": (lambda: partial().sum(), lambda: total.sum()),
    "mean_even": (lambda: distribute_tensor(B, mesh, [Shard(1)]).mean(1), lambda: B.mean(1)),
    "norm_sharded": (lambda: distribute_tensor(B, mesh, [Shard(1)]).norm(), lambda: B.norm()),
    "max_dim_values": (lambda: distribute_tensor(B, mesh, [Shard(1)]).max(1).values, lambda: B.max(1).values),
    "any_sharded_dim": (lambda: distribute_tensor(mask, mesh, [Shard(1)]).any(1), lambda: mask.any(1)),
}
out = {}
for name, (dtensor_fn, reference_fn) in cases.items():
    try:
        got, ref = full(dtensor_fn()), reference_fn()
    except Exception as exc:  # torch 2.4 without torchpatch: gloo has no AVG for mean's Partial("avg")
        out[name] = "error: " + type(exc).__name__
        continue
    if got.dtype.is_floating_point:
        # a norm of a gathered Partial (or of partial norms) sums in another order than the global one:
        # a relative 1e-12 in float64 is rounding; the wrong results are off by whole units
        same = got.shape == ref.shape and torch.allclose(got, ref, rtol=1e-12, atol=0.0)
    else:
        same = torch.equal(got, ref)
    out[name] = "ok" if same else f"wrong: {got.tolist()} != {ref.tolist()}"
import torchpatch
out["status"] = torchpatch.status().get("dtensor-reduction-strategy")
if rank == 0:
    print(RESULT + json.dumps(out), flush=True)
""".replace("RESULT", repr(RESULT)) + LEAVE_WITHOUT_TEARDOWN

FIXED = ("norm_of_partial", "vector_norm_of_partial_dim", "max_of_partial", "amax_of_partial", "sum_of_norm_partial", "mean_uneven",
         "mean_uneven_keepdim", "all_sharded_dim", "all", "max_dim_indices", "min_dim_indices")
ALREADY_RIGHT = ("sum_of_partial", "mean_even", "norm_sharded", "max_dim_values", "any_sharded_dim")


def _run(tmp_path, **env) -> dict:
    return ranks_result(SCRIPT, tmp_path=tmp_path, env=clean_env(**env), timeout=240)


@only_torch(">=2.4,<2.14", "torch 2.4.1 and 2.9.0 have every one of these bugs, 2.13.0 the sum of a _NormPartial")
@pytest.mark.parametrize("env", [{}, {"TORCHPATCH": "1", "TORCHPATCH_DTENSOR_REDUCTION_STRATEGY": "0"}], ids=["unset", "opted-out"])
def test_native_results_are_wrong(tmp_path, env):
    out = _run(tmp_path, **env)
    assert out.pop("status") is None
    old, unset = torch_matches("<2.5"), not env
    if torch_matches(">=2.13"):  # the rest was fixed upstream before 2.13
        assert out.pop("sum_of_norm_partial").startswith("wrong"), out
        assert out == {name: "ok" for name in FIXED + ALREADY_RIGHT if name != "sum_of_norm_partial"}, out
        return
    for name in ALREADY_RIGHT:
        if old and unset and name in ("mean_even", "any_sharded_dim"):
            # torch 2.4 alone: gloo has no AVG (gloo-avg fixes that), any() has no strategy (dtensor-op-fallback)
            assert out[name].startswith("error"), (name, out)
        else:
            assert out[name] == "ok", (name, out)
    for name in FIXED:
        if old and name == "amax_of_partial":
            # 2.4 has no amax strategy: it raises alone, and torchpatch's dtensor-op-fallback gathers (right)
            assert out[name] == ("error: NotImplementedError" if unset else "ok"), (name, out)
        elif old and unset and name.startswith("mean_uneven"):
            # 2.4's gloo has no AVG: the mean raises natively (gloo-avg lets it run, wrong, with TORCHPATCH=1)
            assert out[name] == "error: RuntimeError", (name, out)
        else:
            assert out[name].startswith("wrong"), (name, out)


@through_patch_range("dtensor-reduction-strategy", "DTensor's reduction strategies as the patch knows them", since="2.4")
def test_reductions_equal_the_global_ones(tmp_path):
    out = _run(tmp_path, TORCHPATCH="1")
    status = out.pop("status")
    assert status == ("applied" if patch_applies_here("dtensor-reduction-strategy") else None)
    assert out == {name: "ok" for name in FIXED + ALREADY_RIGHT}, out


@only_torch(">=2.14", "torch with the upstream fixes")
def test_right_natively_on_fixed_torch(tmp_path):
    out = _run(tmp_path)
    assert out.pop("status") is None
    assert out == {name: "ok" for name in FIXED + ALREADY_RIGHT}, out
