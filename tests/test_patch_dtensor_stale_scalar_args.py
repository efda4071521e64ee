"""dtensor-stale-scalar-args: the numbers of a DTensor op that redistributes its inputs, on 2 real
ranks (gloo, CPU mesh).

The reference is the same arithmetic on the global tensor (every rank knows every rank's summand),
in the same run. Natively on torch 2.4.1 (and with the patch switched off) the second and later
calls reuse the first call's number; with TORCHPATCH=1 every call uses its own. On torch 2.9 and
later the dispatcher already does, and the patch is not applied.
"""

import pytest

from conftest import (
    DTENSOR_RANK_SETUP, LEAVE_WITHOUT_TEARDOWN, RESULT, clean_env, only_torch, patch_applies_here,
    ranks_result, through_patch_range
)

SCRIPT = DTENSOR_RANK_SETUP + """
def summand(r):  # rank r's share of a Partial("sum") tensor; small integers: products are exact
    return torch.tensor([[1.0, -2.0], [3.0, 4.0]], dtype=torch.float64) * (r + 1) + r

def partial():
    return DTensor.from_local(summand(rank), mesh, [Partial()])

total = sum(summand(r) for r in range(world))
X = torch.arange(12, dtype=torch.float64).reshape(4, 3)

def check(got, ref):
    got = got.full_tensor()
    return "ok" if torch.equal(got, ref) else f"wrong: {got.tolist()} != {ref.tolist()}"

out = {}
# the issue's loop: a sum of a sharded tensor times 1, 2, 3
out["sum_times_i"] = [check(distribute_tensor(X, mesh, [Shard(0)]).sum() * i, X.sum() * i) for i in (1, 2, 3)]
# -5 * dt after 2 * dt on a Partial DTensor
out["mul_partial"] = [check(k * partial(), k * total) for k in (2.0, -5.0)]
# a non-linear op with a number: pow of a Partial, 2 then 3
out["pow_partial"] = [check(partial() ** k, total ** k) for k in (2, 3)]
# sharded view ops keep their rewritten shapes (torch's adjusted arguments)
out["view_sharded"] = [check(distribute_tensor(X, mesh, [Shard(0)]).view(4, 3, 1), X.view(4, 3, 1)),
                       check(distribute_tensor(X, mesh, [Shard(0)]).view(-1, 3), X.view(-1, 3))]
import torchpatch
out["status"] = torchpatch.status().get("dtensor-stale-scalar-args")
if rank == 0:
    print(RESULT + json.dumps(out), flush=True)
""".replace("RESULT", repr(RESULT)) + LEAVE_WITHOUT_TEARDOWN


def _run(tmp_path, **env) -> dict:
    return ranks_result(SCRIPT, tmp_path=tmp_path, env=clean_env(**env), timeout=240)


@only_torch(">=2.4,<2.9", "torch 2.4.1 reuses the first call's numbers")
@pytest.mark.parametrize("env", [{}, {"TORCHPATCH": "1", "TORCHPATCH_DTENSOR_STALE_SCALAR_ARGS": "0"}], ids=["unset", "opted-out"])
def test_first_numbers_reused_natively(tmp_path, env):
    out = _run(tmp_path, **env)
    assert out.pop("status") is None
    for name in ("sum_times_i", "mul_partial", "pow_partial"):
        assert out[name][0] == "ok", (name, out)  # the first call is right
        assert all(r.startswith("wrong") for r in out[name][1:]), (name, out)  # the next reuse its number
    assert out["view_sharded"] == ["ok", "ok"], out


@through_patch_range("dtensor-stale-scalar-args", "DTensor's dispatcher as the patch knows it", since="2.4")
def test_each_call_uses_its_numbers(tmp_path):
    out = _run(tmp_path, TORCHPATCH="1")
    assert out.pop("status") == ("applied" if patch_applies_here("dtensor-stale-scalar-args") else None)
    assert out == {"sum_times_i": ["ok"] * 3, "mul_partial": ["ok"] * 2, "pow_partial": ["ok"] * 2, "view_sharded": ["ok"] * 2}, out


@only_torch(">=2.9", "torch whose dispatcher keeps this call's numbers")
def test_right_natively_on_fixed_torch(tmp_path):
    out = _run(tmp_path)
    assert out.pop("status") is None
    assert out == {"sum_times_i": ["ok"] * 3, "mul_partial": ["ok"] * 2, "pow_partial": ["ok"] * 2, "view_sharded": ["ok"] * 2}, out
