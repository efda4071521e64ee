"""Feature detection keeps working: the probes real code runs to choose a path (``hasattr``, ``getattr(...,
None)``, ``try: import ... except ImportError``) answer, with TORCHPATCH=1, what works on this torch.

``tests/fixtures/probes.json`` holds the probes of torchtitan's releases (and of accelerate, DeepSpeed, vLLM)
whose subject torchpatch serves on some torch, each with a program that uses the probed thing. One process
evaluates every probe and runs every program; a probe answering "present" must lead to a thing that runs,
one answering "absent" to a thing that does not (where it runs, the probe would have missed a working
path). A ``declared`` probe keeps its "present" answer on purpose (real code imports the name
unconditionally); where its patch is applied its use must then raise torchpatch's ``NotImplementedError``
naming the missing piece, never a silent or foreign failure. The same process holds the two generic probes
to every module and name the catalogue serves on this torch: ``importlib.util.find_spec`` finds a served
module exactly where it imports, and ``hasattr`` answers True for each served name without raising.
"""

import json
from pathlib import Path
from typing import List, Tuple

import pytest

from conftest import TORCH, clean_env, run_json, torch_matches

PROBES = json.loads((Path(__file__).parent / "fixtures" / "probes.json").read_text())["probes"]

PROGRAM = r'''
import importlib, importlib.util, json, sys, tempfile
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
modules, names = json.loads(sys.argv[2])
applied = {p for p, state in torchpatch.status().items() if state == "applied"}
served = {"modules": {}, "names": {}}
for name in modules:
    try:
        found = importlib.util.find_spec(name) is not None
    except Exception as exc:  # find_spec imports the parents
        found = f"find_spec raised {type(exc).__name__}: {exc}"
    try:
        importlib.import_module(name)
        imported = True
    except Exception as exc:
        imported = f"{type(exc).__name__}: {exc}"[:300]
    served["modules"][name] = [found, imported]
for patch_id, module, name in names:
    if patch_id not in applied:
        continue
    parts = (module + "." + name).split(".")
    for cut in range(len(parts) - 1, 0, -1):  # the longest importable prefix, then attributes
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
            break
        except ImportError:
            continue
    try:
        for part in parts[cut:-1]:
            obj = getattr(obj, part)
        served["names"][f"{module}.{name}"] = hasattr(obj, parts[-1])
    except Exception as exc:
        served["names"][f"{module}.{name}"] = f"{type(exc).__name__}: {exc}"[:300]
print(json.dumps({"probes": out, "served": served}))
'''


@pytest.fixture(scope="module")
def answers():
    """One process with TORCHPATCH=1: every probe and its program, then every served module and name."""
    return run_json(PROGRAM, env=clean_env(TORCHPATCH="1"), args=(json.dumps(PROBES), json.dumps(served_here())),
                    timeout=300)


@pytest.mark.parametrize("probe", [p for p in PROBES if "declared" not in p], ids=lambda p: p["id"])
def test_probe_answers_what_works(answers, probe):
    got = answers["probes"][probe["id"]]
    assert got["present"] == got["works"], (
        f"torch {TORCH}: {probe['id']} ({', '.join(probe['found_in'])}) answers present={got['present']} "
        f"but the thing {'runs' if got['works'] else 'fails: ' + got.get('error', '')}; served here by "
        f"{got['served_here'] or 'nothing (torch own)'}")


@pytest.mark.parametrize("probe", [p for p in PROBES if "declared" in p], ids=lambda p: p["id"])
def test_declared_probe_refuses_loudly(answers, probe):
    got = answers["probes"][probe["id"]]
    if not got["served_here"]:
        pytest.skip(f"torch {TORCH}: {probe['served_by']} not applied; the probe is torch's own")
    assert got["present"] is True, got
    assert got["works"] or ("NotImplementedError" in got["error"] and probe["refusal"] in got["error"]), got


def served_here() -> Tuple[List[str], List[Tuple[str, str, str]]]:
    """What the catalogue declares it serves on this torch: modules (shims and aliases), and the names
    (patch id, module, name: symbols, and names hooks set) that an applied patch serves."""
    from torchpatch._registry import builtin_patches

    modules, names = set(), set()
    for patch in builtin_patches():
        if torch_matches(patch.torch):
            modules.update(patch.modules)
            modules.update(name for name, _target, spec in patch.aliases if not spec or torch_matches(spec))
            names.update((patch.id, module, name) for module, name in patch.symbols)
            names.update((patch.id, module, name) for module, name, spec in patch.hook_symbols
                         if not spec or torch_matches(spec))
    return sorted(modules), sorted(names)


def test_find_spec_of_every_served_module_matches_its_import(answers):
    """``importlib.util.find_spec(name)``, the probe of a module's presence, finds a served module exactly
    where importing it works."""
    assert {name: pair for name, pair in answers["served"]["modules"].items() if pair != [True, True]} == {}


def test_hasattr_of_every_served_name_answers_present(answers):
    """``hasattr(owner, name)`` answers True for each name an applied patch declares it serves, and never
    raises (a factory failing with anything but AttributeError would crash the probe itself)."""
    assert {name: got for name, got in answers["served"]["names"].items() if got is not True} == {}
