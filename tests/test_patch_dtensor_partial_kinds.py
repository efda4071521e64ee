"""dtensor-partial-kinds: DTensors with pending reductions of different kinds added together, on 2
real ranks (gloo, CPU mesh).

Every rank knows every rank's shares, so each reference (the global values, then the op) is computed
in the same run, in one process. On torch 2.4.1 and 2.9.0 natively (and with the patch switched off)
``P(sum) + P(max)`` (and on 2.4 ``P(max) + P(sum)``) comes back wrong without an error; with TORCHPATCH=1 they
are right, and what torch 2.13 refuses (``sum.add_(max)`` in place: a sum cannot stay a sum with a max
added) raises its ``AssertionError`` in its words, as torch 2.13 and later do natively (where the
patch is not applied).
"""

import pytest

from conftest import (
    DTENSOR_RANK_SETUP, LEAVE_WITHOUT_TEARDOWN, RESULT, clean_env, only_torch, patch_applies_here,
    ranks_result, through_patch_range, torch_matches
)

SCRIPT = DTENSOR_RANK_SETUP + """
def share(r, seed):  # rank r's share of a Partial; small integers: every sum is exact
    return torch.tensor([1.0, -3.0, 2.0, 5.0], dtype=torch.float64) * (r + seed) - 2 * r * seed

def partial(kind, seed):
    return DTensor.from_local(share(rank, seed), mesh, [Partial(kind)])

def full(kind, seed):
    shares = torch.stack([share(r, seed) for r in range(world)])
    return {"sum": shares.sum(0), "avg": shares.mean(0), "max": shares.amax(0), "min": shares.amin(0)}[kind]

cases = {  # name: (DTensor computation, the same on the global tensors)
    "sum+max": (lambda: partial("sum", 1) + partial("max", 2), lambda: full("sum", 1) + full("max", 2)),
    "max+sum": (lambda: partial("max", 1) + partial("sum", 2), lambda: full("max", 1) + full("sum", 2)),
    "sum-min": (lambda: partial("sum", 1) - partial("min", 2), lambda: full("sum", 1) - full("min", 2)),
    "max+max": (lambda: partial("max", 1) + partial("max", 2), lambda: full("max", 1) + full("max", 2)),
    "min-max": (lambda: torch.sub(partial("min", 1), partial("max", 2), alpha=2), lambda: full("min", 1) - 2 * full("max", 2)),
    # the same kinds stay linear: no communication, still right
    "sum+sum": (lambda: partial("sum", 1) + partial("sum", 2), lambda: full("sum", 1) + full("sum", 2)),
    # torch 2.13 refuses this one: a sum cannot stay a sum with a max added in place
    "sum.add_(max)": (lambda: partial("sum", 1).add_(partial("max", 2)), lambda: full("sum", 1) + full("max", 2)),
}
out = {}
for name, (dtensor_fn, reference_fn) in cases.items():
    try:
        got = dtensor_fn()
    except AssertionError as exc:
        words = "Redistribution from one partial type (P(max)) to another (P(sum)) is unsupported."
        out[name] = "refused" if str(exc).startswith(words) else f"error: {exc}"[:300]
        continue
    except Exception as exc:
        out[name] = f"error: {type(exc).__name__}: {exc}"[:300]
        continue
    value = got.full_tensor()
    out[name] = "ok" if torch.equal(value, reference_fn()) else f"wrong: {value.tolist()} != {reference_fn().tolist()}"
out["sum+sum placement"] = str(list((partial("sum", 1) + partial("sum", 2)).placements))
import torchpatch
out["status"] = torchpatch.status().get("dtensor-partial-kinds")
if rank == 0:
    print(RESULT + json.dumps(out), flush=True)
""".replace("RESULT", repr(RESULT)) + LEAVE_WITHOUT_TEARDOWN

MIXED = ("sum+max", "max+sum", "sum-min", "max+max", "min-max")
REFUSED = ("sum.add_(max)",)
# torch 2.13+: the mixed adds right, the conversion refused, the sum of sums kept partial
NEWEST = dict(dict.fromkeys(MIXED + ("sum+sum",), "ok"), **dict.fromkeys(REFUSED, "refused"))
NEWEST["sum+sum placement"] = "[Partial(sum)]"


def _run(tmp_path, **env) -> dict:
    return ranks_result(SCRIPT, tmp_path=tmp_path, env=clean_env(**env), timeout=240)


@only_torch(">=2.4,<2.13", "torch 2.4.1 and 2.9.0 convert one Partial into another without reducing it")
@pytest.mark.parametrize("env", [{}, {"TORCHPATCH": "1", "TORCHPATCH_DTENSOR_PARTIAL_KINDS": "0"}], ids=["unset", "opted-out"])
def test_mixed_partials_wrong_natively(tmp_path, env):
    out = _run(tmp_path, **env)
    assert out.pop("status") is None
    # the sum of a sum and a max; 2.4 also keeps a max with a sum added (2.9 reduces the max first)
    wrong = {"sum+max", "sum.add_(max)"} | ({"max+sum"} if torch_matches("<2.5") else set())
    for name in wrong:
        assert out[name].startswith("wrong"), (name, out)
    for name in set(MIXED + ("sum+sum",)) - wrong:  # subtracting, or a max first: reduced, right
        assert out[name] == "ok", (name, out)


@through_patch_range("dtensor-partial-kinds", "DTensor's pointwise strategies and redistribution as the patch knows them",
                     since="2.4")
def test_mixed_partials_as_on_the_newest_torch(tmp_path):
    out = _run(tmp_path, TORCHPATCH="1")
    assert out.pop("status") == ("applied" if patch_applies_here("dtensor-partial-kinds") else None)
    assert out == NEWEST, out


@only_torch(">=2.13", "torch that reduces or refuses mixed Partials itself")
def test_mixed_partials_natively_on_fixed_torch(tmp_path):
    out = _run(tmp_path)
    assert out.pop("status") is None
    assert out == NEWEST, out
