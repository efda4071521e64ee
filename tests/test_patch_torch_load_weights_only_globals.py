"""torch-load-weights-only-globals: a training state that torch 1.13.1, 2.1.2 and 2.4.1 saved (model and
optimizer state dicts, numpy, python and torch RNG states, an argparse.Namespace, a dataclass of a module of
its own: tests/fixtures/train_states/, written by tools/train_state_fixtures.py with those torches' matrix
venvs) fails to load on torch 2.6+ natively with an error naming one global; with TORCHPATCH=1 the same
exception names all of them, and each of the two ways it gives, run as written in a new process without
torchpatch, loads the file with the values saved."""

import json
import os
import re
import textwrap
from pathlib import Path

import pytest

from conftest import clean_env, run_json, where_patch_applies, where_patch_does_not_apply
from train_state_programs import CONFIG_MODULE, PLAIN

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "train_states"
OLDER = ("1.13.1", "2.1.2", "2.4.1")

# torch.load(argv[1]) as the caller wrote it: the values, or the exception's type and message; with what
# torch's own get_unsafe_globals_in_checkpoint says of the file. (torch first: a forked process, conftest.run_py)
LOAD = "import io, sys, torch, torchpatch\n" + PLAIN + """
target = sys.argv[1]
if sys.argv[2:] == ["bytesio"]:
    with open(target, "rb") as opened:
        target = io.BytesIO(b"prefix" + opened.read())
    target.seek(6)
out = {"status": torchpatch.status().get("torch-load-weights-only-globals"),
       "torch_lists": sorted(torch.serialization.get_unsafe_globals_in_checkpoint(sys.argv[1]))}
try:
    out["state"] = plain(torch.load(target))
except Exception as exc:
    out["error"] = {"type": f"{type(exc).__module__}.{type(exc).__name__}", "message": str(exc)}
print(json.dumps(out))
"""


@pytest.fixture(scope="module", params=OLDER)
def saved(request):
    """(the file torch ``request.param`` saved, its values as saved, the config module's folder, that torch)."""
    folder = FIXTURES / request.param
    return folder / "state.pt", json.loads((folder / "values.json").read_text()), str(FIXTURES), request.param


def _run(code: str, folder: str, args=(), **env) -> dict:
    """``code`` run in the config module's ``folder`` (its working directory, ``sys.path[0]``)."""
    return run_json(code, args=args, env=clean_env(**env), cwd=folder)


def _load(saved, *args, **env) -> dict:
    path, _values, folder, _torch = saved
    return _run(LOAD, folder, (str(path), *args), **env)


@pytest.fixture(scope="module")
def native(saved) -> dict:
    """torch.load of the saved file without torchpatch."""
    return _load(saved)


@pytest.fixture(scope="module")
def served(saved) -> dict:
    """torch.load of the saved file with TORCHPATCH=1."""
    return _load(saved, TORCHPATCH="1")


def _listed(message: str) -> list:
    """The names torchpatch's part of the message lists, one per line."""
    part = message.split("torchpatch:", 1)[1].split("Two ways to load it:")[0]
    return [line.split()[0] for line in part.splitlines()[1:] if line.startswith("    ")]


def _remedy_one(message: str) -> str:
    lines = message.split("  (1) ", 1)[1].split("  (2) ")[0].splitlines()[1:]
    return textwrap.dedent("\n".join(lines))


def _remedy_two(message: str) -> str:
    return message.split("  (2) ", 1)[1].split(": ", 1)[1].split("  (")[0].strip()


def _run_remedy(code: str, saved) -> dict:
    """``code`` (which binds ``state``) run without torchpatch in a new process: the values it loaded."""
    return _run("import torch\n" + PLAIN + code + "\nprint(json.dumps(plain(state)))\n", saved[2])


NUMPY = {"numpy.ndarray", "numpy.dtype", "numpy.dtypes.UInt32DType"}


def _expected(saved_by: str) -> set:
    # numpy 1.26 (the 1.13.1 and 2.1.2 venvs) pickles numpy.core.multiarray, numpy 2 numpy._core.multiarray
    reconstruct = "numpy._core.multiarray._reconstruct" if saved_by == "2.4.1" else "numpy.core.multiarray._reconstruct"
    return NUMPY | {reconstruct, "argparse.Namespace", f"{CONFIG_MODULE}.TrainConfig"}


def _saved_by(saved) -> str:
    return saved[3]


@where_patch_applies("torch-load-weights-only-globals", "torch.load defaults to weights_only=True")
def test_native_error_names_one_global(saved, native):
    out = native
    assert out["error"]["type"] == "_pickle.UnpicklingError"
    message = out["error"]["message"]
    assert re.findall(r"GLOBAL (\S+) was not an allowed global", message) == ["argparse.Namespace"]
    assert "torchpatch" not in message
    # torch's own list (not in the error) lacks the class numpy.dtype builds: following it still fails
    assert set(out["torch_lists"]) == _expected(_saved_by(saved)) - {"numpy.dtypes.UInt32DType"}


@where_patch_applies("torch-load-weights-only-globals")
def test_served_error_lists_every_global(saved, native, served):
    out = served
    assert out["status"] == "applied"
    assert out["error"]["type"] == native["error"]["type"]
    message = out["error"]["message"]
    assert message.startswith(native["error"]["message"] + "\n\ntorchpatch: ")
    assert set(_listed(message)) == _expected(_saved_by(saved)) >= set(out["torch_lists"])


@where_patch_applies("torch-load-weights-only-globals", "the remedy runs on torch alone")
def test_safe_globals_remedy_loads_the_values_saved(saved, served):
    message = served["error"]["message"]
    code = _remedy_one(message)
    assert "torch.serialization.safe_globals([" in code and "weights_only" not in code
    assert _run_remedy(code, saved) == saved[1]


@where_patch_applies("torch-load-weights-only-globals", "the remedy runs on torch alone")
def test_weights_only_false_remedy_loads_the_values_saved(saved, served):
    message = served["error"]["message"]
    code = _remedy_two(message)
    assert code == f"state = torch.load({str(saved[0])!r}, weights_only=False)"
    assert _run_remedy("import torch\n" + code, saved) == saved[1]


@where_patch_applies("torch-load-weights-only-globals")
def test_file_object_at_an_offset(saved):
    out = _load(saved, "bytesio", TORCHPATCH="1")
    message = out["error"]["message"]
    assert set(_listed(message)) == _expected(_saved_by(saved))
    assert "state = torch.load(f)" in message


@where_patch_applies("torch-load-weights-only-globals")
def test_globals_already_allowed_are_not_listed(tmp_path):
    out = run_json("""
        import argparse, json, sys, torch, torchpatch
        torch.save({"args": argparse.Namespace(a=1), "w": torch.ones(2)}, sys.argv[1])
        messages = []
        for allowed in ([], [argparse.Namespace]):
            with torch.serialization.safe_globals(allowed):
                try:
                    messages.append(("loaded", torch.load(sys.argv[1])["w"].tolist()))
                except Exception as exc:
                    messages.append((type(exc).__name__, str(exc)))
        torch.save({"w": torch.ones(2)}, sys.argv[1])  # weights only: loads, the wrapper does nothing
        print(json.dumps({"messages": messages, "plain": torch.load(sys.argv[1])["w"].tolist(),
                          "wrapped": hasattr(torch.load, "__wrapped__")}))
    """, args=(str(tmp_path / "s.pt"),), env=clean_env(TORCHPATCH="1"))
    (kind, message), second = out["messages"]
    assert kind == "UnpicklingError" and _listed(message) == ["argparse.Namespace"]
    assert second == ["loaded", [1.0, 1.0]] and out["plain"] == [1.0, 1.0] and out["wrapped"]


@where_patch_applies("torch-load-weights-only-globals")
def test_pickle_protocol_torch_cannot_read(tmp_path):
    out = run_json("""
        import argparse, json, sys, torch
        torch.save({"args": argparse.Namespace(a=1)}, sys.argv[1], pickle_protocol=4)
        try:
            torch.load(sys.argv[1])
        except Exception as exc:
            print(json.dumps({"message": str(exc)}))
    """, args=(str(tmp_path / "s.pt"),), env=clean_env(TORCHPATCH="1"))
    assert _listed(out["message"]) == ["argparse.Namespace"]
    assert "(1) with weights_only=True: not possible" in out["message"]
    assert "weights_only=False" in out["message"]


@where_patch_does_not_apply("torch-load-weights-only-globals", "torch.load defaults to weights_only=False")
def test_older_torch_loads_natively(saved):
    path, values, folder, _torch = saved
    out = _run("import sys, torch, torchpatch\n" + PLAIN + "print(json.dumps({'state': plain(torch.load(sys.argv[1])), "
               "'status': torchpatch.status().get('torch-load-weights-only-globals')}))", folder, (str(path),),
               TORCHPATCH="1")
    assert out["status"] is None and out["state"] == values


MAIN_CLASS = """
import dataclasses, json, sys, torch

@dataclasses.dataclass
class Cfg:
    lr: float = 0.1

if sys.argv[2] == "save":
    torch.save({"cfg": Cfg(0.5), "w": torch.ones(2)}, sys.argv[1])
    try:
        torch.load(sys.argv[1])
    except Exception as exc:
        print(json.dumps({"message": str(exc)}))
else:
    exec(sys.argv[3])
    print(json.dumps({"lr": state["cfg"].lr, "type": type(state["cfg"]).__name__, "w": state["w"].tolist()}))
"""


@where_patch_applies("torch-load-weights-only-globals", "a config class defined in the training script")
def test_class_of_main_is_named_for_the_loading_script(tmp_path):
    path = str(tmp_path / "s.pt")
    message = run_json(MAIN_CLASS, args=(path, "save"), env=clean_env(TORCHPATCH="1"))["message"]
    assert _listed(message) == ["__main__.Cfg"]
    code = _remedy_one(message)
    assert '(Cfg, "__main__.Cfg")' in code
    # the loading script defines Cfg itself (this one does, as the message says), without torchpatch
    assert run_json(MAIN_CLASS, args=(path, "load", code)) == {"lr": 0.5, "type": "Cfg", "w": [1.0, 1.0]}


@where_patch_applies("torch-load-weights-only-globals", "torch blocks os, sys, posix, nt")
def test_blocked_module_leaves_only_weights_only_false(tmp_path):
    out = run_json("""
        import json, os, sys, torch
        torch.save({"f": os.getcwd, "w": torch.ones(2)}, sys.argv[1])  # a global of posix (nt on Windows)
        try:
            torch.load(sys.argv[1])
        except Exception as exc:
            print(json.dumps({"message": str(exc)}))
    """, args=(str(tmp_path / "s.pt"),), env=clean_env(TORCHPATCH="1"))
    assert "is blocked" in out["message"] and _listed(out["message"]) == [f"{os.getcwd.__module__}.getcwd"]
    assert "(1) with weights_only=True: not possible, no allowlist admits" in out["message"]
    assert "safe_globals([" not in out["message"].split("torchpatch:", 1)[1]
