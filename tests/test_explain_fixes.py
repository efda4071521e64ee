"""Every error a patch fixes is one ``torchpatch explain`` names that patch for.

Generated from the data: each message a patch's native-failure test really raised (``native_errors.json``,
written by ``tools/native_errors.py`` on the matrix venvs), and each ``Patch(errors=...)`` example, is
fed to ``explain`` (in this process) on a torch where it was raised; the answer must name the patch.
Every patch must say how explain covers it: ``errors=``, the names it serves
(explain's name logic: ImportError/AttributeError/ModuleNotFoundError), a known error of
``known_errors.json`` naming it, or ``category="correctness"`` (a silent wrong result raises nothing);
a few raise nothing a pattern could tell apart, each listed in :data:`NO_PATTERN` with the reason.
"""

import ast
import json
import re

import pytest

from conftest import REPO, torchpatch_command
from torchpatch import _versions
from torchpatch._check.inventory import inventory_files
from torchpatch._check.logs import known_errors
from torchpatch._fixes import fixed_by, patch_errors
from torchpatch._registry import all_patches, catalogue_data

pytestmark = pytest.mark.torch_independent

PATCHES = {p.id: p for p in all_patches()}
NATIVE = json.loads((catalogue_data() / "native_errors.json").read_text())["patches"]
# Patches whose native failure no line-pattern can tell from other errors: why.
NO_PATTERN = {
    "fsdp2-cpu": "torch's own `Torch not compiled with CUDA enabled` / `Found no NVIDIA driver`, raised by any CUDA "
                 "call on a machine without one",
    "torchrun-py311": "`AttributeError: 'NoneType' object has no attribute 'get'` inside torchrun's own start, a message "
                      "any code can raise",
    "dcp-metadata-strides": "`ValueError: too many values to unpack (expected 5)` while unpickling the metadata, a "
                            "message any code can raise",
    "gloo-exit-abort": "a C++ abort at exit in gloo's worker threads, no Python exception",
    "gloo-destroy-hang": "a hang in destroy_process_group (gloo's workers joined with the GIL held), no message",
    "pipelining-gloo-p2p": "gloo's receive timeout, which any collective waiting on a dead peer raises",
    "pipelining-presplit-inputs": "the schedule's own assertion deep in its microbatch split, with no message of its own",
    "xla-parallelize": "torch_xla's sharding of a DTensor parameter fails inside torch_xla",
}
# Messages a native-failure test meets that are not the error its patch fixes: why.
INCIDENTAL = {
    "RuntimeError: Sharding propagation failed for Op(op=aten.add.Tensor": "torch's own refusal, inside an explicit "
    "implicit_replication() block, of a plain tensor shaped like a local shard: the patch leaves that block to torch",
}
# Patterns two patches share because both fix the error (the message names the first; explain both).
SHARED = {frozenset({"dtensor-experimental", "dtensor-implicit-replication"})}


def _named(message: str, torch: str) -> set:
    """The patches ``explain MESSAGE --torch TORCH`` names: those that fix, serve or would serve it."""
    proc = torchpatch_command("explain", message, "--torch", torch, "--json")
    assert proc.returncode in (0, 1), proc.stderr
    report = json.loads(proc.stdout)
    return {s["patch"] for s in report.get("patches", []) + report.get("served_by", [])}


def _inventoried(spec: str) -> str:
    """The newest inventoried torch that ``spec`` admits."""
    return [v for v in inventory_files() if _versions.matches(spec, v)][-1]


CAPTURED = [(owners, entry["torch"], entry["message"]) for owners, entries in NATIVE.items() for entry in entries]


@pytest.mark.parametrize("owners, torch, message", CAPTURED, ids=[f"{o}@{t}" for o, t, _m in CAPTURED])
def test_each_message_a_native_failure_test_raised_names_its_patch(owners, torch, message):
    patches = owners.split("+")
    if any(message.startswith(m) for m in INCIDENTAL):
        pytest.skip(f"not the error {owners} fixes: {next(w for m, w in INCIDENTAL.items() if message.startswith(m))}")
    if all(PATCHES[p].category == "correctness" or p in NO_PATTERN for p in patches):
        pytest.skip(f"{owners}: nothing to name (a correctness patch's test meets others' errors, or NO_PATTERN)")
    version = torch if torch in inventory_files() else _inventoried(PATCHES[patches[0]].torch)
    assert _named(message, version) & set(patches), f"explain does not name {owners} for {message!r} on torch {torch}"


@pytest.mark.parametrize("patch_id", sorted(patch_errors()))
def test_each_declared_error_is_specific_and_names_its_patch(patch_id):
    entry = patch_errors()[patch_id]
    for pattern, example in zip(entry["patterns"], entry["examples"]):
        assert re.search(pattern, example), (patch_id, pattern, example)
        others = set(fixed_by(example)) - {patch_id}
        assert all(frozenset({patch_id, o}) in SHARED for o in others), f"{example!r} also matches {others}"
        assert patch_id in _named(example, _inventoried(entry["torch"]))
    captured = {e["message"] for owners, entries in NATIVE.items() if patch_id in owners.split("+") for e in entries}
    matched = {m for m in captured if patch_id in fixed_by(m)}
    if matched:  # the example is the message the native-failure test really raised
        assert any(_same(e, m) for e in entry["examples"] for m in matched), (patch_id, entry["examples"], sorted(matched))


def _same(example: str, message: str) -> bool:
    """``example`` is ``message`` on one line (whitespace runs as one space); one ending in ``...`` is its start."""
    example, message = " ".join(example.split()), " ".join(message.split())
    return message.startswith(example[:-3]) if example.endswith("...") else example == message


def _with_native_failure_tests() -> list:
    """Patch ids whose test file has a ``test_native*`` function."""
    out = []
    for path in sorted((REPO / "tests").glob("test_patch_*.py")):
        tree = ast.parse(path.read_text())
        if any(isinstance(n, ast.FunctionDef) and n.name.startswith("test_native") for n in tree.body):
            out.append(path.stem[len("test_patch_"):].replace("_", "-"))
    return [p for p in out if p in PATCHES]


def _covered(patch_id: str) -> str:
    """How explain covers the errors of ``patch_id`` ("" when it does not)."""
    p = PATCHES[patch_id]
    if p.errors:
        return "errors="
    if p.category == "correctness":
        return "correctness: a silent wrong result, no error"
    if p.modules or p.aliases or p.symbols or p.hook_symbols:
        return "served names: explain's name logic"
    if any(patch_id in e.get("patches", []) for e in known_errors() if e.get("kind") is None):
        return "a known error names it"
    return f"no pattern: {NO_PATTERN[patch_id]}" if patch_id in NO_PATTERN else ""


WITH_NATIVE_FAILURE_TESTS = frozenset(_with_native_failure_tests())


@pytest.mark.parametrize("patch_id", sorted(PATCHES))
def test_every_patch_says_how_explain_covers_it(patch_id):
    native_test = "has a native-failure test but " if patch_id in WITH_NATIVE_FAILURE_TESTS else ""
    assert _covered(patch_id), (f"{patch_id} {native_test}declares no errors=(Error(pattern, example),): add the "
                                "message its native failure raises (tools/native_errors.py records what its test meets)")


def test_known_error_ids_are_no_ids_of_patches_with_errors():
    ids = [e["id"] for e in known_errors() if e.get("kind") is None]
    assert not set(ids) & set(patch_errors())


@pytest.mark.parametrize("message, torch, patch_id", [
    ("TypeError: cannot pickle 'torch._C._distributed_c10d.ProcessGroup' object", "2.9.0", "processgroup-deepcopy"),
    ("RuntimeError: Cannot use ReduceOp.AVG with Gloo", "2.4.1", "gloo-avg"),
    ("NotImplementedError: Operator aten.linspace.default does not have a sharding strategy registered.", "2.9.0",
     "dtensor-linspace-logspace"),
])
def test_the_readme_examples(message, torch, patch_id):
    proc = torchpatch_command("explain", message, "--torch", torch)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"an error patch {patch_id} fixes on torch {torch}" in proc.stdout
    assert proc.stdout.rstrip().endswith("fixed here; exit 0")


def test_switched_off_and_out_of_range():
    from conftest import clean_env

    off = torchpatch_command("explain", "RuntimeError: Cannot use ReduceOp.AVG with Gloo", "--torch", "2.4.1", "--json",
                             env=clean_env(TORCHPATCH_DISABLE="gloo-avg"))
    report = json.loads(off.stdout)
    assert (off.returncode, report["verdict"], report["state"]) == (1, "switched off", "off here: in TORCHPATCH_DISABLE")
    out = torchpatch_command("explain", "RuntimeError: Cannot use ReduceOp.AVG with Gloo", "--torch", "2.9.0", "--json")
    report = json.loads(out.stdout)
    assert (out.returncode, report["verdict"], report["applies_to"]) == (1, "not for this torch", ">=2.2,<2.7")
