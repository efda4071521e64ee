"""funcol-autograd: gradients through the functional collectives on 2 real ranks (gloo).

Each rank's loss weights the collective's output with its own random weights; every rank can make
every rank's data and weights, so the right gradient of each rank's input is computed locally
(float64 sums over 2 ranks, which addition order cannot change: exact equality). On torch
2.4-2.12 without the patch (TORCHPATCH unset, or the patch switched off) all_reduce("sum") hands
each rank its own weights back, reduce_scatter zeros for the chunks it did not keep, and
all_to_all_single with uneven splits and an all_reduce used without ``.wait()`` leave ``x.grad``
None; with TORCHPATCH=1 all are right, forward values unchanged.

all_reduce and all_reduce_coalesced with "avg", "max" and "min" get torch 2.15's gradients: each
rank's is compared with autograd's on every rank's input stacked in one process (mean, amax, amin;
amax and amin split a gradient evenly among tied elements, as 2.15 splits it among the ranks that
hold the extremum: the inputs tie at every other element, checked on their own, in float64 and
bfloat16); "product", and reduce_scatter_tensor with "max", raise 2.15's error in its words. The
same script runs on torch 2.13-2.15, where the patch is not applied: 2.15.0 gives the same values
(the oracle), 2.13 refuses "avg", "max" and "min", 2.14 all but all_reduce("avg"). Not run on
2.15.0: its own all_reduce_coalesced("max"/"min") backward on gloo, which raises "one of the
variables needed for gradient computation has been modified by an inplace operation" (the op's
kernel copies the result into the outputs after the formula saved them) on a rank, or not:
then the ranks' collectives mismatch and gloo aborts. The patch waits for a CPU result first.

all_gather_tensor (gather_dim 0 and 1) and the coalesced all_reduce are
checked only where fixed: unfixed, all_gather raises (loudly) on some ranks (torch 2.4's gloo
all_gather of a tensor that requires grad, on whichever rank's result arrived after autograd took the
output; the patch waits first, on CPU), and all_reduce_coalesced of tensors that require grad crashes
a rank now and then: SIGSEGV inside the op (torch 2.4.1, 2 gloo ranks: at the 83rd and the 242nd of
6000 calls in a loop, and once in a few thousand runs of this script, CI's 2.4.1 session among
them; 6000 calls with the patch, none). test_patch_c10d_functional_ops
checks every op's gradient, the other coalesced ops included, against torch 2.13's (through
``torch.ops``: torch 2.13-2.15's own funcol.reduce_scatter_tensor_coalesced refuses its backward,
"Output 0 of GeneratedBackwardFor__c10d_functional_wait_tensor_default is a view ...").
"""

import pytest

from conftest import (
    LEAVE_WITHOUT_TEARDOWN, RESULT, clean_env, patch_applies_here, ranks_result, through_patch_range,
    torch_matches, where_patch_applies
)

SCRIPT = """
import datetime, json, torch, torch.distributed as dist
import torch.distributed._functional_collectives as funcol
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
G = dist.group.WORLD
F64 = torch.float64

def rand(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)

def waited(y):
    return y.wait() if isinstance(y, funcol.AsyncCollectiveTensor) else y

def grad_of(x, loss):
    loss.backward()
    return x.grad

out = {}
# all_reduce("sum"): y = sum_k x_k on every rank; rank k's loss is sum(w_k * y)
x = rand(rank, 5).requires_grad_()
y = waited(funcol.all_reduce(x, "sum", G))
out["all_reduce_value"] = torch.equal(y.detach(), sum(rand(k, 5) for k in range(world)))
g = grad_of(x, (rand(100 + rank, 5) * y).sum())
out["all_reduce"] = g is not None and torch.equal(g, sum(rand(100 + k, 5) for k in range(world)))

# the same, using the AsyncCollectiveTensor without .wait()
x = rand(rank, 5).requires_grad_()
g = grad_of(x, (rand(100 + rank, 5) * funcol.all_reduce(x, "sum", G)).sum())
out["all_reduce_no_wait"] = g is not None and torch.equal(g, sum(rand(100 + k, 5) for k in range(world)))

# reduce_scatter_tensor("sum", scatter_dim 0): rank r keeps chunk r of the sum
x = rand(rank, 2 * world, 3).requires_grad_()
y = waited(funcol.reduce_scatter_tensor(x, "sum", 0, G))
out["reduce_scatter_value"] = torch.equal(y.detach(), sum(rand(k, 2 * world, 3) for k in range(world)).chunk(world)[rank])
g = grad_of(x, (rand(200 + rank, 2, 3) * y).sum())
out["reduce_scatter"] = g is not None and torch.equal(g, torch.cat([rand(200 + k, 2, 3) for k in range(world)]))

# all_to_all_single with uneven splits: S[src][dst] elements go from src to dst
S = [[1 + (s + d) % 3 for d in range(world)] for s in range(world)]
def chunks(src):  # the pieces of src's input, by destination
    return rand(300 + src, sum(S[src])).split(S[src])
x = rand(300 + rank, sum(S[rank])).requires_grad_()
y = waited(funcol.all_to_all_single(x, [S[s][rank] for s in range(world)], S[rank], G))
out["all_to_all_value"] = torch.equal(y.detach(), torch.cat([chunks(s)[rank] for s in range(world)]))
v = [rand(400 + d, sum(S[s][d] for s in range(world))) for d in range(world)]  # rank d's loss weights
g = grad_of(x, (v[rank] * y).sum())
out["all_to_all"] = g is not None and torch.equal(
    g, torch.cat([v[d].split([S[s][d] for s in range(world)])[rank] for d in range(world)]))

import torchpatch
version = tuple(int(p) for p in torch.__version__.split(".")[:2])
fixed = version >= (2, 13) or torchpatch.status().get("funcol-autograd") == "applied"
if fixed:  # unfixed, the coalesced all_reduce crashes a rank now and then and a gradient through
    # all_gather raises on some ranks (the module's docstring)
    # the coalesced all_reduce of two tensors (each weighted per rank)
    xs = [rand(rank, 4).requires_grad_(), rand(10 + rank, 2 * world, 2).requires_grad_()]
    ys = [waited(t) for t in funcol.all_reduce_coalesced(xs, "sum", G)]
    (rand(600 + rank, 4) * ys[0]).sum().add((rand(610 + rank, 2 * world, 2) * ys[1]).sum()).backward()
    out["all_reduce_coalesced"] = all(x.grad is not None for x in xs) and torch.equal(
        xs[0].grad, sum(rand(600 + k, 4) for k in range(world))) and torch.equal(
        xs[1].grad, sum(rand(610 + k, 2 * world, 2) for k in range(world)))
    for dim in (0, 1):
        x = rand(rank, 2, 3).requires_grad_()
        y = waited(funcol.all_gather_tensor(x, dim, G))
        ok = torch.equal(y.detach(), torch.cat([rand(k, 2, 3) for k in range(world)], dim))
        w = [rand(500 + k, *y.shape) for k in range(world)]
        g = grad_of(x, (w[rank] * y).sum())
        out[f"all_gather_dim{dim}"] = ok and g is not None and torch.equal(g, sum(w).chunk(world, dim)[rank])

# all_reduce("avg"/"max"/"min"), which torch 2.15 differentiates: each rank's gradient against autograd's
# on every rank's input stacked in one process (mean, amax, amin: amax and amin split a gradient evenly
# among tied elements, as torch 2.15 splits it among the ranks holding the extremum)
def attempt(fn):  # fn's value, or the RuntimeError's words
    try:
        return fn()
    except RuntimeError as exc:
        return str(exc)

REDUCE = {"avg": lambda full: full.mean(0), "max": lambda full: full.amax(0), "min": lambda full: full.amin(0)}
def tied(k, salt, *shape, dtype=F64):  # rank k's input; every rank's is the same at its even elements
    t = rand(700 + 10 * salt + k, *shape)
    t.view(-1)[::2] = rand(790 + salt, *shape).view(-1)[::2]
    return t.round() if dtype != F64 else t  # bfloat16: integers, which it holds exactly
def weights(k, salt, *shape, dtype=F64):
    w = rand(800 + 10 * salt + k, *shape)
    return (w.round() if dtype != F64 else w).to(dtype)
def reference(op, salt, *shape, dtype=F64):  # every rank's gradient of the summed losses, in one process
    full = torch.stack([tied(k, salt, *shape, dtype=dtype).to(dtype) for k in range(world)]).requires_grad_()
    y = REDUCE[op](full)
    sum((weights(k, salt, *shape, dtype=dtype) * y).sum() for k in range(world)).backward()
    return full.grad
def all_reduce_grad(op, salt, dtype=F64):
    x = tied(rank, salt, 6, dtype=dtype).to(dtype).requires_grad_()
    y = waited(funcol.all_reduce(x, op, G))
    (weights(rank, salt, 6, dtype=dtype) * y).sum().backward()
    if op != "avg":  # the even elements tie on every rank: each gets its share of the summed weights
        out[f"all_reduce_{op}_ties" + ("" if dtype == F64 else "_bfloat16")] = torch.equal(
            x.grad[::2], (sum(weights(k, salt, 6, dtype=dtype) for k in range(world)) / world)[::2])
    g = x.grad
    return g is not None and g.dtype == dtype and torch.equal(g, reference(op, salt, 6, dtype=dtype)[rank])
for op in ("avg", "max", "min"):
    out[f"all_reduce_{op}"] = attempt(lambda: all_reduce_grad(op, 0))
out["all_reduce_max_bfloat16"] = attempt(lambda: all_reduce_grad("max", 3, torch.bfloat16))
if fixed:  # the coalesced form (two tensors, each with its own weights). Not "max"/"min" on torch 2.15.0
    # itself: on gloo its formula refuses them or not, rank by rank (the test's docstring)
    for op in ("avg",) if version >= (2, 15) else ("avg", "max", "min"):
        def coalesced_grad():
            xs = [tied(rank, 1, 6).requires_grad_(), tied(rank, 2, 2, 3).requires_grad_()]
            ys = [waited(t) for t in funcol.all_reduce_coalesced(xs, op, G)]
            sum((weights(rank, salt, *y.shape) * y).sum() for salt, y in zip((1, 2), ys)).backward()
            return all(torch.equal(x.grad, reference(op, salt, *x.shape)[rank]) for salt, x in zip((1, 2), xs))
        out[f"all_reduce_coalesced_{op}"] = attempt(coalesced_grad)

# reductions torch 2.15 does not differentiate: its error, in its words
ops = torch.ops._c10d_functional
def backward_of(fn):
    x = tied(rank, 0, 2 * world).requires_grad_()
    outputs = fn(x)
    sum(waited(y).sum() for y in (outputs if isinstance(outputs, list) else [outputs])).backward()
    return "no error"
out["all_reduce_product"] = attempt(lambda: backward_of(lambda x: funcol.all_reduce(x, "product", G)))
# (the op itself: on torch 2.2-2.7 gloo-reduce-scatter-op does funcol's reduce_scatter_tensor("max") as an all_reduce)
out["reduce_scatter_max"] = attempt(
    lambda: backward_of(lambda x: ops.wait_tensor(ops.reduce_scatter_tensor(x, "max", world, G.group_name))))
if fixed:
    out["all_reduce_coalesced_product"] = attempt(
        lambda: backward_of(lambda x: funcol.all_reduce_coalesced([x], "product", G)))

# without grad: torch's own AsyncCollectiveTensor, as before
with torch.no_grad():
    out["no_grad_type"] = type(funcol.all_reduce(rand(rank, 5), "sum", G)).__name__
out["status"] = torchpatch.status().get("funcol-autograd")
gathered = [None] * world
dist.all_gather_object(gathered, out)
if rank == 0:
    print(RESULT + json.dumps(gathered), flush=True)
""".replace("RESULT", repr(RESULT)) + LEAVE_WITHOUT_TEARDOWN

RIGHT = {"all_reduce_value": True, "all_reduce": True, "all_reduce_no_wait": True, "reduce_scatter_value": True,
         "reduce_scatter": True, "all_to_all_value": True, "all_to_all": True, "all_reduce_coalesced": True,
         "all_gather_dim0": True, "all_gather_dim1": True}

NEWEST = "{} backward only supports `sum`, `premul_sum`, `avg`, `max`, `min` reductions, got '{}'"  # torch 2.15's words
ONLY_SUM = "{} backward only supports 'sum' reduction, got '{}'"  # torch 2.13's (2.15's for reduce_scatter)
SUM_AND_AVG = "{} backward only supports 'sum' and 'avg' reductions, got '{}'"  # torch 2.14's all_reduce


def reductions() -> dict:
    """The reductions' gradients (True: equal to the one-process reference) or errors: torch 2.15's,
    which the patch gives on 2.4-2.12; 2.13 and 2.14 refuse what 2.15 differentiates."""
    want = {f"all_reduce_{op}": True for op in ("avg", "max", "min", "max_ties", "min_ties", "max_bfloat16",
                                                "max_ties_bfloat16")}
    want.update({f"all_reduce_coalesced_{op}": True for op in ("avg", "max", "min")})
    want.update(all_reduce_product=NEWEST.format("all_reduce", "product"),
                all_reduce_coalesced_product=NEWEST.format("all_reduce_coalesced", "product"),
                reduce_scatter_max=ONLY_SUM.format("reduce_scatter_tensor", "max"))
    if torch_matches("<2.7"):  # gloo has no AVG (gloo-avg serves funcol.all_reduce's, not the coalesced op's)
        want["all_reduce_coalesced_avg"] = "Cannot use ReduceOp.AVG with Gloo"
    if torch_matches(">=2.13,<2.15"):
        refused = SUM_AND_AVG if torch_matches(">=2.14") else ONLY_SUM
        for op in ("avg", "max", "min", "product"):
            want[f"all_reduce_coalesced_{op}"] = ONLY_SUM.format("all_reduce_coalesced", op)
            want[f"all_reduce_{op}"] = refused.format("all_reduce", op)
        want["all_reduce_max_bfloat16"] = refused.format("all_reduce", "max")
        for key in ("all_reduce_max_ties", "all_reduce_min_ties", "all_reduce_max_ties_bfloat16"):
            del want[key]
        if torch_matches(">=2.14"):  # 2.14 differentiates all_reduce("avg")
            want["all_reduce_avg"] = True
    if torch_matches(">=2.15"):  # not run (the script)
        del want["all_reduce_coalesced_max"], want["all_reduce_coalesced_min"]
    return want


@where_patch_applies("funcol-autograd", "no autograd formulas for _c10d_functional ops")
@pytest.mark.parametrize("env", [{}, {"TORCHPATCH": "1", "TORCHPATCH_FUNCOL_AUTOGRAD": "0"}], ids=["unset", "opted-out"])
def test_native_gradients_are_wrong(env, tmp_path):
    for out in ranks_result(SCRIPT, tmp_path=tmp_path, env=clean_env(**env), timeout=180):
        assert out["status"] is None
        # the forward values are right; every gradient is wrong or missing
        assert [out[k] for k in ("all_reduce_value", "reduce_scatter_value", "all_to_all_value")] == [True] * 3, out
        wrong = ("all_reduce", "all_reduce_no_wait", "reduce_scatter", "all_to_all", "all_reduce_max", "all_reduce_min",
                 "all_reduce_max_ties", "all_reduce_min_ties", "all_reduce_max_bfloat16")
        assert [out[k] for k in wrong] == [False] * len(wrong), out
        # avg: each rank's own gradient, or (2.4-2.6 without gloo-avg) gloo refuses the forward
        refused = not env and torch_matches("<2.7")
        assert out["all_reduce_avg"] in ((False, "Cannot use ReduceOp.AVG with Gloo") if refused else (False,)), out


@through_patch_range("funcol-autograd", "torch.library.register_autograd arrived in 2.4")
def test_gradients(tmp_path):
    for out in ranks_result(SCRIPT, tmp_path=tmp_path, env=clean_env(TORCHPATCH="1"), timeout=180):
        assert out.pop("status") == ("applied" if patch_applies_here("funcol-autograd") else None)
        assert out.pop("no_grad_type") == "AsyncCollectiveTensor"
        assert {k: out.pop(k) for k in list(out) if k not in RIGHT} == reductions()
        assert out == RIGHT, out
