"""One policy for the patches that read torch's source (``patches/_source.py``): where it cannot be
read, the patch fails while applying with that reason, is taken back, and torch runs as it is
(``TORCHPATCH_STRICT=1``: an error). Source is made unreadable in a real process by an
``inspect.getsource`` that raises ``OSError`` for the objects of DTensor, FSDP and pipelining, as for a
torch without ``.py`` files. pipelining-gloo-p2p decides by a probe and applies all the same."""

import json
import types

import pytest

from conftest import clean_env, only_torch, run_py, torch_matches
from torchpatch.patches._source import SourceUnavailable, torch_source

# patch id -> (a module whose import runs its hook, the torch on which the hook reads torch's source)
READERS = {
    "dtensor-partial-kinds": ("torch.distributed._tensor", ">=2.2,<2.13"),
    "dtensor-partial-add-scalar": ("torch.distributed._tensor", ">=2.2,<2.13"),
    "dtensor-reduction-strategy": ("torch.distributed._tensor", ">=2.2,<2.14"),
    "dtensor-norm-partial-pointwise": ("torch.distributed._tensor", ">=2.2,<2.11"),
    "fsdp-root-buffer-dtype": ("torch.distributed.fsdp", ">=2.1,<2.6"),
    "pipelining-runtime-dw-scale": ("torch.distributed.pipelining.schedules", ">=2.7,<2.10"),
    "pipelining-split-weight-grad": ("torch.distributed.pipelining.stage", ">=2.5,<2.13"),
}
PROBED = "pipelining-gloo-p2p"

# The source of the packages these patches read made unreadable before torch is imported (a fresh
# interpreter: every hook runs after this); torch reads its config modules' own source at import.
SCRIPT = """
import inspect, json, sys

real = inspect.getsource
UNREADABLE = tuple(f"torch.distributed.{p}" for p in ("_tensor", "tensor", "fsdp", "pipelining"))


def getsource(obj):
    if str(getattr(obj, "__module__", None) or getattr(obj, "__name__", "")).startswith(UNREADABLE):
        raise OSError("could not get source code")
    return real(obj)


inspect.getsource = getsource
import torch
import torchpatch

for module in MODULES:
    __import__(module)
backward = sys.modules.get("torch.distributed.pipelining._backward")
weight = getattr(backward, "stage_backward_weight", None)
print(json.dumps({"status": torchpatch.status(), "stage_backward_weight": weight and weight.__module__}))
"""


def _readers():
    return [patch for patch, (_module, torch) in READERS.items() if torch_matches(torch)]


def _run(**env: str):
    modules = {READERS[patch][0] for patch in _readers()}
    if torch_matches(">=2.4,<2.8"):
        modules.add("torch.distributed.pipelining.schedules")  # pipelining-gloo-p2p's
    return run_py(SCRIPT.replace("MODULES", repr(sorted(modules))), env=clean_env(TORCHPATCH="1", **env))


@pytest.mark.torch_independent
def test_torch_source_reads_the_source():
    assert torch_source(torch_source).startswith("def torch_source(")


@pytest.mark.torch_independent
def test_torch_source_without_a_file_says_which_object():
    module = types.ModuleType("torch_without_files")
    exec(compile("def f():\n    pass\n", "/nonexistent/torch_without_files.py", "exec"), module.__dict__)
    with pytest.raises(SourceUnavailable, match=r"torch's source of torch_without_files\.f is not readable "
                                                r"\(OSError: ") as caught:
        torch_source(module.f)
    assert isinstance(caught.value.__cause__, OSError)


@pytest.mark.torch_independent
def test_torch_source_of_a_compiled_function():
    with pytest.raises(SourceUnavailable, match=r"torch's source of builtins\.len is not readable \(TypeError: "):
        torch_source(len)


@pytest.mark.fresh_interpreter
@only_torch(">=2.1,<2.14", "a patch that reads torch's source applies here")
def test_unreadable_source_fails_the_patch_and_torch_runs_as_is():
    proc = _run()
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for patch in _readers():
        assert out["status"][patch] == "failed", out
        lines = [line for line in proc.stderr.splitlines() if f"patch {patch} failed while applying" in line]
        assert len(lines) == 1, proc.stderr
        assert "SourceUnavailable: torch's source of torch." in lines[0] and "is not readable" in lines[0], lines
        assert "was taken back" in lines[0]
    if "pipelining-split-weight-grad" in _readers():
        assert out["stage_backward_weight"] == "torch.distributed.pipelining._backward"  # taken back
    if torch_matches(">=2.4,<2.8"):
        assert out["status"][PROBED] == "applied"  # a probe: no source needed


@pytest.mark.fresh_interpreter
@only_torch(">=2.5,<2.13", "pipelining-split-weight-grad reads torch's source here")
def test_unreadable_source_under_strict_is_an_error():
    proc = _run(TORCHPATCH_STRICT="1")
    assert proc.returncode != 0
    assert "PatchError" in proc.stderr and "SourceUnavailable: torch's source of torch." in proc.stderr, proc.stderr
