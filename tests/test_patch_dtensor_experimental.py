"""dtensor-experimental: ``implicit_replication`` and ``local_map`` at
``torch.distributed.tensor.experimental``, on 2 real ranks (gloo, CPU mesh).

The same rank script runs on every torch >= 2.1: natively it shows the failure; with TORCHPATCH=1
it is served by torchpatch on 2.1 (implicit replication taught to 2.1's DTensor dispatch, local_map
backported) and 2.4 (torch's own private package under the public name); on 2.9/2.13 it is torch's
own. Every result is checked against the same computation on the global tensors, on one process.
"""

from conftest import (
    LEAVE_WITHOUT_TEARDOWN, RESULT, clean_env, only_torch, rank_result, run_json, run_ranks,
    torch_matches, where_patch_applies
)

SCRIPT = """
import json, sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
import torch.distributed._tensor as dtensor
from torch.distributed._tensor import DeviceMesh, Replicate, Shard, distribute_tensor

mesh = DeviceMesh("cpu", list(range(world)))
g = torch.arange(32, dtype=torch.float64).reshape(8, 4)  # the global tensors, the same on every rank
p = torch.linspace(-1.0, 1.0, 32, dtype=torch.float64).reshape(8, 4)
b = torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=torch.float64)

def full(x):  # the global value of a DTensor, as a plain tensor (+ 0: waits on 2.1's async result)
    return x.redistribute(mesh, [Replicate()] * mesh.ndim).to_local() + 0

def mixed_errors():  # DTensor (Shard(0), then Replicate) + plain tensor
    errs = []
    for placement in (Shard(0), Replicate()):
        try:
            distribute_tensor(g, mesh, [placement]) + p
            errs.append(None)
        except RuntimeError as exc:
            errs.append(str(exc))
    return errs

out = {"native_errors": mixed_errors()}
try:
    from torch.distributed.tensor.experimental import implicit_replication
except ImportError as exc:
    out["import_error"] = f"{type(exc).__name__}: {exc}"
else:
    import torch.distributed.tensor.experimental as exp
    private = sys.modules.get("torch.distributed._tensor.experimental")
    out["served_by"] = getattr(exp, "__torchpatch__", None)
    out["module"] = exp.__name__
    out["same_as_private"] = None if private is None else (
        exp is private and implicit_replication is private.implicit_replication)
    checks = {}
    for name, placement in (("shard", Shard(0)), ("replicate", Replicate())):
        dt = distribute_tensor(g, mesh, [placement])
        acc = distribute_tensor(g.clone(), mesh, [placement])  # Replicate may keep g itself as local
        leaf = distribute_tensor(g.clone(), mesh, [placement]).detach().requires_grad_()
        with implicit_replication():
            add, radd = dt + p, p + dt
            mul = dt * b                        # a broadcast plain operand
            mm = torch.mm(dt, p.t())            # a plain weight
            where = torch.where(dt > 10, dt, p)
            ret = acc.add_(p)                   # in place on the DTensor
            (leaf * p + b).sum().backward()     # the backward's own ops mix them too
        checks[name] = {
            "placements": [str(tuple(x.placements)) for x in (add, radd, mul)],
            "add": torch.equal(full(add), g + p), "radd": torch.equal(full(radd), p + g),
            "mul": torch.equal(full(mul), g * b), "mm": torch.allclose(full(mm), g @ p.t()),
            "where": torch.equal(full(where), torch.where(g > 10, g, p)),
            "inplace": ret is acc and acc.placements == dt.placements and torch.equal(full(acc), g + p),
            "grad": torch.equal(full(leaf.grad), p),
        }
    out["checks"] = checks
    out["errors_after"] = mixed_errors()

    if out["served_by"]:  # torch 2.1: the switch a later patch may hold on; contexts restore it
        from torchpatch.patches.dtensor.dtensor_experimental import replicate_plain_tensors
        was = replicate_plain_tensors(True)
        try:
            with implicit_replication():
                pass
            out["switch"] = [was, mixed_errors()]
        finally:
            replicate_plain_tensors(was)
        out["switch"].append(mixed_errors())

    from torch.distributed.tensor.experimental import local_map
    out["local_map_module"] = local_map.__module__

    def mm_allreduce(w, x):  # written for plain tensors: a local matmul, then the sum over ranks
        y = torch.mm(w, x)
        dist.all_reduce(y)
        return y

    w, x = g.t().contiguous(), p  # (4, 8) @ (8, 4), contracted over the sharded dimension
    f = local_map(mm_allreduce, out_placements=[Replicate()], in_placements=([Shard(1)], [Shard(0)]),
                  device_mesh=mesh)
    w_dt, x_dt = distribute_tensor(w, mesh, [Shard(1)]), distribute_tensor(x, mesh, [Shard(0)])
    y = f(w_dt, x_dt)
    lm = {"mm": [isinstance(y, dtensor.DTensor), str(tuple(y.placements)), torch.allclose(full(y), w @ x)]}
    try:
        f(w_dt, distribute_tensor(x, mesh, [Replicate()]))
        lm["mismatch"] = None
    except ValueError as exc:
        lm["mismatch"] = "redistribute_inputs=True" in str(exc)
    scale = local_map(lambda t, s: (t * s, t.shape[0]), out_placements=([Shard(0)], None),
                      in_placements=([Shard(0)], None), redistribute_inputs=True)
    scaled, rows = scale(distribute_tensor(g, mesh, [Replicate()]), 3.0)  # resharded to Shard(0)
    lm["redistributed"] = [str(tuple(scaled.placements)), torch.equal(full(scaled), g * 3.0),
                           rows == g.shape[0] // world]
    plain_out = local_map(torch.add, out_placements=[Shard(0)])(g, p)  # no DTensor in: plain out
    lm["plain"] = type(plain_out) is torch.Tensor and torch.equal(plain_out, g + p)
    out["local_map"] = lm

tp = sys.modules.get("torchpatch")
out["status"] = tp.status().get("dtensor-experimental") if tp else None
results = [None] * world
dist.all_gather_object(results, out)
if rank == 0:
    print(RESULT + json.dumps({"ranks_agree": all(r == results[0] for r in results), **results[0]}), flush=True)
""".replace("RESULT", repr(RESULT)) + LEAVE_WITHOUT_TEARDOWN

MIXED = "got mixed torch.Tensor and DTensor, need to convert all torch.Tensor to DTensor"
EXPECTED_CHECKS = {
    name: {"placements": [placements] * 3, "add": True, "radd": True, "mul": True, "mm": True, "where": True,
           "inplace": True, "grad": True}
    for name, placements in (("shard", "(Shard(dim=0),)"), ("replicate", "(Replicate(),)"))
}
EXPECTED_LOCAL_MAP = {"mm": [True, "(Replicate(),)", True], "mismatch": True,
                      "redistributed": ["(Shard(dim=0),)", True, True], "plain": True}


def assert_mixed_errors(errors):
    assert len(errors) == 2 and all(e is not None and "aten.add.Tensor" in e and MIXED in e for e in errors), errors


def assert_replicates(out):
    assert out["ranks_agree"]
    assert_mixed_errors(out["native_errors"])
    assert out["checks"] == EXPECTED_CHECKS
    assert_mixed_errors(out["errors_after"])  # only inside the context
    assert out["local_map"] == EXPECTED_LOCAL_MAP


@where_patch_applies("dtensor-experimental", "2.1-2.4 lack torch.distributed.tensor.experimental")
def test_native_failure(tmp_path):
    out = rank_result(run_ranks(SCRIPT, env=clean_env(), tmp_path=tmp_path))
    assert out["ranks_agree"]
    assert out["import_error"] == "ModuleNotFoundError: No module named 'torch.distributed.tensor.experimental'"
    assert_mixed_errors(out["native_errors"])


@where_patch_applies("dtensor-experimental")
def test_served(tmp_path):
    # Automatic replication (dtensor-implicit-replication) off: the native error outside the context.
    proc = run_ranks(SCRIPT, env=clean_env(TORCHPATCH="1", TORCHPATCH_DISABLE="dtensor-implicit-replication"),
                     tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = rank_result(proc)
    assert_replicates(out)
    assert out["status"] == "applied"
    assert out["module"] == "torch.distributed._tensor.experimental" and out["same_as_private"] is True
    if torch_matches("<2.2"):  # served by torchpatch, whose switch other patches may hold on
        assert out["served_by"] == "dtensor-experimental"
        assert out["local_map_module"] == "torchpatch.patches.dtensor.dtensor_experimental"
        assert out["switch"][0] is False
        assert out["switch"][1] == [None, None]  # still on after leaving a context entered while on
        assert_mixed_errors(out["switch"][2])
    else:  # torch's own package under the public name
        assert out["served_by"] is None
        assert out["local_map_module"] == "torch.distributed._tensor.experimental.local_map"


@only_torch(">=2.5", "torch's own torch.distributed.tensor.experimental: the reference, patch inactive")
def test_native_where_torch_has_it(tmp_path):
    # Automatic replication (dtensor-implicit-replication) off: the native error outside the context.
    proc = run_ranks(SCRIPT, env=clean_env(TORCHPATCH="1", TORCHPATCH_DISABLE="dtensor-implicit-replication"),
                     tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = rank_result(proc)
    assert_replicates(out)
    assert out["status"] is None and out["served_by"] is None
    assert out["module"] == "torch.distributed.tensor.experimental" and out["same_as_private"] in (True, None)
    assert out["local_map_module"] == "torch.distributed.tensor.experimental"


@where_patch_applies("dtensor-experimental")
def test_opt_out():
    out = run_json(
        """
        import json, sys, torch, torch.distributed._tensor
        from torchpatch.patches.dtensor.dtensor_experimental import _replicating_dispatch
        try:
            import torch.distributed.tensor.experimental
            error = None
        except ModuleNotFoundError as exc:
            error = str(exc)
        dispatch = sys.modules.get("torch.distributed._tensor.dispatch")  # torch 2.1's
        wrapped = getattr(getattr(dispatch, "_operator_dispatch", None), "_self_wrapper", None) is _replicating_dispatch
        print(json.dumps({"error": error, "wrapped": wrapped}))
        """,
        env=clean_env(TORCHPATCH="1", TORCHPATCH_DTENSOR_EXPERIMENTAL="0"),
    )
    assert out == {"error": "No module named 'torch.distributed.tensor.experimental'", "wrapped": False}


@only_torch("<2.1", "torch 1.13 has no DTensor: the patch does not apply")
def test_not_applied_without_dtensor():
    out = run_json(
        """
        import json, torch, torchpatch
        try:
            import torch.distributed.tensor.experimental
            error = None
        except ModuleNotFoundError as exc:
            error = exc.name
        print(json.dumps({"error": error, "status": torchpatch.status().get("dtensor-experimental")}))
        """,
        env=clean_env(TORCHPATCH="1"),
    )
    assert out["error"] is not None and out["error"].startswith("torch.distributed") and out["status"] is None
