"""dtensor-norm-partial-pointwise: pointwise ops on a norm of a sharded DTensor (a pending
``_NormPartial``), on 2 real ranks (gloo, CPU mesh).

Every rank computes each op on DTensors and the same op on the global tensors (every rank holds
them): the reference is computed in the same run, in one process. On torch 2.9.0 natively (and with
the patch switched off) ``dt.norm() * -2`` comes back positive (the p-norm reduction of each rank's
scaled partial norm drops the sign) and ``norm + other`` adds before reducing; on 2.4.1 ``add`` and
``div.Scalar`` do. With TORCHPATCH=1 the values are the global ones and the in-place ops on a norm
raise torch 2.15's ``RuntimeError`` (it cannot keep a ``_NormPartial``), as torch 2.13+ do natively.
"""

import pytest

from conftest import (
    DTENSOR_RANK_SETUP, LEAVE_WITHOUT_TEARDOWN, RESULT, clean_env, only_torch, patch_applies_here,
    ranks_result, through_patch_range, torch_matches
)

SCRIPT = DTENSOR_RANK_SETUP + """
A = torch.tensor([[1.0, -3.0, 2.0], [2.5, 0.5, -4.0], [6.0, 1.0, -2.0], [0.0, 3.0, 1.0]], dtype=torch.float64)
B = torch.tensor([[2.0, 1.0, 0.0], [-1.0, 4.0, 2.0], [0.5, 0.0, 3.0], [7.0, -2.0, 1.0]], dtype=torch.float64)

def dt(x=A):
    return distribute_tensor(x, mesh, [Shard(0)])

def vn(x, **kw):
    return torch.linalg.vector_norm(x, **kw)

cases = {  # name: (DTensor computation, the same on the global tensors)
    "norm*-2": (lambda: dt().norm() * -2, lambda: A.norm() * -2),
    "mul(norm,-3)": (lambda: torch.mul(dt().norm(), -3), lambda: A.norm() * -3),
    "norm*tensor(-2)": (lambda: dt().norm() * torch.tensor(-2.0, dtype=torch.float64), lambda: A.norm() * -2),
    "vector_norm_dim*-2": (lambda: vn(dt(), dim=0) * -2, lambda: vn(A, dim=0) * -2),
    "norm3*-2": (lambda: dt().norm(p=3) * -2, lambda: A.norm(p=3) * -2),
    "vector_norm*-0.5": (lambda: vn(dt()) * -0.5, lambda: vn(A) * -0.5),
    "norm+norm": (lambda: dt().norm() + dt(B).norm(), lambda: A.norm() + B.norm()),
    "norm+sum": (lambda: dt().norm() + dt().sum(), lambda: A.norm() + A.sum()),
    "div.Scalar": (lambda: torch.ops.aten.div.Scalar(dt().norm(), -4), lambda: A.norm() / -4),
    # right already
    "norm/-2": (lambda: dt().norm() / -2, lambda: A.norm() / -2),
    "-norm": (lambda: -dt().norm(), lambda: -A.norm()),
    "norm1*-2": (lambda: dt().norm(p=1) * -5, lambda: A.norm(p=1) * -5),
    "inf_norm*-2": (lambda: dt().norm(p=float("inf")) * -6, lambda: A.norm(p=float("inf")) * -6),
    "sum*norm": (lambda: dt().sum() * dt(B).norm(), lambda: A.sum() * B.norm()),
    # in place on a norm: torch 2.13+ cannot keep the _NormPartial, and raises
    "norm.mul_(-2)": (lambda: dt().norm().mul_(-2), lambda: A.norm() * -2),
    "norm.mul_(2)": (lambda: dt().norm().mul_(2), lambda: A.norm() * 2),
    "norm.neg_()": (lambda: dt().norm().neg_(), lambda: -A.norm()),
    "norm.div_(-2)": (lambda: dt().norm().div_(-2), lambda: A.norm() / -2),
    "norm.add_(norm)": (lambda: dt().norm().add_(dt(B).norm()), lambda: A.norm() + B.norm()),
}
out = {}
for name, (dtensor_fn, reference_fn) in cases.items():
    try:
        got = dtensor_fn()
    except RuntimeError as exc:
        refused = "in-place operations that require placement changes are not supported" in str(exc)
        out[name] = "refused" if refused else f"error: {exc}"[:300]
        continue
    value, ref = got.full_tensor(), reference_fn()
    # a norm reduced in another order than the global one: a relative 1e-12 in float64 is rounding
    same = value.shape == ref.shape and torch.allclose(value, ref, rtol=1e-12, atol=0.0)
    out[name] = "ok" if same else f"wrong: {value.tolist()} != {ref.tolist()}"
import torchpatch
out["status"] = torchpatch.status().get("dtensor-norm-partial-pointwise")
if rank == 0:
    print(RESULT + json.dumps(out), flush=True)
""".replace("RESULT", repr(RESULT)) + LEAVE_WITHOUT_TEARDOWN

IN_PLACE = ("norm.mul_(-2)", "norm.mul_(2)", "norm.neg_()", "norm.div_(-2)", "norm.add_(norm)")
OUT_OF_PLACE = ("norm*-2", "mul(norm,-3)", "norm*tensor(-2)", "vector_norm_dim*-2", "norm3*-2", "vector_norm*-0.5", "norm+norm",
                "norm+sum", "div.Scalar", "norm/-2", "-norm", "norm1*-2", "inf_norm*-2", "sum*norm")
NEWEST = dict(dict.fromkeys(OUT_OF_PLACE, "ok"), **dict.fromkeys(IN_PLACE, "refused"))  # torch 2.13-2.15
# wrong natively: 2.9 keeps the _NormPartial through mul and add; 2.4 through add and div.Scalar
WRONG_2_9 = ("norm*-2", "mul(norm,-3)", "norm*tensor(-2)", "vector_norm_dim*-2", "norm3*-2", "vector_norm*-0.5", "norm+norm",
             "norm+sum", "norm.mul_(-2)")
WRONG_2_4 = ("norm+norm", "norm+sum", "div.Scalar")


def _run(tmp_path, **env) -> dict:
    return ranks_result(SCRIPT, tmp_path=tmp_path, env=clean_env(**env), timeout=240)


@only_torch(">=2.4,<2.11", "torch 2.4.1 and 2.9.0 compute on each rank's partial norm")
@pytest.mark.parametrize("env", [{}, {"TORCHPATCH": "1", "TORCHPATCH_DTENSOR_NORM_PARTIAL_POINTWISE": "0"}], ids=["unset", "opted-out"])
def test_norm_partials_wrong_natively(tmp_path, env):
    out = _run(tmp_path, **env)
    assert out.pop("status") is None
    for name in WRONG_2_4 if torch_matches("<2.5") else WRONG_2_9:
        assert out[name].startswith("wrong"), (name, out)
    if torch_matches(">=2.5"):  # (2.4 alone reuses the first number multiplied: dtensor-stale-scalar-args)
        for name in ("norm/-2", "-norm", "norm1*-2", "inf_norm*-2", "sum*norm"):
            assert out[name] == "ok", (name, out)


@through_patch_range("dtensor-norm-partial-pointwise", "DTensor's pointwise strategies as the patch knows them", since="2.4")
def test_norm_partials_as_on_the_newest_torch(tmp_path):
    out = _run(tmp_path, TORCHPATCH="1")
    assert out.pop("status") == ("applied" if patch_applies_here("dtensor-norm-partial-pointwise") else None)
    assert out == NEWEST, out


@only_torch(">=2.13", "torch whose pointwise rules never keep a _NormPartial")
def test_norm_partials_natively_on_fixed_torch(tmp_path):
    out = _run(tmp_path)
    assert out.pop("status") is None
    assert out == NEWEST, out
