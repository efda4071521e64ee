"""dtensor-linspace-logspace: ``torch.distributed.tensor.linspace``/``logspace`` on 2 real ranks (gloo,
CPU mesh).

The same rank script runs with TORCHPATCH=1 on every torch from 2.4: served by torchpatch on 2.4-2.13,
torch's own on 2.14 and later (the reference for the served semantics). Each DTensor's full tensor and
each rank's shard are checked against ``torch.linspace``/``torch.logspace`` of the same arguments on
one process, and its chunk for that rank.
"""

from conftest import (
    DTENSOR_RANK_SETUP, LEAVE_WITHOUT_TEARDOWN, RESULT, clean_env, only_torch, ranks_result, run_json,
    run_py, through_patch_range, where_patch_applies, where_patch_does_not_apply
)

SCRIPT = DTENSOR_RANK_SETUP + """
from torch.distributed.tensor import linspace, logspace

def check(dt, want, placement, gather=True):
    \"\"\"Mismatches of DTensor ``dt`` with the one-process tensor ``want`` laid out as ``placement``
    (without ``gather``, of its local shard only).\"\"\"
    bad = []
    full = dt.full_tensor() if gather else want
    if dt.dtype != want.dtype or full.shape != want.shape or not torch.allclose(full, want):
        bad.append(f"full {full} != {want}")
    shard = (list(want.chunk(world)) + [want[:0]] * world)[rank] if placement == Shard(0) else want
    local = dt.to_local()
    if local.shape != shard.shape or not torch.allclose(local, shard):
        bad.append(f"rank {rank} local {local} != {shard}")
    if tuple(dt.placements) != (placement,) or dt.device_mesh != mesh:
        bad.append(f"placements {dt.placements}")
    return bad

failures = {}
for placement in (Shard(0), Replicate()):
    for steps in (7, 8, 1, 0):  # uneven shards, even ones, one point, none
        for args in ((-1.5, 2.0, steps), (3, -2, steps)):
            key = f"{placement}/{args}"
            failures["linspace " + key] = check(linspace(*args, device_mesh=mesh, placements=[placement]),
                                                torch.linspace(*args), placement)
            failures["logspace " + key] = check(logspace(*args, 2.0, device_mesh=mesh, placements=[placement]),
                                                torch.logspace(*args, 2.0), placement)
            failures["logspace base10 " + key] = check(logspace(*args, device_mesh=mesh, placements=[placement]),
                                                       torch.logspace(*args), placement)
    failures[f"float64 {placement}"] = check(
        linspace(0.0, 1.0, 5, dtype=torch.float64, device_mesh=mesh, placements=[placement]),
        torch.linspace(0.0, 1.0, 5, dtype=torch.float64), placement)
    failures[f"complex {placement}"] = check(  # gloo gathers no complex tensors: the shards only
        linspace(0, 1 + 2j, 5, device_mesh=mesh, placements=[placement]), torch.linspace(0, 1 + 2j, 5), placement,
        gather=False)
    failures[f"tensor ends {placement}"] = check(
        logspace(torch.tensor(-1.0), torch.tensor(1.0), 9, 3.0, device_mesh=mesh, placements=[placement]),
        torch.logspace(-1.0, 1.0, 9, 3.0), placement)

grad = linspace(0.0, 1.0, 6, requires_grad=True, device_mesh=mesh, placements=[Shard(0)])
plain = linspace(0.0, 1.0, 6, device_mesh=mesh)  # default placements: Replicate on each mesh dimension
errors = {}
for name, call in {"1-d start": lambda: linspace(torch.tensor([0.0]), 1.0, 4, device_mesh=mesh),
                   "1-d end": lambda: logspace(0.0, torch.tensor([1.0, 2.0]), 4, device_mesh=mesh),
                   "placements": lambda: linspace(0.0, 1.0, 4, device_mesh=mesh, placements=[Shard(0), Shard(0)]),
                   "layout": lambda: linspace(0.0, 1.0, 4, device_mesh=mesh, layout=torch.sparse_coo)}.items():
    try:
        call()
        errors[name] = None
    except (RuntimeError, AssertionError) as exc:
        errors[name] = f"{type(exc).__name__}: {exc}"
mine = {"failures": {k: v for k, v in failures.items() if v}, "cases": len(failures),
        "grad": [isinstance(grad, DTensor), grad.requires_grad, grad.is_leaf, grad.to_local().requires_grad],
        "default": [tuple(plain.placements) == (Replicate(),), plain.dtype == torch.get_default_dtype()],
        "errors": errors}
gathered = [None] * world
dist.all_gather_object(gathered, mine)
if rank == 0:
    print("%s" + json.dumps(gathered), flush=True)
""" % RESULT + LEAVE_WITHOUT_TEARDOWN


@through_patch_range("dtensor-linspace-logspace", "torch 2.14 has them natively")
def test_linspace_logspace_on_two_ranks(tmp_path):
    for rank in ranks_result(SCRIPT, env=clean_env(TORCHPATCH="1"), tmp_path=tmp_path):
        assert rank["failures"] == {} and rank["cases"] == 54, rank["failures"]
        assert rank["grad"] == [True, True, True, True] and rank["default"] == [True, True]
        errors = rank["errors"]
        assert errors["1-d start"] == "RuntimeError: linspace only supports 0-dimensional start and end tensors"
        assert errors["1-d end"] == "RuntimeError: logspace only supports 0-dimensional start and end tensors"
        assert errors["placements"] == "AssertionError: mesh dimension does not match the length of placements"
        assert errors["layout"] == "AssertionError: layout value not supported!"


IMPORT = "from torch.distributed.tensor import linspace, logspace"


@where_patch_applies("dtensor-linspace-logspace", "torch 2.14 brought them")
def test_native_import_error():
    proc = run_py(IMPORT)
    assert "ImportError: cannot import name 'linspace' from 'torch.distributed.tensor'" in proc.stderr, proc.stderr[-2000:]


@where_patch_does_not_apply("dtensor-linspace-logspace", "torch's own")
@only_torch(">=2.14")
def test_inactive_where_torch_has_them():
    out = run_json(
        IMPORT + "\nimport json, torchpatch, torch.distributed.tensor._api as api\n"
        "print(json.dumps({'own': linspace is api.linspace and logspace is api.logspace,"
        " 'status': torchpatch.status().get('dtensor-linspace-logspace')}))",
        env=clean_env(TORCHPATCH="1"),
    )
    assert out == {"own": True, "status": None}
