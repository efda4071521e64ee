"""dtensor-inplace-placement-change: in-place ops on a DTensor that would have to redistribute it,
on 2 real ranks (gloo, CPU mesh).

Natively on torch 2.4.1 and 2.9.0 (and with the patch switched off) ``exp_``/``abs_``/``clamp_``,
``neg_``, ``div_`` by a number and ``_foreach_mul_`` by a number or a (replicated) scalar tensor of a
``Partial`` DTensor leave it unchanged (the op ran on a reduced copy; ``clip_grad_norm_`` of partial
gradients skips the clip): its value is not the reference computed from every rank's summand in one
process. The same for torch 2.13's other rules that keep a ``Partial``: ``sub_`` of a replicated
value (or a sharded one: it becomes a ``Partial("sum")``, as on torch 2.14+; 2.13 raises) from a
sum, ``copy_`` of a partial, a replicated value added to (or copied into) a
``Partial("max")``/``("min")``, non-decreasing functions of one (``exp_``, ``relu_``, ``floor_``). With
TORCHPATCH=1 the ones torch 2.13 computes give the right value keeping the ``Partial``, and the others
(``exp_`` of a sum, ``neg_`` of a max, a number added to a max) raise torch 2.13's ``RuntimeError`` in
its words and leave the DTensor as it was, as torch 2.13 and later do natively (where the patch is not
applied). torch 2.4's ``copy_`` is right natively for partials of one kind and fails both ways for a
replicated value copied into a ``Partial("max")``.
"""

import pytest

from conftest import (
    DTENSOR_RANK_SETUP, LEAVE_WITHOUT_TEARDOWN, RESULT, clean_env, only_torch, patch_applies_here,
    ranks_result, through_patch_range, torch_matches
)

SCRIPT = DTENSOR_RANK_SETUP + """
def summand(r):  # rank r's share of a Partial("sum") tensor
    return torch.tensor([0.25, -1.5, 3.0, -0.5], dtype=torch.float64) * (r + 1) - r

def partial(reduce_op="sum"):
    return DTensor.from_local(summand(rank), mesh, [Partial(reduce_op)])

def replicated(value):
    return DTensor.from_local(torch.tensor(value, dtype=torch.float64), mesh, [Replicate()])

def sharded():  # REPLICATED as a Shard(0) DTensor
    return DTensor.from_local(REPLICATED.chunk(world)[rank].clone(), mesh, [Shard(0)])

def clip(d):  # torchtitan's clip_grad_norm_ of a tensor-parallel gradient (its norm, then _foreach_mul_)
    p = torch.nn.Parameter(DTensor.from_local(torch.zeros(4, dtype=torch.float64), mesh, [Replicate()]))
    p.grad = d
    torch.nn.utils.clip_grad_norm_([p], max_norm=1.0, foreach=True)

def clip_reference(t):
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    p.grad = t
    torch.nn.utils.clip_grad_norm_([p], max_norm=1.0, foreach=True)

def reduced(reduce_op):  # the global value of a Partial(reduce_op) of the summands
    parts = torch.stack([summand(r) for r in range(world)])
    return {"sum": parts.sum(0), "max": parts.amax(0), "min": parts.amin(0)}[reduce_op]

REPLICATED = torch.tensor([0.5, -3.0, 1.25, 2.0], dtype=torch.float64)
total = reduced("sum")
cases = {  # name: (in-place op on the DTensor, the same op on the global tensor[, the Partial's reduction])
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
    # torch 2.13's other rules that keep a Partial: adding or copying one of the same kind, adding a
    # replicated value to a max or min, non-decreasing functions of a max or min
    "sub_replicate_": (lambda d: d.sub_(replicated(REPLICATED.tolist()), alpha=-2), lambda t: t.sub_(REPLICATED, alpha=-2)),
    "copy_partial_": (lambda d: d.copy_(partial() * 2), lambda t: t.copy_(total * 2)),
    # a sharded operand of a sum's add_, sub_ or copy_ becomes a Partial("sum") (gathered, then split)
    "sub_shard_": (lambda d: d.sub_(sharded(), alpha=3.0), lambda t: t.sub_(REPLICATED, alpha=3.0)),
    "add_shard_": (lambda d: d.add_(sharded()), lambda t: t.add_(REPLICATED)),
    "copy_shard_": (lambda d: d.copy_(sharded()), lambda t: t.copy_(REPLICATED)),
    "add_replicate_max_": (lambda d: d.add_(replicated(REPLICATED.tolist())), lambda t: t.add_(REPLICATED), "max"),
    "foreach_add_replicate_min_": (lambda d: torch._foreach_add_([d], [replicated(REPLICATED.tolist())]),
                                   lambda t: torch._foreach_add_([t], [REPLICATED]), "min"),
    "exp_max_": (lambda d: d.exp_(), lambda t: t.exp_(), "max"),
    "relu_min_": (lambda d: d.relu_(), lambda t: t.relu_(), "min"),
    "floor_max_": (lambda d: d.floor_(), lambda t: t.floor_(), "max"),
    "copy_replicate_max_": (lambda d: d.copy_(replicated(REPLICATED.tolist())), lambda t: t.copy_(REPLICATED), "max"),
    # and these it refuses: -max is a min, and a number added to a max (or multiplied) has no rule
    "neg_max_": (lambda d: d.neg_(), lambda t: t.neg_(), "max"),
    "add_number_max_": (lambda d: d.add_(2.0), lambda t: t.add_(2.0), "max"),
    "mul_number_min_": (lambda d: d.mul_(2.0), lambda t: t.mul_(2.0), "min"),
}
out = {}
REFUSAL = ("in-place operations that require placement changes are not supported. The input has placement {}, "
           "but no valid strategy preserves this placement. Please use the out-of-place version of this operation instead.")
for name, (dtensor_op, reference_op, *reduce_op) in cases.items():
    reduce_op = reduce_op[0] if reduce_op else "sum"
    d = partial(reduce_op)
    try:
        returned = dtensor_op(d)
    except Exception as exc:  # torch 2.13's words, and the DTensor left as it was
        refused = isinstance(exc, RuntimeError) and REFUSAL.format((Partial(reduce_op),)) in str(exc)
        out[name] = "refused" if refused and torch.equal(d.to_local(), summand(rank)) else f"error: {type(exc).__name__}: {str(exc)[:300]}"
        continue
    ref = reduced(reduce_op).clone()
    reference_op(ref)
    got = d.full_tensor()
    # in place: the method returns the DTensor itself, and it stays Partial; the foreach ops return None
    same = (returned is d or name.startswith(("foreach_", "clip_"))) and tuple(d.placements) == (Partial(reduce_op),)
    out[name] = "ok" if same and torch.equal(got, ref) else f"wrong: {got.tolist()} {tuple(d.placements)} != {ref.tolist()}"
import torchpatch
out["status"] = torchpatch.status().get("dtensor-inplace-placement-change")
out["add_scalar_status"] = torchpatch.status().get("dtensor-partial-add-scalar")  # requires this patch
if rank == 0:
    print(RESULT + json.dumps(out), flush=True)
""".replace("RESULT", repr(RESULT)) + LEAVE_WITHOUT_TEARDOWN

REFUSED = ("exp_", "abs_", "clamp_", "neg_max_", "add_number_max_", "mul_number_min_")  # torch 2.13 raises
# linear in the DTensor: torch 2.13 keeps the Partial; 2.4 and 2.9 drop the write (2.4 has no strategy
# for _foreach_div_ by a number: an error), but for mul_, which 2.5 made linear
LINEAR = ("neg_", "div_number_", "foreach_mul_number_", "foreach_mul_tensor_", "foreach_mul_replicate_",
          "foreach_div_number_", "clip_grad_norm_") + (("mul_replicate_",) if torch_matches("<2.5") else ())
# torch 2.13's other rules: 2.4 and 2.9 drop the write, or fail (2.4 asks a Partial("max") of the
# replicated operand: "only support replicate to PartialSUM"); 2.4 copies partials right (its own copy_
# strategy), and cannot make a replicated value a Partial("max") either way
KEPT = ("sub_replicate_", "sub_shard_", "add_shard_", "copy_shard_", "add_replicate_max_", "foreach_add_replicate_min_", "exp_max_", "relu_min_", "floor_max_",
        *(("copy_partial_", "copy_replicate_max_") if torch_matches(">=2.5") else ()))
KEEPING = ("add_partial_", "zero_") + (() if torch_matches("<2.5") else ("mul_replicate_",))
NATIVE_RIGHT = KEEPING + (("copy_partial_", "add_number_max_") if torch_matches("<2.5") else ())  # 2.4: by luck
NEWEST = dict(dict.fromkeys(REFUSED, "refused"), **dict.fromkeys(LINEAR + KEPT + KEEPING, "ok"))  # torch 2.13+
if torch_matches("<2.5"):
    NEWEST.update(copy_partial_="ok", copy_replicate_max_="error")  # 2.4's copy_: both ways
if torch_matches(">=2.13,<2.14"):  # 2.13 cannot make a shard a Partial("sum") (2.14 zero-fills it)
    NEWEST.update(dict.fromkeys(("sub_shard_", "add_shard_", "copy_shard_"), "error"))


def _run(tmp_path, **env) -> dict:
    return ranks_result(SCRIPT, tmp_path=tmp_path, env=clean_env(**env), timeout=240)


@only_torch(">=2.4,<2.13", "torch 2.4.1 and 2.9.0 drop the write")
@pytest.mark.parametrize("env", [{}, {"TORCHPATCH": "1", "TORCHPATCH_DTENSOR_INPLACE_PLACEMENT_CHANGE": "0"}], ids=["unset", "opted-out"])
def test_write_dropped_natively(tmp_path, env):
    out = _run(tmp_path, **env)
    assert out.pop("status") is None
    assert out.pop("add_scalar_status") is None  # off with the patch it requires
    for name in set(REFUSED + LINEAR + KEPT) - set(NATIVE_RIGHT):
        assert out[name].startswith(("wrong", "error")), (name, out)
    for name in NATIVE_RIGHT:
        assert out[name] == "ok", (name, out)


@through_patch_range("dtensor-inplace-placement-change", "DTensor's dispatcher as the patch knows it", since="2.4")
def test_computed_or_refused_as_on_newer_torch(tmp_path):
    out = _run(tmp_path, TORCHPATCH="1")
    applied = "applied" if patch_applies_here("dtensor-inplace-placement-change") else None
    assert out.pop("status") == out.pop("add_scalar_status") == applied
    assert {k: v[:5] if v.startswith("error") else v for k, v in out.items()} == NEWEST, out


@only_torch(">=2.13", "torch that refuses these in-place ops itself")
def test_computed_or_refused_natively_on_fixed_torch(tmp_path):
    out = _run(tmp_path)
    assert out.pop("status") is out.pop("add_scalar_status") is None
    assert {k: v[:5] if v.startswith("error") else v for k, v in out.items()} == NEWEST, out
