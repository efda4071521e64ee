"""dtensor-partial-add-scalar: a Python number added to a ``Partial("sum")`` DTensor, on 2 real ranks
(gloo, CPU mesh).

Every rank knows every rank's summand, so the reference (the global sum, then the number added
once) is computed in the same run, in one process. On torch 2.4.1 and 2.9.0 natively (and with
the patch switched off) the number is added once per rank; with TORCHPATCH=1 once. The in-place
``add_`` then raises, as on torch 2.13. ``clip_grad_norm_`` on sharded DTensor gradients (whose
``total_norm + 1e-6`` is such an add) scales the gradients exactly as on plain tensors with the
patch, not without. On torch 2.13 and later the patch is not applied and torch is right.
"""

import pytest

from conftest import (
    DTENSOR_RANK_SETUP, LEAVE_WITHOUT_TEARDOWN, RESULT, clean_env, only_torch, patch_applies_here,
    rank_result, ranks_result, run_ranks, through_patch_range, torch_matches
)

SCRIPT = DTENSOR_RANK_SETUP + """
def summand(r):  # rank r's share of a Partial("sum") tensor; small integers: every sum is exact
    return torch.tensor([[1.0, -3.0, 2.0], [5.0, 0.0, -4.0]], dtype=torch.float64) * (r + 1) - 2 * r

def partial():
    return DTensor.from_local(summand(rank), mesh, [Partial()])

total = sum(summand(r) for r in range(world))

def add_inplace():
    d = partial()
    d.add_(10)
    return d

def foreach_inplace():
    ds = [partial(), partial()]
    torch._foreach_add_(ds, 10)
    return torch.stack(ds)

cases = {  # name: (DTensor computation, the same on the global tensor)
    "add_number": (lambda: partial() + 10, lambda: total + 10),
    "add_int_to_sum": (lambda: partial().sum() + 7, lambda: total.sum() + 7),
    "radd_number": (lambda: 2.5 + partial(), lambda: 2.5 + total),
    "add_alpha": (lambda: torch.add(partial(), 3, alpha=2), lambda: torch.add(total, 3, alpha=2)),
    "foreach_add_number": (lambda: torch.stack(torch._foreach_add([partial(), partial()], 10)), lambda: torch.stack([total + 10] * 2)),
    "add_inplace": (add_inplace, lambda: total + 10),
    "foreach_add_inplace": (foreach_inplace, lambda: torch.stack([total + 10] * 2)),
    # adds that were right already stay right (and partial)
    "add_partials": (lambda: partial() + partial(), lambda: total + total),
    "mul_number": (lambda: partial() * 3, lambda: total * 3),
}
out = {}
for name, (dtensor_fn, reference_fn) in cases.items():
    try:
        got = dtensor_fn()
    except RuntimeError as exc:  # torch 2.13's words (not wrapped in "Sharding propagation failed")
        refused = "in-place operations that require placement changes are not supported. The input has placement"
        out[name] = "error: in-place placement change" if str(exc).startswith("aten.") and refused in str(exc) else "error: " + str(exc)[:200]
        continue
    full = got.full_tensor() if isinstance(got, DTensor) else torch.stack([g.full_tensor() for g in got])
    out[name] = "ok" if torch.equal(full, reference_fn()) else f"wrong: {full.tolist()} != {reference_fn().tolist()}"
out["add_partials_placement"] = str(list((partial() + partial()).placements))

# gradient clipping: rank r's gradient shard has norm 5 (r = 0) or 12 (r = 1): the total norm is 13
# exactly, the clip coefficient 1 / (13 + 1e-6) as on plain tensors; adding 1e-6 on each rank's partial
# norm gives another coefficient
grad = torch.tensor([3.0, 4.0, 12.0, 0.0], dtype=torch.float64)
p = torch.nn.Parameter(distribute_tensor(torch.zeros(4, dtype=torch.float64), mesh, [Shard(0)]))
p.grad = distribute_tensor(grad.clone(), mesh, [Shard(0)])
q = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
q.grad = grad.clone()
norm = torch.nn.utils.clip_grad_norm_([p], 1.0, foreach=False)
ref_norm = torch.nn.utils.clip_grad_norm_([q], 1.0, foreach=False)
norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
out["clip_total_norm"] = "ok" if torch.equal(norm, ref_norm) else f"wrong: {norm.item()} != {ref_norm.item()}"
out["clip_grads"] = "ok" if torch.equal(p.grad.full_tensor(), q.grad) else f"wrong: {p.grad.full_tensor().tolist()} != {q.grad.tolist()}"
import torchpatch
out["status"] = torchpatch.status().get("dtensor-partial-add-scalar")
if rank == 0:
    print(RESULT + json.dumps(out), flush=True)
""".replace("RESULT", repr(RESULT)) + LEAVE_WITHOUT_TEARDOWN

NUMBER_ADDS = ("add_number", "add_int_to_sum", "radd_number", "add_alpha")
ALREADY_RIGHT = ("add_partials", "mul_number", "clip_total_norm")


def _run(tmp_path, **env) -> dict:
    return ranks_result(SCRIPT, tmp_path=tmp_path, env=clean_env(**env), timeout=240)


@only_torch(">=2.4,<2.10", "torch 2.4.1 and 2.9.0 add the number on every rank")
@pytest.mark.parametrize("env", [{}, {"TORCHPATCH": "1", "TORCHPATCH_DTENSOR_PARTIAL_ADD_SCALAR": "0"}], ids=["unset", "opted-out"])
def test_number_added_on_every_rank(tmp_path, env):
    out = _run(tmp_path, **env)
    assert out.pop("status") is None
    for name in NUMBER_ADDS + ("add_inplace",):
        assert out[name].startswith("wrong"), (name, out)
    # with TORCHPATCH=1, dtensor-reduction-strategy already reduces the norm of the gradients' partial
    # norms before the 1e-6 is added: clipping is right then even without this patch
    assert out["clip_grads"].startswith("wrong" if not env else "ok"), out
    # torch 2.4 carries the Partial through the foreach add too; 2.9 reduces it first (right), and its
    # in-place form writes into the reduced copy (the DTensor keeps its old value: wrong, differently)
    assert out["foreach_add_number"].startswith("wrong" if torch_matches("<2.5") else "ok"), out
    # with TORCHPATCH=1 on 2.9, dtensor-inplace-placement-change refuses the foreach in-place add that
    # reduces its own input; 2.4's keeps the Partial (no redistribution) and adds on every rank
    refused = env and torch_matches(">=2.5")
    assert out["foreach_add_inplace"].startswith("error: in-place" if refused else "wrong"), out
    for name in ALREADY_RIGHT:
        assert out[name] == "ok", (name, out)


@only_torch(">=2.4,<2.9", "torch 2.4-2.8 reuse the numbers of an op's first sharding")
def test_off_without_the_fix_of_stale_numbers(tmp_path):
    # reducing the Partial first makes these adds redistribute, where torch 2.4.1 reuses the first
    # call's number (10 for the 3 of add_alpha): the patch needs dtensor-stale-scalar-args
    out = _run(tmp_path, TORCHPATCH="1", TORCHPATCH_DTENSOR_STALE_SCALAR_ARGS="0")
    assert out.pop("status") is None
    for name in NUMBER_ADDS:
        assert out[name].startswith("wrong"), (name, out)


@through_patch_range("dtensor-partial-add-scalar", "DTensor's pointwise strategies as the patch knows them", since="2.4")
def test_number_added_once(tmp_path):
    out = _run(tmp_path, TORCHPATCH="1")
    assert out.pop("status") == ("applied" if patch_applies_here("dtensor-partial-add-scalar") else None)
    assert out.pop("add_partials_placement") == "[Partial(sum)]"  # adding partials stays partial: no communication
    expected = dict.fromkeys(NUMBER_ADDS + ALREADY_RIGHT + ("foreach_add_number", "clip_grads"), "ok")
    # the in-place adds raise, as torch >= 2.13 refuses them: this patch reduces their Partial first, which
    # dtensor-inplace-placement-change (required) refuses
    expected.update(add_inplace="error: in-place placement change", foreach_add_inplace="error: in-place placement change")
    assert out == expected, out


@only_torch(">=2.13", "torch with the upstream fix")
def test_right_natively_on_fixed_torch(tmp_path):
    out = _run(tmp_path)
    assert out.pop("status") is None
    assert out.pop("add_partials_placement") == "[Partial(sum)]"
    expected = dict.fromkeys(NUMBER_ADDS + ALREADY_RIGHT + ("foreach_add_number", "clip_grads"), "ok")
    expected.update(add_inplace="error: in-place placement change", foreach_add_inplace="error: in-place placement change")
    assert out == expected, out


SCRIPT_21 = """
import json, torch, torch.distributed as dist
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
from torch.distributed._tensor import DTensor, DeviceMesh
from torch.distributed._tensor.placement_types import _Partial  # torch 2.1's partial placement
mesh = DeviceMesh("cpu", list(range(world)))

def summand(r):
    return torch.tensor([[1.0, -3.0, 2.0], [5.0, 0.0, -4.0]], dtype=torch.float64) * (r + 1) - 2 * r

total = sum(summand(r) for r in range(world))
out = {}
for name, number in (("add_number", 10), ("add_float", 2.5)):
    got = (DTensor.from_local(summand(rank), mesh, [_Partial()]) + number).redistribute(mesh, [__import__(
        "torch.distributed._tensor", fromlist=["Replicate"]).Replicate()]).to_local().clone()
    out[name] = "ok" if torch.equal(got, total + number) else f"wrong: {got.tolist()} != {(total + number).tolist()}"
got = (DTensor.from_local(summand(rank), mesh, [_Partial()]) + DTensor.from_local(summand(rank), mesh, [_Partial()]))
out["add_partials_placement"] = str(list(got.placements))
import torchpatch
out["status"] = torchpatch.status().get("dtensor-partial-add-scalar")
if rank == 0:
    print(RESULT + json.dumps(out), flush=True)
""".replace("RESULT", repr(RESULT)) + LEAVE_WITHOUT_TEARDOWN


@only_torch(">=2.1,<2.2", "torch 2.1's pointwise sharding rule, before the strategies")
@pytest.mark.parametrize("env", [{}, {"TORCHPATCH": "1", "TORCHPATCH_DTENSOR_PARTIAL_ADD_SCALAR": "0"}, {"TORCHPATCH": "1"}],
                         ids=["unset", "opted-out", "patched"])
def test_torch21_rule(tmp_path, env):
    proc = run_ranks(SCRIPT_21, env=clean_env(**env), tmp_path=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = rank_result(proc)
    patched = env.get("TORCHPATCH_DTENSOR_PARTIAL_ADD_SCALAR") != "0" and bool(env)
    assert out.pop("status") == ("applied" if patched else None)
    assert out.pop("add_partials_placement").startswith("[_Partial"), out  # adding partials stays partial
    for name in ("add_number", "add_float"):
        assert out[name].startswith("ok" if patched else "wrong"), (name, out)
