"""``torchpatch explain``: an error message or a dotted name, on an inventoried torch or the installed one."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import torchpatch
from conftest import TORCH, clean_env, torchpatch_command
from torchpatch import _versions

PARTIAL = "ImportError: cannot import name 'Partial' from 'torch.distributed._tensor'"
FLATTEN = "AttributeError: 'DeviceMesh' object has no attribute '_flatten'"
COMPILE = "AttributeError: module 'torch' has no attribute 'compile'"
SIX = "ModuleNotFoundError: No module named 'torch._six'"
DOTTED = "torch.distributed.tensor.Partial"
INSTALLED = ".".join(map(str, _versions.release(TORCH)))


def explain(*args, env=None, stdin=None):
    """``torchpatch explain *args``, run in this process (what it answers; the real command's own process:
    the tests of bytes on its standard input and of an interpreter without torch)."""
    return torchpatch_command("explain", *args, env=env, stdin=stdin.encode() if stdin else None)


def answer(*args, env=None, code=None):
    proc = explain(*args, "--json", env=env)
    assert proc.returncode in (0, 1), proc.stderr
    found = json.loads(proc.stdout)
    assert proc.returncode == found["exit"] == (code if code is not None else found["exit"])
    return found


# message, torch -> (verdict, name, patch serving it, how it serves it)
CASES = {
    (PARTIAL, "2.1.2"): ("served", "torch.distributed._tensor.Partial", "dtensor-partial",
                         "symbol torch.distributed._tensor.Partial, made on first use"),
    (PARTIAL, "2.15.0"): ("native", "torch.distributed._tensor.Partial", None, None),
    (FLATTEN, "2.1.2"): ("missing", "torch.distributed._tensor.device_mesh.DeviceMesh._flatten", None, None),
    (FLATTEN, "2.4.1"): ("served", "torch.distributed.device_mesh.DeviceMesh._flatten", "device-mesh-flatten",
                         "member torch.distributed.device_mesh.DeviceMesh._flatten, set by a hook"),
    (FLATTEN, "2.15.0"): ("native", "torch.distributed.device_mesh.DeviceMesh._flatten", None, None),
    (COMPILE, "1.13.1"): ("served", "torch.compile", "torch-compile-noop", "name torch.compile, set by a hook"),
    (COMPILE, "2.1.2"): ("native", "torch.compile", None, None),
    (COMPILE, "2.15.0"): ("native", "torch.compile", None, None),
    (SIX, "1.13.1"): ("native", "torch._six", None, None),
    (SIX, "2.1.2"): ("served", "torch._six", "torch-six", "module shim torch._six"),
    (SIX, "2.15.0"): ("served", "torch._six", "torch-six", "module shim torch._six"),
    (DOTTED, "2.1.2"): ("served", DOTTED, "dtensor-partial", "symbol torch.distributed.tensor.Partial, made on first use"),
    (DOTTED, "2.15.0"): ("native", DOTTED, None, None),
}


@pytest.mark.parametrize("message, torch", sorted(CASES))
def test_each_form_on_inventoried_torches(message, torch):
    verdict, name, patch, how = CASES[(message, torch)]
    found = answer(message, "--torch", torch, code=0 if verdict in ("native", "served") else 1)
    assert (found["verdict"], found["name"], found["torch"]) == (verdict, name, torch)
    assert found["source"] == f"torch {torch} from its inventory (not installed)" or torch == INSTALLED
    if patch:
        assert found["served_by"] == [{"patch": patch, "how": [how], "enabled": True, "reason": "on by default"}]
        assert torch in found["served_in"] and torch not in found["native_in"]
    else:
        assert found["served_by"] == []
    if verdict == "native":
        assert torch in found["native_in"]


def test_which_torch_versions_have_it_and_where_it_is_served():
    found = answer(FLATTEN, "--torch", "2.1.2", code=1)
    assert found["native_in"][0] == "2.5.1" and "2.15.0" in found["native_in"]
    assert found["served_in"] == ["2.4.1"]
    six = answer(SIX, "--torch", "2.1.2")
    assert six["native_in"] == ["1.13.1"] and "2.0.1" in six["served_in"] and "2.15.0" in six["served_in"]


@pytest.mark.parametrize("message", [PARTIAL, FLATTEN, COMPILE, SIX, DOTTED])
def test_the_installed_torch_by_default(message):
    found = answer(message)
    assert found["torch"] == INSTALLED and found["installed"] == TORCH
    assert found["source"].startswith(f"installed torch {TORCH}")
    # The installed torch's answer agrees with its inventory's (every torch of the matrix is inventoried).
    expected = "native" if INSTALLED in found["native_in"] else "served" if INSTALLED in found["served_in"] else None
    assert found["verdict"] == (expected or found["verdict"]) and found["verdict"] in ("native", "served", "missing")


def test_text_output_names_the_patch_how_and_that_torchpatch_must_be_on():
    proc = explain(PARTIAL, "--torch", "2.1")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "torchpatch explain: torch.distributed._tensor.Partial"
    assert f"  read from    {PARTIAL}" in lines
    source = "installed torch 2.1.2" if INSTALLED == "2.1.2" else "torch 2.1.2 from its inventory (not installed)"
    assert lines[2].startswith(f"  on torch     {source}")
    assert "  served       by dtensor-partial: symbol torch.distributed._tensor.Partial, made on first use" in lines
    assert ("               dtensor-partial is on here (on by default); it acts in processes started with "
            "TORCHPATCH=1, which this shell does not set") in lines
    assert lines[-1] == "served; exit 0"
    on = explain(PARTIAL, "--torch", "2.1", env=clean_env(TORCHPATCH="1")).stdout
    assert "it acts in processes started with TORCHPATCH=1\n" in on


def test_a_patch_switched_off_in_this_shell():
    found = answer(DOTTED, "--torch", "2.1.2", env=clean_env(TORCHPATCH_DTENSOR_PARTIAL="0"), code=1)
    assert found["verdict"] == "switched off"
    assert found["served_by"] == [{"patch": "dtensor-partial", "how": [CASES[(DOTTED, "2.1.2")][3]],
                                   "enabled": False, "reason": "TORCHPATCH_DTENSOR_PARTIAL=0"}]


def test_what_cannot_be_backported_says_why():
    found = answer("ImportError: cannot import name 'fully_shard' from 'torch.distributed._composable.fsdp'",
                   "--torch", "2.1.2", code=1)
    assert found["verdict"] == "not backportable" and found["name"] == "torch.distributed._composable.fsdp.fully_shard"
    assert found["not_backportable"]["torch"] == ">=2.3" and "FSDP2" in found["not_backportable"]["what"]
    assert "torch.distributed._composable.fsdp is missing" in found["notes"]
    text = explain("torch.uint16", "--torch", "2.1.2")
    assert text.returncode == 1
    assert "  not backportable: the uint16 dtype needs torch >=2.3: dtypes are C++ scalar types" in text.stdout


@pytest.mark.parametrize("message, note", [
    ("torch.distributed.no_such_thing", "no inventoried torch has it"),
    ("AttributeError: 'Trainer' object has no attribute 'mesh'", "has no torch.distributed class named Trainer"),
    ("ModuleNotFoundError: No module named 'numpy'", "torchpatch serves torch's names only"),
])
def test_what_torchpatch_does_not_know(message, note):
    found = answer(message, "--torch", "2.15.0", code=1)
    assert found["verdict"] == "unknown" and found["native_in"] == found["served_in"] == []
    assert any(note in n for n in found["notes"]), found["notes"]


def test_a_submodule_used_as_an_attribute_before_its_import():
    found = answer("AttributeError: module 'torch.distributed' has no attribute 'tensor'", "--torch", "2.15.0")
    assert found["verdict"] == "native"
    assert found["notes"] == ["torch.distributed.tensor is a module: `import torch.distributed.tensor` before using "
                              "it as an attribute (a package does not import its submodules by itself)"]


def test_a_traceback_from_standard_input():
    traceback = (
        "Traceback (most recent call last):\n  File \"train.py\", line 3, in <module>\n"
        "    from torch.distributed._tensor import Partial\n"
        f"{PARTIAL} (/venv/lib/python3.11/site-packages/torch/distributed/_tensor/__init__.py)\n"
    )
    proc = explain("-", "--torch", "2.1.2", "--json", stdin=traceback)
    assert proc.returncode == 0, proc.stderr
    error, = json.loads(proc.stdout)["errors"]  # a log: each distinct error explained (tests/test_explain_logs.py)
    found = error["explanation"]
    assert found["name"] == "torch.distributed._tensor.Partial" and found["query"].startswith(PARTIAL)
    assert found["verdict"] == "served" and error["first_line"] == 4


@pytest.mark.parametrize("args, error, choices", [
    (["what is this?"], "cannot tell which name 'what is this?' is about; give an error message or a dotted name",
     SIX),
    ([DOTTED, "--torch", "2"], "--torch '2' is ambiguous: name a minor, X.Y (its newest release), or a release, X.Y.Z",
     "inventoried 1.13.1, 2.0.1, 2.1.2"),
    ([DOTTED, "--torch", "9.9.9"], "torch 9.9.9 is neither installed nor inventoried", "inventoried 1.13.1, 2.0.1, 2.1.2"),
])
@pytest.mark.torch_independent
def test_usage_errors_exit_2_and_name_the_choices(args, error, choices):
    proc = explain(*args)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith(f"torchpatch explain: {error}") and choices in proc.stderr


@pytest.mark.parametrize("message", ["ValueError: batch of 0", "RuntimeError: la mémoire est épuisée",
                                     "Traceback (most recent call last):\n  File \"train.py\", line 3, in <module>\n"
                                     "    main()\nKeyError: 'lr'"])
@pytest.mark.torch_independent
def test_an_error_torchpatch_does_not_know_is_answered_with_exit_0(message):
    """An error message it read but does not know (another language included) is an answer, not a usage error."""
    proc = explain(message, "--torch", "2.4.1")
    last = message.splitlines()[-1]
    assert (proc.returncode, proc.stderr) == (0, ""), proc.stderr
    assert proc.stdout.startswith("torchpatch explain: the message: ") and "0 known errors, 1 other error line" in proc.stdout
    assert f"errors torchpatch does not know (first line of each, as printed):\n  line {message.count(chr(10)) + 1}: {last}" \
        in proc.stdout and proc.stdout.endswith("exit 0\n")
    report = json.loads(explain(message, "--torch", "2.4.1", "--json").stdout)
    assert (report["exit"], report["errors"], [u["text"] for u in report["unrecognised"]]) == (0, [], [last])


@pytest.mark.torch_independent
def test_bytes_that_are_no_text_read_as_replacement_characters():
    """Binary input (a stray byte in a traceback, a binary file piped in) is never echoed back as surrogate
    escapes: its bytes read as U+FFFD, and an error message around them still reads."""
    def run(args, stdin=None):
        return subprocess.run([sys.executable, "-m", "torchpatch", "explain", *args], input=stdin, capture_output=True,
                              env=clean_env(PYTHONIOENCODING="utf-8"), timeout=300)

    proc = run([b"What \xff\xfe?"])
    error = proc.stderr.decode("utf-8")  # strict: a surrogate written out raw would not decode
    assert proc.returncode == 2 and error.startswith("torchpatch explain: cannot tell which name 'What \ufffd\ufffd?'")
    proc = run(["-", "--torch", "2.1.2", "--json"], f"{PARTIAL}\n\xff\n".encode("latin-1"))
    error, = json.loads(proc.stdout)["errors"]  # standard input is a log
    assert proc.returncode == 0 and error["explanation"]["name"] == "torch.distributed._tensor.Partial"


@pytest.mark.torch_independent
def test_without_torch_the_newest_inventoried_one_answers(tmp_path):
    # torchpatch alone on the path of an interpreter that skips site-packages (-S): no torch to find
    package = Path(torchpatch.__file__).resolve().parent
    shutil.copytree(package, tmp_path / "torchpatch")
    shutil.copy(package.parent / "_torchpatch_startup.py", tmp_path)
    proc = subprocess.run([sys.executable, "-S", "-m", "torchpatch", "explain", DOTTED, "--json"], capture_output=True,
                          text=True, env=clean_env(PYTHONPATH=str(tmp_path)), cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)
    newest = found["native_in"][-1]
    assert found["installed"] is None and found["torch"] == newest and found["verdict"] == "native"
    assert found["notes"] == [f"torch is not installed here: answering for the newest inventoried torch, {newest} "
                              "(--torch to choose)"]


@pytest.mark.torch_independent
def test_help_lists_the_forms_and_exit_statuses():
    top = subprocess.run([sys.executable, "-m", "torchpatch", "--help"], capture_output=True, text=True).stdout
    assert "explain" in top
    out = explain("--help").stdout
    for text in (PARTIAL, FLATTEN, COMPILE, SIX, DOTTED, "--torch", "--json", "torchpatch explain -", "exit 1", "Exit 2"):
        assert text in out, text
