"""Feature detection keeps working: the probes real code runs to choose a path (``hasattr``, ``getattr(...,
None)``, ``try: import ... except ImportError``) answer, with TORCHPATCH=1, what works on this torch.

``tests/fixtures/probes.json`` holds the probes of torchtitan's releases (and of accelerate, DeepSpeed, vLLM)
whose subject torchpatch serves on some torch, each with a program that uses the probed thing. One process
evaluates every probe and runs every program; a probe answering "present" must lead to a thing that runs,
one answering "absent" to a thing that does not (where it runs, the probe would have missed a working
path). A ``declared`` probe keeps its "present" answer on purpose (real code imports the name
unconditionally); where its patch is applied its use must then raise torchpatch's ``NotImplementedError``
naming the missing piece, never a silent or foreign failure.
"""

import json
from pathlib import Path

import pytest

from conftest import TORCH, clean_env, run_json

PROBES = json.loads((Path(__file__).parent / "fixtures" / "probes.json").read_text())["probes"]

PROGRAM = r'''
import json, os, sys, tempfile
import torch
import torchpatch

_MESH = []


def one_rank_mesh():
    """A DeviceMesh of this process alone (gloo, world size 1), made once."""
    if not _MESH:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        store = tempfile.NamedTemporaryFile(delete=False).name
        dist.init_process_group("gloo", init_method="file://" + store, rank=0, world_size=1)
        _MESH.append(init_device_mesh("cpu", (1,)))
    return _MESH[0]


def accelerator():
    return "cuda" if torch.cuda.is_available() else "cpu"


def sac_runs(ops):
    """Selective activation checkpointing whose policy saves ``ops``: the gradient equals the plain one."""
    from functools import partial
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in ops else CheckpointPolicy.PREFER_RECOMPUTE

    w = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    x = torch.randn(3, 4, dtype=torch.float64)
    fn = lambda x: torch.mm(x, w).relu().sin().sum()
    fn(x).backward()
    plain, w.grad = w.grad, None
    checkpoint(fn, x, use_reentrant=False,
               context_fn=partial(create_selective_checkpoint_contexts, policy)).backward()
    assert torch.equal(w.grad, plain)


class InductorCallable:
    """What Inductor hands ``inductor_compiled_code``: torch 2.15's InductorCompiledCallable where it exists."""

    def __new__(cls, fn):
        try:
            from torch._higher_order_ops.wrap import InductorCompiledCallable
        except ImportError:
            obj = object.__new__(cls)
            obj.compiled_callable = fn
            return obj
        return InductorCompiledCallable(fn)


out = {}
for probe in json.loads(sys.argv[1]):
    answer = {}
    scope = dict(globals())
    try:
        exec(probe["probe"], scope)
        answer["present"] = bool(scope["present"])
    except Exception as exc:  # a probe that raises is itself a broken path
        answer["present"] = f"probe raised {type(exc).__name__}: {exc}"
    try:
        exec(probe["works"], dict(globals()))
        answer["works"] = True
    except Exception as exc:
        answer["works"] = False
        answer["error"] = f"{type(exc).__name__}: {exc}"[:400]
    status = torchpatch.status()
    answer["served_here"] = [p for p in probe["served_by"] if status.get(p) == "applied"]
    out[probe["id"]] = answer
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def answers():
    return run_json(PROGRAM, env=clean_env(TORCHPATCH="1"), args=(json.dumps(PROBES),), timeout=300)


@pytest.mark.parametrize("probe", [p for p in PROBES if "declared" not in p], ids=lambda p: p["id"])
def test_probe_answers_what_works(answers, probe):
    got = answers[probe["id"]]
    assert got["present"] == got["works"], (
        f"torch {TORCH}: {probe['id']} ({', '.join(probe['found_in'])}) answers present={got['present']} "
        f"but the thing {'runs' if got['works'] else 'fails: ' + got.get('error', '')}; served here by "
        f"{got['served_here'] or 'nothing (torch own)'}")


@pytest.mark.parametrize("probe", [p for p in PROBES if "declared" in p], ids=lambda p: p["id"])
def test_declared_probe_refuses_loudly(answers, probe):
    got = answers[probe["id"]]
    if not got["served_here"]:
        pytest.skip(f"torch {TORCH}: {probe['served_by']} not applied; the probe is torch's own")
    assert got["present"] is True, got
    assert got["works"] or ("NotImplementedError" in got["error"] and probe["refusal"] in got["error"]), got
