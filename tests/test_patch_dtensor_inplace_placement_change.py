"""dtensor-inplace-placement-change: in-place ops on a DTensor that would have to redistribute it,
on 2 real ranks (gloo, CPU mesh).

Natively on torch 2.4.1 and 2.9.0 (and with the patch switched off) ``exp_``/``abs_``/``clamp_`` of a
``Partial`` DTensor leave it unchanged (the op ran on a reduced copy): its value is not the
reference computed from every rank's summand in one process. With TORCHPATCH=1 they raise
torch 2.13's ``RuntimeError``, and in-place ops that keep the placement still give the right value.
On torch 2.13 and later torch raises by itself and the patch is not applied.
"""

import pytest

from conftest import DTENSOR_RANK_SETUP, LEAVE_WITHOUT_TEARDOWN, RESULT, clean_env, only_torch, ranks_result, torch_matches

SCRIPT = DTENSOR_RANK_SETUP + """
def summand(r):  # rank r's share of a Partial("sum") tensor
    return torch.tensor([0.25, -1.5, 3.0, -0.5], dtype=torch.float64) * (r + 1) - r

def partial():
    return DTensor.from_local(summand(rank), mesh, [Partial()])

total = sum(summand(r) for r in range(world))
cases = {  # name: (in-place op on the DTensor, the same op on the global tensor)
    "exp_": (lambda d: d.exp_(), lambda t: t.exp_()),
    "abs_": (lambda d: d.abs_(), lambda t: t.abs_()),
    "clamp_": (lambda d: d.clamp_(max=0.5), lambda t: t.clamp_(max=0.5)),
    # these keep the Partial and are right already (mul_ from torch 2.5)
    "add_partial_": (lambda d: d.add_(partial()), lambda t: t.add_(total)),
    "mul_replicate_": (lambda d: d.mul_(DTensor.from_local(torch.full((4,), 3.0, dtype=torch.float64), mesh, [Replicate()])),
                       lambda t: t.mul_(3.0)),
    "zero_": (lambda d: d.zero_(), lambda t: t.zero_()),
}
out = {}
for name, (dtensor_op, reference_op) in cases.items():
    d = partial()
    try:
        returned = dtensor_op(d)
    except RuntimeError as exc:
        out[name] = "refused" if "in-place operations that require placement changes" in str(exc) else "error: " + str(exc)[:200]
        continue
    got, ref = d.full_tensor(), reference_op(total.clone())
    out[name] = "ok" if returned is d and torch.equal(got, ref) else f"wrong: {got.tolist()} != {ref.tolist()}"
import torchpatch
out["status"] = torchpatch.status().get("dtensor-inplace-placement-change")
if rank == 0:
    print(RESULT + json.dumps(out), flush=True)
""".replace("RESULT", repr(RESULT)) + LEAVE_WITHOUT_TEARDOWN

# torch 2.4's mul is not linear: its mul_ of a Partial by a replicated tensor needs the reduction too
CHANGING = ("exp_", "abs_", "clamp_") + (("mul_replicate_",) if torch_matches("<2.5") else ())
KEEPING = ("add_partial_", "zero_") + (() if torch_matches("<2.5") else ("mul_replicate_",))


def _run(tmp_path, **env) -> dict:
    return ranks_result(SCRIPT, tmp_path=tmp_path, env=clean_env(**env), timeout=240)


@only_torch(">=2.4,<2.13", "torch 2.4.1 and 2.9.0 drop the write")
@pytest.mark.parametrize("env", [{}, {"TORCHPATCH": "1", "TORCHPATCH_DTENSOR_INPLACE_PLACEMENT_CHANGE": "0"}], ids=["unset", "opted-out"])
def test_write_dropped_natively(tmp_path, env):
    out = _run(tmp_path, **env)
    assert out.pop("status") is None
    for name in CHANGING:
        assert out[name].startswith("wrong"), (name, out)
    for name in KEEPING:
        assert out[name] == "ok", (name, out)


@only_torch(">=2.4", "DTensor's dispatcher as the patch knows it")
def test_refused_as_on_newer_torch(tmp_path):
    out = _run(tmp_path, TORCHPATCH="1")
    assert out.pop("status") == ("applied" if torch_matches("<2.13") else None)
    assert out == dict(dict.fromkeys(CHANGING, "refused"), **dict.fromkeys(KEEPING, "ok")), out


@only_torch(">=2.13", "torch that refuses these in-place ops itself")
def test_refused_natively_on_fixed_torch(tmp_path):
    out = _run(tmp_path)
    assert out.pop("status") is None
    assert out == dict(dict.fromkeys(CHANGING, "refused"), **dict.fromkeys(KEEPING, "ok")), out
