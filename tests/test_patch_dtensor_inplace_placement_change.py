"""dtensor-inplace-placement-change: in-place ops on a DTensor that would have to redistribute it,
on 2 real ranks (gloo, CPU mesh).

Natively on torch 2.4.1 and 2.9.0 (and with the patch switched off) ``exp_``/``abs_``/``clamp_``,
``neg_``, ``div_`` by a number and ``_foreach_mul_`` by a number or a (replicated) scalar tensor of a
``Partial`` DTensor leave it unchanged (the op ran on a reduced copy; ``clip_grad_norm_`` of partial
gradients skips the clip): its value is not the reference computed from every rank's summand in one
process. With TORCHPATCH=1 the non-linear ones raise torch 2.13's ``RuntimeError`` and the linear
ones give the right value keeping the ``Partial``, as torch 2.13 and later do natively (where the patch
is not applied).
"""

import pytest

from conftest import DTENSOR_RANK_SETUP, LEAVE_WITHOUT_TEARDOWN, RESULT, clean_env, only_torch, ranks_result, torch_matches

SCRIPT = DTENSOR_RANK_SETUP + """
def summand(r):  # rank r's share of a Partial("sum") tensor
    return torch.tensor([0.25, -1.5, 3.0, -0.5], dtype=torch.float64) * (r + 1) - r

def partial():
    return DTensor.from_local(summand(rank), mesh, [Partial()])

def replicated(value):
    return DTensor.from_local(torch.tensor(value, dtype=torch.float64), mesh, [Replicate()])

def clip(d):  # torchtitan's clip_grad_norm_ of a tensor-parallel gradient (its norm, then _foreach_mul_)
    p = torch.nn.Parameter(DTensor.from_local(torch.zeros(4, dtype=torch.float64), mesh, [Replicate()]))
    p.grad = d
    torch.nn.utils.clip_grad_norm_([p], max_norm=1.0, foreach=True)

def clip_reference(t):
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    p.grad = t
    torch.nn.utils.clip_grad_norm_([p], max_norm=1.0, foreach=True)

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
    # linear in the DTensor: torch 2.13 keeps the Partial (2.9 drops all but mul_, 2.4 all)
    "neg_": (lambda d: d.neg_(), lambda t: t.neg_()),
    "div_number_": (lambda d: d.div_(4.0), lambda t: t.div_(4.0)),
    "foreach_mul_number_": (lambda d: torch._foreach_mul_([d], 0.5), lambda t: torch._foreach_mul_([t], 0.5)),
    "foreach_mul_tensor_": (lambda d: torch._foreach_mul_([d], torch.tensor(0.5, dtype=torch.float64)),
                            lambda t: torch._foreach_mul_([t], torch.tensor(0.5, dtype=torch.float64))),
    "foreach_mul_replicate_": (lambda d: torch._foreach_mul_([d], replicated(0.5)),
                               lambda t: torch._foreach_mul_([t], torch.tensor(0.5, dtype=torch.float64))),
    "foreach_div_number_": (lambda d: torch._foreach_div_([d], 4.0), lambda t: torch._foreach_div_([t], 4.0)),
    "clip_grad_norm_": (clip, clip_reference),
}
out = {}
for name, (dtensor_op, reference_op) in cases.items():
    d = partial()
    try:
        returned = dtensor_op(d)
    except Exception as exc:
        out[name] = "refused" if "in-place operations that require placement changes" in str(exc) else f"error: {type(exc).__name__}: {str(exc)[:200]}"
        continue
    ref = total.clone()
    reference_op(ref)
    got = d.full_tensor()
    # in place: the method returns the DTensor itself, and it stays Partial; the foreach ops return None
    same = (returned is d or name.startswith(("foreach_", "clip_"))) and tuple(d.placements) == (Partial(),)
    out[name] = "ok" if same and torch.equal(got, ref) else f"wrong: {got.tolist()} {tuple(d.placements)} != {ref.tolist()}"
import torchpatch
out["status"] = torchpatch.status().get("dtensor-inplace-placement-change")
if rank == 0:
    print(RESULT + json.dumps(out), flush=True)
""".replace("RESULT", repr(RESULT)) + LEAVE_WITHOUT_TEARDOWN

REFUSED = ("exp_", "abs_", "clamp_")  # not linear: torch 2.13 raises
# linear in the DTensor: torch 2.13 keeps the Partial; 2.4 and 2.9 drop the write (2.4 has no strategy
# for _foreach_div_ by a number: an error), but for mul_, which 2.5 made linear
LINEAR = ("neg_", "div_number_", "foreach_mul_number_", "foreach_mul_tensor_", "foreach_mul_replicate_",
          "foreach_div_number_", "clip_grad_norm_") + (("mul_replicate_",) if torch_matches("<2.5") else ())
KEEPING = ("add_partial_", "zero_") + (() if torch_matches("<2.5") else ("mul_replicate_",))
NEWEST = dict(dict.fromkeys(REFUSED, "refused"), **dict.fromkeys(LINEAR + KEEPING, "ok"))  # torch 2.13+


def _run(tmp_path, **env) -> dict:
    return ranks_result(SCRIPT, tmp_path=tmp_path, env=clean_env(**env), timeout=240)


@only_torch(">=2.4,<2.13", "torch 2.4.1 and 2.9.0 drop the write")
@pytest.mark.parametrize("env", [{}, {"TORCHPATCH": "1", "TORCHPATCH_DTENSOR_INPLACE_PLACEMENT_CHANGE": "0"}], ids=["unset", "opted-out"])
def test_write_dropped_natively(tmp_path, env):
    out = _run(tmp_path, **env)
    assert out.pop("status") is None
    for name in REFUSED + LINEAR:
        assert out[name].startswith(("wrong", "error")), (name, out)
    for name in KEEPING:
        assert out[name] == "ok", (name, out)


@only_torch(">=2.4", "DTensor's dispatcher as the patch knows it")
def test_computed_or_refused_as_on_newer_torch(tmp_path):
    out = _run(tmp_path, TORCHPATCH="1")
    assert out.pop("status") == ("applied" if torch_matches("<2.13") else None)
    assert out == NEWEST, out


@only_torch(">=2.13", "torch that refuses these in-place ops itself")
def test_computed_or_refused_natively_on_fixed_torch(tmp_path):
    out = _run(tmp_path)
    assert out.pop("status") is None
    assert out == NEWEST, out
