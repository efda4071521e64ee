"""c10d-functional-ops: ``torch.ops._c10d_functional`` registered on torch 2.1 with torch 2.4's schemas.

One 2-rank gloo script calls every op with ``group.group_name`` and compares each result with the
same collective done through ``torch.distributed`` (or, where gloo has none, with the value computed
from every rank's deterministic input). The script is torch-agnostic: on torch 2.4 and 2.13 it runs
torch's native ops, which checks the references and the served ops' semantics against torch.
"""

from conftest import (
    LEAVE_WITHOUT_TEARDOWN, RESULT, clean_env, only_torch, rank_result, run_json, run_py, run_ranks,
    torch_matches, where_patch_applies
)

SCHEMAS_2_4 = {  # torch 2.4.1's, read with torch.ops._c10d_functional.<op>.default._schema
    "all_gather_into_tensor": "(Tensor input, int group_size, str group_name) -> Tensor",
    "all_gather_into_tensor_coalesced": "(Tensor[] inputs, int group_size, str group_name) -> Tensor[]",
    "all_gather_into_tensor_out": "(Tensor input, int group_size, str group_name, *, Tensor(a!) out) -> Tensor(a!)",
    "all_reduce": "(Tensor input, str reduce_op, str group_name) -> Tensor",
    "all_reduce_": "(Tensor(a!) input, str reduce_op, str group_name) -> Tensor(a!)",
    "all_reduce_coalesced": "(Tensor[] inputs, str reduce_op, str group_name) -> Tensor[]",
    "all_reduce_coalesced_": "(Tensor[](a!) inputs, str reduce_op, str group_name) -> Tensor[](a!)",
    "all_to_all_single": "(Tensor input, SymInt[] output_split_sizes, SymInt[] input_split_sizes, str group_name) -> Tensor",
    "broadcast": "(Tensor input, int src, str group_name) -> Tensor",
    "broadcast_": "(Tensor(a!) input, int src, str group_name) -> Tensor(a!)",
    "reduce_scatter_tensor": "(Tensor input, str reduce_op, int group_size, str group_name) -> Tensor",
    "reduce_scatter_tensor_coalesced": "(Tensor[] inputs, str reduce_op, int group_size, str group_name) -> Tensor[]",
    "wait_tensor": "(Tensor tensor) -> Tensor",
}

SCRIPT = r"""
import datetime, json, torch, torch.distributed as dist
import torch.distributed._functional_collectives  # torch 2.13 registers the ops' Meta kernels there
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
me, G = dist.get_rank(), dist.get_world_size()
ops = torch.ops._c10d_functional
SAVE = {ops.reduce_scatter_tensor.default, ops.all_gather_into_tensor.default}  # as torchtitan does
WORLD = dist.group.WORLD
pair = dist.new_group(list(range(G)))
singles = [dist.new_group([r]) for r in range(G)]
W, P, S = WORLD.group_name, pair.group_name, singles[me].group_name

def data(r, shape, salt=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(1000 * salt + r)
    if dtype == torch.int64:
        return torch.randint(0, 1 << 20, shape, generator=g)
    return torch.randn(shape, generator=g, dtype=dtype)

X = [data(r, (4, 3)) for r in range(G)]
Y = [data(r, (6, 2), 1) for r in range(G)]
I = [data(r, (5,), 2, torch.int64) for r in range(G)]

def via_dist(t, op):  # the same reduction through torch.distributed
    t = t.clone()
    dist.all_reduce(t, op=op)
    return t

def gathered(t, group=None):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t, group=group)
    return torch.cat(parts)

checks = {}
def check(name, fn, want):
    try:
        got = fn()  # waited for, as torch requires of these ops' results before use
        got = [ops.wait_tensor(t) for t in got] if isinstance(got, list) else ops.wait_tensor(got)
    except Exception as exc:
        checks[name] = f"{type(exc).__name__}: {exc}"
        return
    if isinstance(want, list):
        checks[name] = len(got) == len(want) and all(torch.equal(g, w) if g.dtype == torch.int64 else torch.allclose(g, w)
                                                     for g, w in zip(got, want))
    else:
        checks[name] = (torch.equal(got, want) if got.dtype == torch.int64 else torch.allclose(got, want)) and got.shape == want.shape

Op = dist.ReduceOp
for name, op in (("sum", Op.SUM), ("max", Op.MAX), ("min", Op.MIN), ("product", Op.PRODUCT)):
    check(f"all_reduce_{name}", lambda name=name: ops.all_reduce(X[me], name, W), via_dist(X[me], op))
for name, op in (("band", Op.BAND), ("bor", Op.BOR), ("bxor", Op.BXOR)):
    check(f"all_reduce_{name}", lambda name=name: ops.all_reduce(I[me], name, W), via_dist(I[me], op))
check("all_reduce_avg", lambda: ops.all_reduce(X[me], "avg", W), torch.stack(X).mean(0))
check("all_reduce_input_unchanged", lambda: (ops.wait_tensor(ops.all_reduce(X[me], "sum", W)), X[me])[1], data(me, (4, 3)))
check("all_reduce_subgroup", lambda: ops.all_reduce(X[me], "sum", S), X[me])
inplace = X[me].clone()
check("all_reduce_", lambda: ops.all_reduce_(inplace, "sum", P), via_dist(X[me], Op.SUM))
checks["all_reduce__in_place"] = torch.allclose(inplace, via_dist(X[me], Op.SUM))
check("all_reduce_coalesced", lambda: ops.all_reduce_coalesced([X[me], Y[me]], "sum", W), [via_dist(X[me], Op.SUM), via_dist(Y[me], Op.SUM)])
both = [X[me].clone(), Y[me].clone()]
check("all_reduce_coalesced_", lambda: ops.all_reduce_coalesced_(both, "max", W), [via_dist(X[me], Op.MAX), via_dist(Y[me], Op.MAX)])
checks["all_reduce_coalesced__in_place"] = torch.allclose(both[1], via_dist(Y[me], Op.MAX))

check("all_gather_into_tensor", lambda: ops.all_gather_into_tensor(X[me], G, W), gathered(X[me]))
check("all_gather_into_tensor_subgroup", lambda: ops.all_gather_into_tensor(X[me], 1, S), X[me])
out_buffer = torch.empty(4 * G, 3, dtype=torch.float64)
check("all_gather_into_tensor_out", lambda: ops.all_gather_into_tensor_out(X[me], G, W, out=out_buffer), gathered(X[me]))
checks["all_gather_into_tensor_out_filled"] = torch.equal(out_buffer, gathered(X[me]))
check("all_gather_into_tensor_coalesced", lambda: ops.all_gather_into_tensor_coalesced([X[me], Y[me]], G, P),
      [gathered(X[me]), gathered(Y[me])])

for name in ("sum", "max", "avg"):
    want = {"sum": torch.stack(X).sum(0), "max": torch.stack(X).max(0).values, "avg": torch.stack(X).mean(0)}[name]
    check(f"reduce_scatter_tensor_{name}", lambda name=name: ops.reduce_scatter_tensor(X[me], name, G, W), want.chunk(G)[me])
check("reduce_scatter_tensor_via_dist", lambda: ops.reduce_scatter_tensor(Y[me], "sum", G, W), via_dist(Y[me], Op.SUM).chunk(G)[me])
check("reduce_scatter_tensor_coalesced", lambda: ops.reduce_scatter_tensor_coalesced([X[me], Y[me]], "sum", G, W),
      [via_dist(X[me], Op.SUM).chunk(G)[me], via_dist(Y[me], Op.SUM).chunk(G)[me]])

a2a = torch.empty_like(X[me])
dist.all_to_all_single(a2a, X[me].clone())
check("all_to_all_single_even", lambda: ops.all_to_all_single(X[me], [4 // G] * G, [4 // G] * G, W), a2a)
SPLITS = [[1 + r + 2 * q for q in range(G)] for r in range(G)]  # rank r sends SPLITS[r][q] rows to q
U = [data(r, (sum(SPLITS[r]), 3), 3) for r in range(G)]
check("all_to_all_single_uneven", lambda: ops.all_to_all_single(U[me], [SPLITS[q][me] for q in range(G)], SPLITS[me], W),
      torch.cat([U[q].split(SPLITS[q])[me] for q in range(G)]))

src1 = X[me].clone()
dist.broadcast(src1, src=1)
check("broadcast", lambda: ops.broadcast(X[me], 1, W), src1)
check("broadcast_src_is_group_rank", lambda: ops.broadcast(X[me], 0, S), X[me])  # rank 0 of {me} is me
target = X[me].clone()
check("broadcast_", lambda: ops.broadcast_(target, 0, P), X[0])
checks["broadcast__in_place"] = torch.equal(target, X[0])
plain = torch.ones(3)
checks["wait_tensor_returns_argument"] = ops.wait_tensor(plain) is plain

# Gradients (torch 2.13's formulas): every rank's loss weighs its outputs by its own weights, and the
# distributed backward sums those losses' gradients over ranks.
grads = {}
def weight(r, shape, k):
    return data(r, shape, 10 + k)
def grad_check(name, fn, inputs, want):
    try:
        xs = [t.clone().requires_grad_() for t in inputs]
        outs = fn(*xs)
        outs = outs if isinstance(outs, list) else [outs]
        sum((ops.wait_tensor(o) * weight(me, o.shape, k)).sum() for k, o in enumerate(outs)).backward()
        grads[name] = all(torch.allclose(x.grad, w) for x, w in zip(xs, want))
    except Exception as exc:
        grads[name] = f"{type(exc).__name__}: {exc}"
every_rank = range(G)
grad_check("all_reduce", lambda x: ops.all_reduce(x, "sum", W), [X[me]], [sum(weight(r, (4, 3), 0) for r in every_rank)])
top = torch.stack(X).max(0).values  # torch 2.15's gradient of "max": to the ranks holding it, split among ties
grad_check("all_reduce_max", lambda x: ops.all_reduce(x, "max", W), [X[me]],
           [torch.where(X[me] == top, sum(weight(r, (4, 3), 0) for r in every_rank) / (torch.stack(X) == top).sum(0), 0.0)])
grad_check("all_gather_into_tensor", lambda x: ops.all_gather_into_tensor(x, G, W), [X[me]],
           [sum(weight(r, (4 * G, 3), 0) for r in every_rank).chunk(G)[me]])
grad_check("reduce_scatter_tensor", lambda x: ops.reduce_scatter_tensor(x, "sum", G, W), [X[me]],
           [torch.cat([weight(r, (4 // G, 3), 0) for r in every_rank])])
grad_check("reduce_scatter_tensor_avg", lambda x: ops.reduce_scatter_tensor(x, "avg", G, W), [X[me]], None)
grad_check("all_to_all_single", lambda u: ops.all_to_all_single(u, [SPLITS[q][me] for q in range(G)], SPLITS[me], W), [U[me]],
           [torch.cat([weight(q, (sum(SPLITS[p][q] for p in every_rank), 3), 0).split([SPLITS[p][q] for p in every_rank])[me]
                       for q in every_rank])])
grad_check("all_reduce_coalesced", lambda x, y: ops.all_reduce_coalesced([x, y], "sum", W), [X[me], Y[me]],
           [sum(weight(r, (4, 3), 0) for r in every_rank), sum(weight(r, (6, 2), 1) for r in every_rank)])
grad_check("all_gather_into_tensor_coalesced", lambda x, y: ops.all_gather_into_tensor_coalesced([x, y], G, W), [X[me], Y[me]],
           [sum(weight(r, (4 * G, 3), 0) for r in every_rank).chunk(G)[me], sum(weight(r, (6 * G, 2), 1) for r in every_rank).chunk(G)[me]])
grad_check("reduce_scatter_tensor_coalesced", lambda x, y: ops.reduce_scatter_tensor_coalesced([x, y], "sum", G, W), [X[me], Y[me]],
           [torch.cat([weight(r, (4 // G, 3), 0) for r in every_rank]), torch.cat([weight(r, (6 // G, 2), 1) for r in every_rank])])

m = torch.empty(4, 3, device="meta")
checks["meta_shapes"] = [list(ops.all_gather_into_tensor(m, G, W).shape), list(ops.reduce_scatter_tensor(m, "sum", G, W).shape),
                         list(ops.all_to_all_single(m, [1, 5], [2, 2], W).shape), list(ops.all_reduce(m, "sum", W).shape)]

def error(fn):
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
errors = {
    "unknown_group": error(lambda: ops.all_reduce(X[me], "sum", "no-such-group")),
    "reduce_op_case": error(lambda: ops.all_reduce(X[me], "SUM", W)),
}
result = {
    "checks": checks, "grads": grads, "errors": errors, "names": [W, P, S],
    "schemas": {name: str(getattr(ops, name).default._schema) for name in %(names)r},
    "save_list_is_op_overloads": all(type(op).__name__ == "OpOverload" for op in SAVE),
}
try:
    import torchpatch
    result["status"] = torchpatch.status().get("c10d-functional-ops")
except ImportError:
    result["status"] = None
every = [None] * G
dist.all_gather_object(every, result)
if me == 0:
    print(RESULT + json.dumps(dict(result, every_rank=every)), flush=True)
""".replace("RESULT", repr(RESULT)).replace("%(names)r", repr(sorted(SCHEMAS_2_4))) + LEAVE_WITHOUT_TEARDOWN

EXPECTED_CHECKS = {
    "all_reduce_sum", "all_reduce_max", "all_reduce_min", "all_reduce_product", "all_reduce_band", "all_reduce_bor",
    "all_reduce_bxor", "all_reduce_avg", "all_reduce_input_unchanged", "all_reduce_subgroup", "all_reduce_",
    "all_reduce__in_place", "all_reduce_coalesced", "all_reduce_coalesced_", "all_reduce_coalesced__in_place",
    "all_gather_into_tensor", "all_gather_into_tensor_subgroup", "all_gather_into_tensor_out",
    "all_gather_into_tensor_out_filled", "all_gather_into_tensor_coalesced", "reduce_scatter_tensor_sum",
    "reduce_scatter_tensor_max", "reduce_scatter_tensor_avg", "reduce_scatter_tensor_via_dist",
    "reduce_scatter_tensor_coalesced", "all_to_all_single_even", "all_to_all_single_uneven", "broadcast",
    "broadcast_src_is_group_rank", "broadcast_", "broadcast__in_place", "wait_tensor_returns_argument",
}

EXPECTED_GRADS = {
    name: True for name in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single",
                            "all_reduce_coalesced", "all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced")
}
EXPECTED_GRADS.update({
    "all_reduce_max": "RuntimeError: all_reduce backward only supports 'sum' reduction, got 'max'",
    "reduce_scatter_tensor_avg": "RuntimeError: reduce_scatter_tensor backward only supports 'sum' reduction, got 'avg'",
})
if torch_matches(">=2.15") or torch_matches(">=2.4,<2.13"):  # torch 2.15 differentiates "min" and "max"
    # (https://github.com/pytorch/pytorch/pull/190942); funcol-autograd gives 2.15's formulas on 2.4-2.12
    EXPECTED_GRADS["all_reduce_max"] = True
elif torch_matches(">=2.14"):  # torch 2.14 differentiates all_reduce("avg") too, and says so refusing "max":
    # https://github.com/pytorch/pytorch/pull/190224 (commit 3869cbbc24bf2595f8ad9fcca7452828574fcc79)
    EXPECTED_GRADS["all_reduce_max"] = "RuntimeError: all_reduce backward only supports 'sum' and 'avg' reductions, got 'max'"


def run(tmp_path):
    out = rank_result(run_ranks(SCRIPT, env=clean_env(TORCHPATCH="1"), tmp_path=tmp_path))
    every = out.pop("every_rank")
    assert len(every) == 2
    for rank, rank_out in enumerate(every):
        checks = rank_out["checks"]
        meta = checks.pop("meta_shapes")
        failed = {k: v for k, v in checks.items() if v is not True}
        if torch_matches(">=2.4,<2.5"):  # torch 2.4's own ops on gloo: no AVG, reduce_scatter ignores max
            assert set(failed) == {"all_reduce_avg", "reduce_scatter_tensor_max", "reduce_scatter_tensor_avg"}, failed
            assert failed["all_reduce_avg"] == "RuntimeError: Cannot use ReduceOp.AVG with Gloo"
            failed = {}
        assert not failed, failed
        assert set(checks) == EXPECTED_CHECKS
        assert meta == [[8, 3], [2, 3], [6, 3], [4, 3]]
        assert rank_out["errors"] == {
            "unknown_group": "RuntimeError: Could not resolve the process group registered under the name no-such-group",
            "reduce_op_case": "RuntimeError: Unrecognized reduce_op: SUM",
        }
        assert rank_out["names"] == ["0", "1", str(2 + rank)]  # default group, then new_group order
        assert rank_out["save_list_is_op_overloads"] is True
        # the gradients: torch 2.13's served with the ops on 2.1, 2.15's by funcol-autograd on 2.4-2.12, native from 2.13
        assert rank_out["grads"] == EXPECTED_GRADS, rank_out["grads"]
    return every[0]


@where_patch_applies("c10d-functional-ops", "torch 2.1 has only the c10d_functional ops of the (tag, ranks, group_size) schema")
def test_native_failure():
    proc = run_py("import torch; torch.ops._c10d_functional.reduce_scatter_tensor.default")
    assert ("AttributeError: '_OpNamespace' '_c10d_functional' object has no attribute 'reduce_scatter_tensor'"
            in proc.stderr), proc.stderr[-2000:]
    proc = run_py("import torch.distributed as dist; dist.ProcessGroup.group_name")
    assert "has no attribute 'group_name'" in proc.stderr


@where_patch_applies("c10d-functional-ops")
def test_served_ops_on_two_ranks(tmp_path):
    out = run(tmp_path)
    assert out["status"] == "applied"
    assert out["schemas"] == {name: f"_c10d_functional::{name}{schema}" for name, schema in SCHEMAS_2_4.items()}


@only_torch(">=2.4", "the reference: torch's native _c10d_functional ops")
def test_native_ops_agree(tmp_path):
    out = run(tmp_path)
    assert out["status"] is None
    if torch_matches("<2.10"):  # the schemas served on 2.1 are 2.4's (as 2.9's; 2.13 types group_name as Any)
        assert out["schemas"] == {name: f"_c10d_functional::{name}{schema}" for name, schema in SCHEMAS_2_4.items()}


@where_patch_applies("c10d-functional-ops")
def test_uninstall_takes_the_ops_back():
    out = run_json(
        """
        import json, torch, torch.distributed as dist, torchpatch
        before = torch.ops._c10d_functional.all_reduce.default
        try:  # a group c10d did not make has no name, as on torch 2.13
            dist.ProcessGroup(0, 1).group_name  # (rank, size): torch 2.1's constructor
        except RuntimeError as exc:
            unnamed = str(exc)
        torchpatch.uninstall()
        print(json.dumps({
            "had": type(before).__name__, "unnamed": unnamed,
            "after": hasattr(torch.ops._c10d_functional, "all_reduce"),
            "group_name": hasattr(dist.ProcessGroup, "group_name"),
        }))
        """,
        env=clean_env(TORCHPATCH="1"),
    )
    assert out == {"had": "OpOverload", "unnamed": "ProcessGroup name not set", "after": False, "group_name": False}


@only_torch("<2.1", "torch 1.13: no functional collectives ops at all, nothing served")
def test_nothing_on_old_torch():
    out = run_json(
        """
        import json, torch, torchpatch
        print(json.dumps({"has": hasattr(torch.ops._c10d_functional, "all_reduce"),
                          "status": torchpatch.status().get("c10d-functional-ops")}))
        """,
        env=clean_env(TORCHPATCH="1"),
    )
    assert out == {"has": False, "status": None}
