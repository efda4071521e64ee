"""dtensor-empty-shard-reduction: reductions over a dimension whose shard is empty on one rank (a
tensor of 1 row ``Shard(0)`` over 2 ranks), on 2 real ranks (gloo, CPU mesh).

Natively the rank with the empty shard (rank 1) raises in its local op while rank 0 returns a
pending result and would wait in its next collective for rank 1 (the hang; on torch 2.13+ rank 0
waits inside ``argmax``/``argmin`` themselves, whose handler gathers: there rank 0 runs them only
after rank 1 returned, and is reported as waiting). The ranks never wait here: after each op every
rank posts its outcome to the store and reads the other's, and only when both returned does the script gather the result (a collective) and compare it with the op on
the global tensor, computed in the same run. With TORCHPATCH=1 both ranks raise torch 2.15's error
(type and words, the ones rank 1 raises alone natively); the reductions torch 2.13+ computes by
gathering first (``max(dim)``, ``min(dim)``, ``aminmax``) give their value on every torch.
"""

import pytest

from conftest import (
    DTENSOR_RANK_SETUP, LEAVE_WITHOUT_TEARDOWN, RESULT, clean_env, ranks_result, torch_matches,
    where_patch_applies
)

SCRIPT = DTENSOR_RANK_SETUP + """
import builtins
store = dist.PrefixStore("empty-shard-reduction", dist.distributed_c10d._get_default_store())
ONE = torch.tensor([[1.0, -3.0, 2.0]])  # 1 row: rank 1's shard of Shard(0) is empty
THREE = torch.tensor([[1.0, -3.0, 2.0], [4.0, 0.5, -1.0], [2.0, 7.0, -6.0]])  # uneven, none empty

cases = {  # name: (global tensor, op)
    "amax0": (ONE, lambda x: x.amax(0)), "amax": (ONE, lambda x: x.amax()),
    "amin0": (ONE, lambda x: x.amin(dim=0, keepdim=True)), "amin": (ONE, lambda x: torch.amin(x)),
    "max": (ONE, lambda x: x.max()), "min": (ONE, lambda x: x.min()),
    "argmax0": (ONE, lambda x: x.argmax(0)), "argmin0": (ONE, lambda x: x.argmin(0)), "argmax": (ONE, lambda x: x.argmax()),
    "max0": (ONE, lambda x: x.max(0)), "min0": (ONE, lambda x: x.min(dim=0)),
    "aminmax0": (ONE, lambda x: torch.aminmax(x, dim=0)), "aminmax": (ONE, lambda x: torch.aminmax(x)),
    "norm_inf": (ONE, lambda x: torch.linalg.vector_norm(x, float("inf"))),  # clip_grad_norm_(norm_type=inf)
    # not reducing an empty shard: a value
    "sum0": (ONE, lambda x: x.sum(0)), "max_uneven": (THREE, lambda x: x.max()),
}

def full(x):
    if isinstance(x, DTensor):
        return x.full_tensor()
    if isinstance(x, tuple):
        return [full(t) for t in x]
    return x

def describe(exc):  # torch's type and words (torchpatch's note cut off), checked as that builtin type
    name = type(exc).__name__
    words = str(exc).split(" (torchpatch")[0].split("\\n")[0]
    return f"{name}: {words}" if isinstance(exc, getattr(builtins, name, ())) else f"not a {name}: {words}"

import torchpatch
applied = torchpatch.status().get("dtensor-empty-shard-reduction") == "applied"
handlers = getattr(DTensor._op_dispatcher, "_custom_op_handlers", {})
# torch 2.13+ computes argmax/argmin in a handler that gathers inside the op: natively rank 0 would
# wait in it for rank 1, which raised, so rank 0 only runs them once rank 1 returned
in_op_collective = set() if applied or torch.ops.aten.argmax.default not in handlers else {"argmax0", "argmin0", "argmax"}
out = {}
for name, (tensor, op) in cases.items():
    dt = distribute_tensor(tensor, mesh, [Shard(0)])
    if rank == 0 and name in in_op_collective and store.get(f"{name}/1").decode() != "returned":
        result, mine = None, "waits"
    else:
        try:
            result = op(dt)
            mine = "returned"
        except Exception as exc:
            result, mine = None, describe(exc)
    store.set(f"{name}/{rank}", mine)
    outcomes = [store.get(f"{name}/{r}").decode() for r in range(world)]
    if all(o == "returned" for o in outcomes):  # every rank has a result: gathering it cannot hang
        got, ref = full(result), full(op(tensor))
        same = all(torch.equal(g, r) for g, r in zip(got, ref)) if isinstance(ref, list) else torch.equal(got, ref)
        out[name] = "ok" if same else f"wrong: {got} != {ref}"
    else:
        out[name] = outcomes
out["status"] = torchpatch.status().get("dtensor-empty-shard-reduction")
if rank == 0:
    print(RESULT + json.dumps(out), flush=True)
""".replace("RESULT", repr(RESULT)) + LEAVE_WITHOUT_TEARDOWN

_NO_DIM = "Expected reduction dim to be specified for input.numel() == 0. Specify the reduction dim with the 'dim' argument."
WORDS = {  # torch 2.15.0's error on the rank whose shard is empty
    "amax0": "IndexError: amax(): Expected reduction dim 0 to have non-zero size.",
    "amax": f"RuntimeError: amax(): {_NO_DIM}",
    "amin0": "IndexError: amin(): Expected reduction dim 0 to have non-zero size.",
    "amin": f"RuntimeError: amin(): {_NO_DIM}",
    "max": f"RuntimeError: max(): {_NO_DIM}",
    "min": f"RuntimeError: min(): {_NO_DIM}",
    # 2.13+'s argmax/argmin handler takes the shard's max/min first
    "argmax0": "IndexError: max(): Expected reduction dim 0 to have non-zero size.",
    "argmin0": "IndexError: min(): Expected reduction dim 0 to have non-zero size.",
    "argmax": f"RuntimeError: max(): {_NO_DIM}",
    "norm_inf": "RuntimeError: linalg.vector_norm cannot compute the inf norm on an empty tensor because the "
                "operation does not have an identity",
}
GATHERED = ("max0", "min0", "aminmax0", "aminmax")  # torch 2.13+ gathers the reduced dim first: a value
VALUES = ("sum0", "max_uneven")


def _no_strategy() -> set:
    """The ops this torch has no sharding strategy for (NotImplementedError on every rank natively;
    dtensor-op-fallback gathers them, a value, with TORCHPATCH=1)."""
    if torch_matches("<2.5"):
        return {"amax0", "amax", "amin0", "amin", "argmax0", "argmin0", "argmax", "aminmax0", "aminmax"}
    return {"argmax0", "argmin0", "argmax", "aminmax0", "aminmax"} if torch_matches("<2.13") else set()


def _expected(patched: bool, others: bool) -> dict:
    """What each case gives: ``patched`` (this patch on), ``others`` (the rest of torchpatch on)."""
    expected = dict.fromkeys(VALUES, "ok")
    for name in GATHERED:
        expected[name] = "ok"
    if torch_matches("<2.13") and not others:  # 2.4/2.9 reduce max(dim) on each shard natively
        expected["max0"] = ["returned", "IndexError: max(): Expected reduction dim 0 to have non-zero size."]
        expected["min0"] = ["returned", "IndexError: min(): Expected reduction dim 0 to have non-zero size."]
    for name, words in WORDS.items():
        expected[name] = [words, words] if patched else ["returned", words]
        if not patched and name.startswith("arg") and torch_matches(">=2.13"):
            expected[name] = ["waits", words]  # rank 0 would wait inside the op (its gather)
    for name in _no_strategy():
        expected[name] = "ok" if others else "NotImplementedError"
    if patched and torch_matches("<2.13"):
        for name in ("max0", "min0"):
            expected[name] = "ok"
    return expected


def _run(tmp_path, **env) -> dict:
    out = ranks_result(SCRIPT, tmp_path=tmp_path, env=clean_env(**env), timeout=240)
    for name, value in out.items():  # both ranks: no strategy (names differ per op)
        if isinstance(value, list) and all(v.startswith("NotImplementedError: ") for v in value):
            out[name] = "NotImplementedError"
    return out


@where_patch_applies("dtensor-empty-shard-reduction", "every torch tried: the rank with the empty shard raises alone")
@pytest.mark.parametrize("env", [{}, {"TORCHPATCH": "1", "TORCHPATCH_DTENSOR_EMPTY_SHARD_REDUCTION": "0"}], ids=["unset", "opted-out"])
def test_native_only_the_empty_rank_raises(tmp_path, env):
    out = _run(tmp_path, **env)
    assert out.pop("status") is None
    assert out == _expected(patched=False, others=bool(env)), out


@where_patch_applies("dtensor-empty-shard-reduction", "DTensor's sharding propagation as the patch knows it")
def test_every_rank_raises_torchs_error(tmp_path):
    out = _run(tmp_path, TORCHPATCH="1")
    assert out.pop("status") == "applied"
    assert out == _expected(patched=True, others=True), out
