"""functional-collectives: the module served on torch 1.13, its missing functions on 2.1, the names of
torch 2.13 (``*_single``) before 2.13 and ``wait_tensors`` before 2.15.

One 2-rank gloo script computes every case twice, with the functions the module offers (torch's,
torchpatch's where served) and with torchpatch's implementation imported directly, and compares each
with a one-process reference made from every rank's deterministic input. On 2.13 the module is torch's
own, which checks the references (and so the shim's semantics) against the reference torch.
"""

import pytest

from conftest import RESULT, clean_env, only_torch, rank_result, run_json, run_py, run_ranks, torch_matches

MODULE = "torch.distributed._functional_collectives"
NAMES = ["all_reduce", "all_gather_tensor", "reduce_scatter_tensor", "all_to_all_single",
         "all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced", "all_reduce_coalesced",
         "wait_tensor", "broadcast", "permute_tensor"]

# The module's all_reduce(x, "max") in backward (torchpatch's shim refuses it as torch 2.13 does):
# torch 2.14 differentiates "avg" too and says so refusing "max": https://github.com/pytorch/pytorch/pull/190224
# (commit 3869cbbc24bf2595f8ad9fcca7452828574fcc79); torch 2.15 differentiates "min" and "max" (None here:
# the gradient goes to the ranks that hold the maximum, split among ties):
# https://github.com/pytorch/pytorch/pull/190942
if torch_matches(">=2.15"):
    NATIVE_MAX_GRAD_ERROR = None
elif torch_matches(">=2.14"):
    NATIVE_MAX_GRAD_ERROR = "RuntimeError: all_reduce backward only supports 'sum' and 'avg' reductions, got 'max'"
else:
    NATIVE_MAX_GRAD_ERROR = "RuntimeError: all_reduce backward only supports 'sum' reduction, got 'max'"

SCRIPT = r"""
import json, os, warnings
from torch.distributed._functional_collectives import all_gather_tensor, reduce_scatter_tensor  # as OpenDiT
import torch, torch.distributed as dist
import torch.distributed._functional_collectives as module
from torchpatch.patches.collectives.functional_collectives import FUNCTIONS

warnings.simplefilter("ignore")  # torch 2.13 deprecates the *_tensor names in favour of *_single
dist.init_process_group("gloo")
me, G = dist.get_rank(), dist.get_world_size()
WORLD = dist.group.WORLD
singles = [dist.new_group([r]) for r in range(G)]
mesh = None
try:
    from torch.distributed.device_mesh import DeviceMesh
except ImportError:
    try:
        from torch.distributed._tensor import DeviceMesh
    except ImportError:
        DeviceMesh = None
if DeviceMesh is not None:
    mesh = DeviceMesh("cpu", torch.arange(G))

def data(r, shape, salt=0):
    # every rank's input, computable on any rank
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 * salt + r))

X = [data(r, (4, 3)) for r in range(G)]
C = [data(r, (8, 3), 1) for r in range(G)]      # per-rank loss weights
REDUCE = {"sum": lambda t: t.sum(0), "avg": lambda t: t.mean(0), "max": lambda t: t.max(0).values,
          "min": lambda t: t.min(0).values, "product": lambda t: t.prod(0)}
def reduce(ts, op):
    return REDUCE[op](torch.stack(ts))

def grad_of(fn, x):
    # gradient of this rank's x, every rank's loss summed (the distributed backward sums them)
    x = x.clone().requires_grad_()
    fn(x).backward()
    return x.grad

cases = []  # (name, tag, functions used, run(F) -> tensor(s), expected, or {implementation: expected})
# tags: "core": torch's own functions pass it from 2.1 on; "new": torch's from 2.13 on (2.1-2.9 lack
# autograd here, or fail on gloo); "shim": torchpatch's extensions (torch raises, or passes gradients
# through broadcast unchanged)
def case(name, tag, fns, run, want):
    cases.append((name, tag, fns, run, want))

# -- numerics ------------------------------------------------------------------------------------
for op in REDUCE:
    case(f"all_reduce_{op}", "new" if op == "avg" else "core", ["all_reduce"],
         lambda F, op=op: F["all_reduce"](X[me], op, WORLD), reduce(X, op))
case("all_reduce_input_unchanged", "core", ["all_reduce"],
     lambda F: (F["all_reduce"](X[me], "sum", WORLD), X[me])[1], data(me, (4, 3)))
case("all_gather_dim0", "core", ["all_gather_tensor"], lambda F: F["all_gather_tensor"](X[me], 0, WORLD), torch.cat(X))
case("all_gather_dim1", "core", ["all_gather_tensor"], lambda F: F["all_gather_tensor"](X[me], 1, WORLD), torch.cat(X, 1))
case("all_gather_noncontiguous", "new", ["all_gather_tensor"],
     lambda F: F["all_gather_tensor"](X[me].t(), 0, WORLD), torch.cat([x.t() for x in X]))
case("all_gather_scalar", "shim", ["all_gather_tensor"],
     lambda F: F["all_gather_tensor"](X[me][0, 0], 0, WORLD), torch.stack([x[0, 0] for x in X]))
for op in ("sum", "max", "avg"):
    case(f"reduce_scatter_{op}", "new" if op == "avg" else "core", ["reduce_scatter_tensor"],
         lambda F, op=op: F["reduce_scatter_tensor"](X[me], op, 0, WORLD), reduce([x.chunk(G)[me] for x in X], op))
Y = [data(r, (3, 4), 2) for r in range(G)]
case("reduce_scatter_dim1", "core", ["reduce_scatter_tensor"],
     lambda F: F["reduce_scatter_tensor"](Y[me], "sum", 1, WORLD), reduce([y.chunk(G, 1)[me] for y in Y], "sum"))
case("all_to_all_even", "core", ["all_to_all_single"],
     lambda F: F["all_to_all_single"](X[me], None, None, WORLD), torch.cat([x.chunk(G)[me] for x in X]))
SPLITS = [[1 + r + 2 * q for q in range(G)] for r in range(G)]   # rank r sends SPLITS[r][q] rows to q
U = [data(r, (sum(SPLITS[r]), 3), 3) for r in range(G)]
case("all_to_all_uneven", "core", ["all_to_all_single"],
     lambda F: F["all_to_all_single"](U[me], [SPLITS[q][me] for q in range(G)], SPLITS[me], WORLD),
     torch.cat([U[q].split(SPLITS[q])[me] for q in range(G)]))
case("broadcast_src1", "core", ["broadcast"], lambda F: F["broadcast"](X[me], 1, WORLD), X[1])
case("broadcast_src_is_group_rank", "core", ["broadcast"], lambda F: F["broadcast"](X[me], 0, singles[me]), X[me])
PERM = [(r + 1) % G for r in range(G)]                           # rank r sends to PERM[r]
case("permute_tensor_1d", "core", ["permute_tensor"],
     lambda F: F["permute_tensor"](X[me][0], PERM, WORLD), X[PERM.index(me)][0])
case("permute_tensor_2d", "shim", ["permute_tensor"], lambda F: F["permute_tensor"](X[me], PERM, WORLD), X[PERM.index(me)])
case("wait_tensor", "core", ["wait_tensor", "all_reduce"],
     lambda F: F["wait_tensor"](F["all_reduce"](X[me], "sum", WORLD)), reduce(X, "sum"))
case("wait_tensor_of_all_to_all", "core", ["wait_tensor", "all_to_all_single"],
     lambda F: F["wait_tensor"](F["all_to_all_single"](X[me], None, None, WORLD)), torch.cat([x.chunk(G)[me] for x in X]))
case("all_reduce_coalesced", "core", ["all_reduce_coalesced"],
     lambda F: F["all_reduce_coalesced"]([X[me], Y[me]], "sum", WORLD), [reduce(X, "sum"), reduce(Y, "sum")])
case("all_gather_into_tensor_coalesced", "core", ["all_gather_into_tensor_coalesced"],
     lambda F: F["all_gather_into_tensor_coalesced"]([X[me], Y[me]], WORLD), [torch.cat(X), torch.cat(Y)])
case("reduce_scatter_tensor_coalesced", "new", ["reduce_scatter_tensor_coalesced"],
     lambda F: F["reduce_scatter_tensor_coalesced"]([X[me], Y[me]], "sum", [0, 1], WORLD),
     [reduce([x.chunk(G)[me] for x in X], "sum"), reduce([y.chunk(G, 1)[me] for y in Y], "sum")])

# -- group forms ---------------------------------------------------------------------------------
case("group_rank_list", "core", ["all_gather_tensor"], lambda F: F["all_gather_tensor"](X[me], 0, list(range(G))), torch.cat(X))
case("group_existing_subgroup_by_ranks", "core", ["all_reduce"], lambda F: F["all_reduce"](X[me], "sum", [me]), X[me])
case("group_nested_lists", "shim", ["all_reduce"], lambda F: F["all_reduce"](X[me], "sum", [[r] for r in range(G)]), X[me])
case("group_nested_world", "shim", ["all_to_all_single"],
     lambda F: F["all_to_all_single"](X[me], None, None, [list(range(G))]), torch.cat([x.chunk(G)[me] for x in X]))
case("group_none_is_an_error", "core", ["all_reduce"], lambda F: F["all_reduce"](X[me], "sum", None), "ValueError")
if mesh is not None:
    case("group_device_mesh", "core", ["all_gather_tensor"], lambda F: F["all_gather_tensor"](X[me], 0, mesh), torch.cat(X))
    case("group_mesh_dim", "core", ["reduce_scatter_tensor"],
         lambda F: F["reduce_scatter_tensor"](X[me], "sum", 0, (mesh, 0)), reduce([x.chunk(G)[me] for x in X], "sum"))

# -- gradients: differentiable as in torch 2.13 ---------------------------------------------------
def loss_sum(per_rank):
    return sum(per_rank(r) for r in range(G))
case("grad_all_gather", "new", ["all_gather_tensor"],
     lambda F: grad_of(lambda x: (F["all_gather_tensor"](x, 1, WORLD) * C[me].view(4, 6)).sum(), X[me]),
     grad_of(lambda x: loss_sum(lambda r: (torch.cat([x if q == me else X[q] for q in range(G)], 1) * C[r].view(4, 6)).sum()), X[me]))
case("grad_reduce_scatter", "new", ["reduce_scatter_tensor"],
     lambda F: grad_of(lambda x: (F["reduce_scatter_tensor"](x, "sum", 0, WORLD) * C[me][:2]).sum(), X[me]),
     grad_of(lambda x: loss_sum(lambda r: (sum((x if q == me else X[q]).chunk(G)[r] for q in range(G)) * C[r][:2]).sum()), X[me]))
case("grad_all_reduce", "new", ["all_reduce"],
     lambda F: grad_of(lambda x: (F["all_reduce"](x, "sum", WORLD) * C[me][:4]).sum(), X[me]), sum(c[:4] for c in C))
case("grad_all_to_all_uneven", "new", ["all_to_all_single"],
     lambda F: grad_of(lambda u: (F["all_to_all_single"](u, [SPLITS[q][me] for q in range(G)], SPLITS[me], WORLD) ** 2).sum(), U[me]),
     grad_of(lambda u: loss_sum(lambda r: (torch.cat([(u if q == me else U[q]).split(SPLITS[q])[r] for q in range(G)]) ** 2).sum()), U[me]))
TOP = reduce(X, "max")
case("grad_all_reduce_max", "new", ["all_reduce"],
     lambda F: grad_of(lambda x: (F["all_reduce"](x, "max", WORLD) * C[me][:4]).sum(), X[me]),
     {"module": NATIVE_MAX_GRAD_ERROR or torch.where(X[me] == TOP, sum(c[:4] for c in C) / (torch.stack(X) == TOP).sum(0), 0.0),
      "torchpatch": "RuntimeError: all_reduce backward only supports 'sum' reduction, got 'max'"})
case("grad_broadcast_to_source", "shim", ["broadcast"],
     lambda F: grad_of(lambda x: (F["broadcast"](x, 1, WORLD) * C[me][:4]).sum(), X[me]),
     sum(c[:4] for c in C) if me == 1 else torch.zeros(4, 3))

# -- OpenDiT's pattern: all_gather in a custom Function's forward, reduce_scatter in its backward --
def gather_linear(F):
    class GatherLinear(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            full = F["all_gather_tensor"](x.unsqueeze(0), 0, WORLD)     # (G, rows, in)
            ctx.save_for_backward(full, w)
            return full.flatten(0, 1) @ w
        @staticmethod
        def backward(ctx, grad):
            full, w = ctx.saved_tensors
            grad_full = (grad @ w.t()).view(full.shape)
            grad_x = F["reduce_scatter_tensor"](grad_full, "sum", 0, WORLD).squeeze(0)
            return grad_x, full.flatten(0, 1).t() @ grad
    return GatherLinear
W = data(0, (3, 5), 4)
K = [data(r, (8, 5), 5) for r in range(G)]
def custom_function(F):
    x, w = X[me].clone().requires_grad_(), W.clone().requires_grad_()
    out = gather_linear(F).apply(x, w)
    (out * K[me]).sum().backward()
    return [out.detach(), x.grad, w.grad]
def custom_reference():
    xs, w = [x.clone().requires_grad_() for x in X], W.clone().requires_grad_()
    out = torch.cat(xs) @ w
    (w_grad,) = torch.autograd.grad((out * K[me]).sum(), w, retain_graph=True)  # w is per rank
    loss_sum(lambda r: (out * K[r]).sum()).backward()                            # x is sharded
    return [out.detach(), xs[me].grad, w_grad]
case("custom_autograd_function", "core", ["all_gather_tensor", "reduce_scatter_tensor"], custom_function, custom_reference())

# -- run every case with the module's functions and with torchpatch's own ---------------------------
def outcome(run, F, want):
    try:
        got = run(F)
        got = [g * 1 for g in (got if isinstance(got, list) else [got])]  # torch's async results wait here
    except Exception as exc:
        text = f"{type(exc).__name__}: {exc}".splitlines()[0]
        return isinstance(want, str) and text.startswith(want) or text[:300]
    if isinstance(want, str):
        return f"no error, wanted {want}"
    want = want if isinstance(want, list) else [want]
    for g, w in zip(got, want):
        if tuple(g.shape) != tuple(w.shape) or not torch.allclose(g, w, atol=1e-5):
            return f"got {g.tolist()} want {w.tolist()}"
    return len(got) == len(want)

impls = {"module": {n: getattr(module, n, None) for n in FUNCTIONS}, "torchpatch": FUNCTIONS}
served = sorted(n for n, fn in impls["module"].items() if fn is FUNCTIONS[n])
# torch's own functions skip the "shim" cases (torch 2.4.1 even segfaults gathering a 0-d tensor on gloo)
mine = {impl: {name: outcome(run, F, want[impl] if isinstance(want, dict) else want) for name, tag, fns, run, want in cases
               if impl == "torchpatch" or tag != "shim" or set(fns) <= set(served)}
        for impl, F in impls.items()}
every = [None] * G
dist.all_gather_object(every, mine)
results = {impl: {name: next((f"rank {r}: {ranks[impl][name]}" for r, ranks in enumerate(every)
                              if ranks[impl][name] is not True), True)
                  for name in mine[impl]} for impl in mine}
if me == 0:
    print(RESULT + json.dumps({
        "results": results, "tags": {name: tag for name, tag, _, _, _ in cases},
        "uses": {name: fns for name, _, fns, _, _ in cases}, "served": served,
        "whole_module": getattr(module, "__torchpatch__", None), "has_mesh": mesh is not None,
    }), flush=True)
dist.destroy_process_group()
# torch 2.4.1 sometimes aborts at interpreter exit ("terminate called without an active exception")
# after its own functional collectives failed on gloo (the "new" cases); nothing is left to do here.
os._exit(0)
""".replace("RESULT", repr(RESULT)).replace("NATIVE_MAX_GRAD_ERROR", repr(NATIVE_MAX_GRAD_ERROR))


def failures(out: dict, impl: str, must) -> dict:
    return {name: got for name, got in out["results"][impl].items() if must(name) and got is not True}


@pytest.fixture(scope="module")
def served_run(tmp_path_factory) -> dict:
    proc = run_ranks(SCRIPT, env=clean_env(TORCHPATCH="1"), tmp_path=tmp_path_factory.mktemp("fc"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return rank_result(proc)


def test_torchpatch_implementation_matches_the_references(served_run):
    # On every torch: numerics, group forms, gradients and the custom-Function pattern.
    assert failures(served_run, "torchpatch", lambda name: True) == {}
    assert served_run["has_mesh"] == torch_matches(">=2.1")


@only_torch("<2.0", "torch 1.13 has no torch.distributed._functional_collectives")
def test_native_module_missing():
    proc = run_py("from torch.distributed._functional_collectives import all_gather_tensor, reduce_scatter_tensor")
    assert "ModuleNotFoundError: No module named 'torch.distributed._functional_collectives'" in proc.stderr


@only_torch("<2.0")
def test_whole_module_served(served_run):
    # The script's OpenDiT-like import worked; every function is torchpatch's.
    assert served_run["whole_module"] == "functional-collectives"
    assert served_run["served"] == sorted(NAMES)
    assert failures(served_run, "module", lambda name: True) == {}


@only_torch(">=2.0,<2.4", "torch 2.1 lacks all_to_all_single, broadcast and permute_tensor")
def test_native_members_missing():
    proc = run_py("from torch.distributed._functional_collectives import all_to_all_single")
    assert "ImportError: cannot import name 'all_to_all_single'" in proc.stderr


@only_torch(">=2.0,<2.4")
def test_missing_members_served_next_to_torch_ones(served_run):
    assert served_run["whole_module"] is None
    assert served_run["served"] == ["all_to_all_single", "broadcast", "permute_tensor"]
    served = set(served_run["served"])
    out = failures(served_run, "module",
                   lambda name: served_run["tags"][name] == "core" or set(served_run["uses"][name]) <= served)
    assert out == {}  # torch 2.1's own functions pass the core cases too


@only_torch(">=2.4", "torch has all ten functions")
def test_native_functions_match_the_references(served_run):
    # The module is torch's: the same references hold for it. 2.13 also runs avg on gloo and has
    # autograd (the "new" cases); the "shim" cases are torchpatch's extensions. (torch 2.4's gloo
    # reduce_scatter sums whatever the op: right here through gloo-reduce-scatter-op.)
    assert served_run["served"] == [] and served_run["whole_module"] is None
    tags = ("core", "new") if torch_matches(">=2.13") else ("core",)
    out = failures(served_run, "module", lambda name: served_run["tags"][name] in tags)
    assert out == {}


IDENTITY = """
import inspect, json, torch, torch.distributed._functional_collectives as m, torchpatch
from torchpatch.patches.collectives.functional_collectives import FUNCTIONS
def params(fn):
    return [[p.name, str(p.kind), repr(p.default)] for p in inspect.signature(fn).parameters.values()]
print(json.dumps({"functions": {n: [getattr(m, n).__module__, getattr(m, n).__code__.co_filename,
                                    getattr(m, n).__code__.co_firstlineno] for n in NAMES},
                  "same_signatures": {n: params(getattr(m, n)) == params(FUNCTIONS[n]) for n in NAMES},
                  "status": torchpatch.status().get("functional-collectives")}))
""".replace("NAMES", repr(NAMES))


@only_torch(">=2.4", "torch has all ten functions: torchpatch serves only the newer names (until 2.15)")
def test_torch_functions_kept_where_torch_has_them():
    patched = run_json(IDENTITY, env=clean_env(TORCHPATCH="1"))
    native = run_json(IDENTITY)
    assert patched["functions"] == native["functions"]
    assert all(module == MODULE for module, _, _ in patched["functions"].values())
    assert patched["status"] == ("not needed" if torch_matches(">=2.15") else "applied") and native["status"] is None
    assert patched["same_signatures"] == {name: True for name in NAMES}  # torchpatch's match torch's


# torch 2.13's new names -> the old name computing the same (2.13's *_autograd call the plain function)
RENAMED = {"all_gather_single": "all_gather_tensor", "all_gather_single_autograd": "all_gather_tensor",
           "reduce_scatter_single": "reduce_scatter_tensor", "reduce_scatter_single_autograd": "reduce_scatter_tensor",
           "all_gather_single_coalesced": "all_gather_into_tensor_coalesced",
           "reduce_scatter_single_coalesced": "reduce_scatter_tensor_coalesced"}

RENAMED_SCRIPT = r"""
import json, warnings, torch, torch.distributed as dist
import torch.distributed._functional_collectives as funcol
warnings.simplefilter("ignore", FutureWarning)  # the old names are deprecated from 2.13 on
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
both = dist.new_group(list(range(world)))

def data(r, rows=4):
    return torch.randn(rows, 3, generator=torch.Generator().manual_seed(20 + r), dtype=torch.float64)

def waited(t):
    return t.wait() if hasattr(t, "wait") else t

def run(name, group, grad):  # (result, gradient of the input) of one function on this rank's data
    x = data(rank).requires_grad_(grad)
    fn = getattr(funcol, name)
    if "coalesced" in name:
        args = ([x, 2 * x], group) if name.startswith("all_gather") else ([x, 2 * x], "sum", [0, 0], group)
        return [waited(y).detach() for y in fn(*args)], None
    y = waited(fn(x, 0, group) if name.startswith("all_gather") else fn(x, "sum", 0, group))
    if not x.requires_grad:
        return y, None
    (y * torch.arange(y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
    return y.detach(), x.grad

everyone = [data(r) for r in range(world)]
reference = {  # one process with every rank's tensor
    "all_gather": torch.cat(everyone),
    "reduce_scatter": sum(everyone).chunk(world)[rank],
    "all_gather_coalesced": [torch.cat(everyone), torch.cat([2 * t for t in everyone])],
    "reduce_scatter_coalesced": [sum(everyone).chunk(world)[rank], (2 * sum(everyone)).chunk(world)[rank]],
}
out = {}
for group_name, group in (("default", dist.group.WORLD), ("both", both)):
    for new, old in RENAMED.items():
        grad = new.endswith("_autograd")
        (y_new, g_new), (y_old, g_old) = run(new, group, grad), run(old, group, grad)
        ref = reference[new.split("_single")[0] + ("_coalesced" if "coalesced" in new else "")]
        same = (all(torch.equal(a, b) for a, b in zip(y_new, y_old)) if isinstance(y_new, list)
                else torch.equal(y_new, y_old) and (g_new is None) == (g_old is None) and (g_new is None or torch.equal(g_new, g_old)))
        right = (all(torch.allclose(a, b, rtol=1e-12, atol=0) for a, b in zip(y_new, ref)) if isinstance(y_new, list)
                 else torch.allclose(y_new, ref, rtol=1e-12, atol=0))
        out[f"{group_name}/{new}"] = [same, right]
    # the gradient of all_gather: the sum over ranks of the output gradient's rows of this rank
    _, grad = run("all_gather_single_autograd", group, True)
    weights = torch.arange(4 * world * 3, dtype=torch.float64).view(4 * world, 3)
    out[f"{group_name}/all_gather_grad"] = torch.allclose(grad, world * weights[4 * rank:4 * rank + 4], rtol=1e-12, atol=0)
ys = [funcol.all_reduce(data(rank), "sum", both), funcol.all_reduce(2 * data(rank), "sum", both)]
waited_list = funcol.wait_tensors(ys)
out["wait_tensors"] = [len(waited_list) == 2, torch.equal(waited(waited_list[0]), sum(everyone)),
                       torch.equal(waited(waited_list[1]), 2 * sum(everyone))]
gathered = [None] * world
dist.all_gather_object(gathered, out)
if rank == 0:
    print(RESULT + json.dumps(gathered), flush=True)
import os
dist.barrier()
os._exit(0)
""".replace("RESULT", repr(RESULT)).replace("RENAMED", repr(RENAMED))


@only_torch(">=2.4", "served before 2.13 (wait_tensors before 2.15), then torch's own (2.15: the reference)")
def test_new_names_compute_what_the_old_names_and_one_process_do(tmp_path):
    ranks = rank_result(run_ranks(RENAMED_SCRIPT, tmp_path=tmp_path, env=clean_env(TORCHPATCH="1")))
    for out in ranks:
        assert len(out) == 2 * len(RENAMED) + 3 and all(v is True or all(v) for v in out.values()), out


NEW_NAMES = """
import json, torch.distributed._functional_collectives as funcol
print(json.dumps([hasattr(funcol, name) for name in NAMES]))
""".replace("NAMES", repr(list(RENAMED) + ["wait_tensors"]))


@only_torch(">=2.4,<2.15", "torch 2.4-2.12 lack the new names, 2.13-2.14 wait_tensors")
def test_new_names_missing_natively_served_with_torchpatch():
    assert not all(run_json(NEW_NAMES, env=clean_env()))
    assert all(run_json(NEW_NAMES, env=clean_env(TORCHPATCH="1")))
