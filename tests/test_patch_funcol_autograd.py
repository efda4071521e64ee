"""funcol-autograd: gradients through the functional collectives on 2 real ranks (gloo).

Each rank's loss weights the collective's output with its own random weights; every rank can make
every rank's data and weights, so the right gradient of each rank's input is computed locally
(float64 sums over 2 ranks, which addition order cannot change: exact equality). On torch
2.4-2.12 without the patch (TORCHPATCH unset, or the patch switched off) all_reduce("sum") hands
each rank its own weights back, reduce_scatter zeros for the chunks it did not keep, and
all_to_all_single with uneven splits and an all_reduce used without ``.wait()`` leave ``x.grad``
None; with TORCHPATCH=1 all are right, forward values unchanged, and a backward through
all_reduce("max") raises as in torch 2.13. On 2.13, 2.14 and 2.15 torch is right by itself and
the patch is not applied. all_gather_tensor (gather_dim 0 and 1) and the coalesced all_reduce are
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

from conftest import LEAVE_WITHOUT_TEARDOWN, RESULT, clean_env, only_torch, ranks_result, torch_matches

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

# a reduction without a gradient formula (in torch 2.13)
x = rand(rank, 5).requires_grad_()
try:
    waited(funcol.all_reduce(x, "max", G)).sum().backward()
    out["max_backward"] = "no error; grad " + ("None" if x.grad is None else "set")
except RuntimeError as exc:
    out["max_backward"] = str(exc)

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


@only_torch(">=2.4,<2.13", "no autograd formulas for _c10d_functional ops")
@pytest.mark.parametrize("env", [{}, {"TORCHPATCH": "1", "TORCHPATCH_FUNCOL_AUTOGRAD": "0"}], ids=["unset", "opted-out"])
def test_native_gradients_are_wrong(env, tmp_path):
    for out in ranks_result(SCRIPT, tmp_path=tmp_path, env=clean_env(**env), timeout=180):
        assert out["status"] is None
        # the forward values are right; every gradient is wrong or missing
        assert [out[k] for k in ("all_reduce_value", "reduce_scatter_value", "all_to_all_value")] == [True] * 3, out
        wrong = ("all_reduce", "all_reduce_no_wait", "reduce_scatter", "all_to_all")
        assert [out[k] for k in wrong] == [False] * len(wrong), out


@only_torch(">=2.4", "torch.library.register_autograd arrived in 2.4")
def test_gradients(tmp_path):
    for out in ranks_result(SCRIPT, tmp_path=tmp_path, env=clean_env(TORCHPATCH="1"), timeout=180):
        assert out.pop("status") == ("applied" if torch_matches("<2.13") else None)
        assert out.pop("no_grad_type") == "AsyncCollectiveTensor"
        max_backward = out.pop("max_backward")
        if torch_matches("<2.14"):  # torch 2.14 differentiates "avg", 2.15 "max" too
            assert max_backward == "all_reduce backward only supports 'sum' reduction, got 'max'"
        assert out == RIGHT, out
