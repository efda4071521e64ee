"""dtensor-partial: ``Partial("sum")``, ``Partial(reduce_op="max")``, ... on 2 real ranks (gloo, CPU mesh).

The same rank script runs on every torch >= 2.1 (torchpatch's ``Partial`` on 2.1, torch's own from
2.4) and checks each reduction against the one computed on one process from every rank's input.
"""

from conftest import (
    LEAVE_WITHOUT_TEARDOWN, RESULT, clean_env, only_torch, patch_applies_here, rank_result, run_json,
    run_ranks, through_patch_range, torch_matches, where_patch_applies
)

SCRIPT = """
import copy, importlib, json, os, pickle, torch, torch.distributed as dist, torchpatch
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
from torch.distributed._tensor import DTensor, Partial, Replicate, Shard, init_device_mesh
from torch.distributed._tensor.placement_types import Partial as from_placement_types
from torch.distributed.tensor import Partial as public
import torch.distributed._tensor.placement_types as placement_types
if not hasattr(placement_types, "_Partial"):  # from 2.5 a re-export of the public module, without _Partial
    placement_types = importlib.import_module("torch.distributed.tensor.placement_types")
_Partial = placement_types._Partial  # torch's own partial placement class (2.4 and later: Partial itself)

def plain(t):  # torch 2.1's to_local can hand back an AsyncCollectiveTensor; clone() waits
    return t.clone()

def local_input(r):  # every rank's input is known to every rank: the reference is local
    return torch.arange(12.0).reshape(4, 3) * (r + 1) - 5 * r

mesh = init_device_mesh("cpu", (world,))
gloo_limits = os.environ["TORCH_GLOO_PARTIAL_LIMITS"] == "1"
inputs = torch.stack([local_input(r) for r in range(world)])
reference = {"sum": inputs.sum(0), "avg": inputs.mean(0), "product": inputs.prod(0),
             "min": inputs.amin(0), "max": inputs.amax(0)}
cases = [("Partial()", Partial(), "sum"), ("Partial('sum')", Partial("sum"), "sum"),
         ("Partial(reduce_op='max')", Partial(reduce_op="max"), "max"), ("Partial('avg')", Partial("avg"), "avg"),
         ("Partial('min')", Partial("min"), "min"), ("Partial(reduce_op='product')", Partial(reduce_op="product"), "product")]
results = {}
for label, placement, op in cases:
    ref = reference[op]
    if op == "avg" and gloo_limits:
        continue
    d = DTensor.from_local(local_input(rank), mesh, [placement])
    rep = d.redistribute(mesh, [Replicate()])
    results[label] = {"replicate": torch.allclose(plain(rep.to_local()), ref), "full_tensor": torch.allclose(d.full_tensor(), ref),
                      "placements": tuple(rep.placements) == (Replicate(),)}
    if op != "sum" and gloo_limits:
        continue
    sh0, sh1 = d.redistribute(mesh, [Shard(0)]), d.redistribute(mesh, [Shard(1)])
    results[label].update({
        "shard0": torch.allclose(plain(sh0.to_local()), ref.chunk(world, 0)[rank]),
        "shard1_uneven": torch.allclose(plain(sh1.to_local()), ref.chunk(world, 1)[rank]),
        "shard_placements": [tuple(sh0.placements), tuple(sh1.placements)] == [(Shard(0),), (Shard(1),)],
    })

x = DTensor.from_local(local_input(rank), mesh, [Shard(0)])
made_by_torch = {"sum": x.sum().placements[0], "mean": x.mean().placements[0]}
native = _Partial()
out = {
    "results": results,
    "same_object": [public is Partial, from_placement_types is Partial],
    "equal_to_torch_placements": [Partial() == native, native == Partial(), hash(Partial()) == hash(native),
                                  made_by_torch["sum"] == Partial("sum"), made_by_torch["mean"] == Partial("avg"),
                                  Partial("max") != Partial("sum")],
    "isinstance": [isinstance(native, Partial), isinstance(made_by_torch["sum"], Partial),
                   isinstance(Partial("max"), _Partial), Partial("max").is_partial(), not isinstance(Replicate(), Partial)],
    "sum_of_torch_partial": torch.equal(x.sum().full_tensor(), reference["sum"].sum()),
    "repr": repr(Partial("max")),
    "copies": [type(c) is Partial and c == Partial("max")
               for c in (pickle.loads(pickle.dumps(Partial("max"))), copy.deepcopy(Partial("max")))],
    "status": torchpatch.status().get("dtensor-partial"),
}
if rank == 0:
    print(RESULT + json.dumps(out), flush=True)
""".replace("RESULT", repr(RESULT)) + LEAVE_WITHOUT_TEARDOWN


@only_torch(">=2.1,<2.4", "torch 2.4 renamed _Partial to Partial")
def test_native_failure():
    proc = run_json(
        """
        import json
        try:
            from torch.distributed._tensor import Partial
        except ImportError as exc:
            print(json.dumps({"error": str(exc)}))
        """
    )
    assert "cannot import name 'Partial' from 'torch.distributed._tensor'" in proc["error"]


@through_patch_range("dtensor-partial")
def test_partial_reduces_on_two_ranks(tmp_path):
    # torch 2.4's own Partial (measured on 2.4.1; 2.9.0 gets both right) on gloo: Partial("avg")
    # raises "Cannot use ReduceOp.AVG with Gloo", and Partial("max"/"min"/"product") -> Shard sums
    # instead (its CPU reduce-scatter only sums). Not asked of it there; torchpatch's Partial on 2.1
    # goes through 2.1's all-reduce fallback, and averages as a sum then a division.
    gloo_limits = torch_matches(">=2.4,<2.9")
    env = clean_env(TORCHPATCH="1", TORCH_GLOO_PARTIAL_LIMITS="1" if gloo_limits else "0")
    proc = run_ranks(SCRIPT, env=env, tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = rank_result(proc)
    results = out["results"]
    replicate_checks = ("replicate", "full_tensor", "placements")
    shard_checks = ("shard0", "shard1_uneven", "shard_placements")
    for label, checks in results.items():
        shards = not gloo_limits or label in ("Partial()", "Partial('sum')")
        assert checks == dict.fromkeys(replicate_checks + (shard_checks if shards else ()), True), label
    assert len(results) == (5 if gloo_limits else 6)
    assert out["same_object"] == [True, True]
    assert out["equal_to_torch_placements"] == [True] * 6
    assert out["isinstance"] == [True] * 5
    assert out["sum_of_torch_partial"]
    assert out["repr"] == "Partial(max)"
    assert out["copies"] == [True, True]
    # Served on 2.1-2.3; on 2.4 only as torch.distributed.tensor.Partial; not armed from 2.5.
    assert out["status"] == ("applied" if patch_applies_here("dtensor-partial") else None)


@only_torch(">=2.1,<2.4", "the checks of torchpatch's own Partial class")
def test_reduce_op_names_and_errors():
    out = run_json(
        """
        import json, torch.distributed as dist
        from torch.distributed._tensor import Partial
        errors = {}
        for bad in ("premul_sum", "mean", 3):
            try:
                Partial(bad)
            except ValueError as exc:
                errors[str(bad)] = str(exc)
        print(json.dumps({
            "errors": errors,
            "spellings": [Partial("MAX") == Partial("max"), Partial(dist.ReduceOp.MAX) == Partial("max"),
                          Partial(reduce_op="avg").reduce_op == dist.ReduceOp.AVG],
            "module": [Partial.__module__, Partial.__qualname__, Partial.__mro__[1].__name__],
        }))
        """,
        env=clean_env(TORCHPATCH="1"),
    )
    assert sorted(out["errors"]) == ["3", "mean", "premul_sum"]
    for message in out["errors"].values():
        assert "the reduce ops are 'sum', 'avg', 'product', 'min', 'max'" in message
    assert out["spellings"] == [True, True, True]
    assert out["module"] == ["torch.distributed._tensor.placement_types", "Partial", "_Partial"]


@where_patch_applies("dtensor-partial")
def test_opt_out():
    out = run_json(
        """
        import json, torchpatch
        found = {}
        for stmt in ("from torch.distributed._tensor import Partial", "from torch.distributed.tensor import Partial",
                     "from torch.distributed.tensor import DTensor"):
            try:
                exec(stmt)
                found[stmt] = True
            except ImportError:
                found[stmt] = False
        print(json.dumps({"found": found, "status": {k: v for k, v in torchpatch.status().items() if k in ("dtensor-public", "dtensor-partial")}}))
        """,
        env=clean_env(TORCHPATCH="1", TORCHPATCH_DTENSOR_PARTIAL="0"),
    )
    assert out["found"] == {
        "from torch.distributed._tensor import Partial": torch_matches(">=2.4"),  # torch's own from 2.4
        "from torch.distributed.tensor import Partial": False,
        "from torch.distributed.tensor import DTensor": True,  # dtensor-public stays on
    }
    assert out["status"] == {"dtensor-public": "applied"}


@only_torch(">=2.5", "torch's own Partial: nothing is served")
def test_inactive_where_torch_has_it():
    out = run_json(
        """
        import json, torchpatch
        import torch.distributed.tensor as public, torch.distributed._tensor as private
        from torch.distributed.tensor.placement_types import Partial
        print(json.dumps({"same": [public.Partial is Partial, private.Partial is Partial],
                          "module": Partial.__module__, "status": torchpatch.status().get("dtensor-partial")}))
        """,
        env=clean_env(TORCHPATCH="1"),
    )
    assert out == {"same": [True, True], "module": "torch.distributed.tensor.placement_types", "status": None}


@only_torch("<2.1", "torch 1.13 has no DTensor")
def test_not_applied_without_dtensor():
    out = run_json(
        """
        import json, torch, torchpatch
        try:
            from torch.distributed._tensor import Partial
            found = True
        except ImportError:
            found = False
        print(json.dumps({"found": found, "status": torchpatch.status().get("dtensor-partial")}))
        """,
        env=clean_env(TORCHPATCH="1"),
    )
    assert out == {"found": False, "status": None}
