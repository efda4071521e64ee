"""Collect the error each patch's native-failure test really raises, into
``src/torchpatch/patches/_data/native_errors.json`` (read by tests/test_explain_fixes.py).

For each matrix venv (``~/.cache/torchpatch/nox/matrix-torch-*`` and ``tests``, torch 2.13.0) this runs
the tests named ``test_native*`` of ``tests/test_patch_<id>.py`` (of the patches that apply there) with pytest, the working tree's ``src`` first
on the path and ``NATIVE_ERRORS_OUT`` set: every process such a test starts (forked or fresh, see
tests/forkserver.py) then records each exception that reaches its own program's code (the lines the test
wrote, not torch's internals: ``except RuntimeError as exc`` in the test's script, or an uncaught one) as
Python prints its last line, ``RuntimeError: Cannot use ReduceOp.AVG with Gloo``. Records of a process with
torchpatch active (``TORCHPATCH=1``, the patch not switched off) are dropped; the rest are kept per patch
(its test file's name), torch version and message, deduplicated, with the tests that raised them.

    PYTHONPATH=src python3 tools/native_errors.py                  # every venv that exists
    PYTHONPATH=src python3 tools/native_errors.py --torch 2.4.1 gloo-avg   # one venv, some patches; merged in

Runs one venv at a time, pytest with one worker (the tests start ranks of their own).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "src" / "torchpatch" / "patches" / "_data" / "native_errors.json"
MATRIX = ("1.13.1", "2.1.2", "2.4.1", "2.9.0", "2.13.0", "2.14.1", "2.15.0")
# Test files named after no patch: the patch whose native failure they reproduce.
FILES = {"test_patch_dtensor_mixed.py": ["dtensor-implicit-replication", "dtensor-op-fallback"]}

# Run in each process a test starts (tests/forkserver.py loads it from NATIVE_ERRORS_OUT/tracer.py):
# a trace function on calls only, so that code outside the program's own file runs untraced, and
# ``exception`` events of the program's frames recorded, once per distinct (type, message).
TRACER = '''
import json, os, sys, threading

def install(main_file):
    path = os.path.join(os.environ["NATIVE_ERRORS_OUT"], "%d.jsonl" % os.getpid())
    seen = set()

    def local(frame, event, arg):
        if event == "exception" and issubclass(arg[0], Exception):
            kind, value = arg[0], arg[1]
            name = kind.__qualname__ if kind.__module__ == "builtins" else kind.__module__ + "." + kind.__qualname__
            try:
                text = str(value)
            except Exception:
                text = repr(value)
            if (name, text) not in seen:
                seen.add((name, text))
                torch = sys.modules.get("torch")
                record = {"test": os.environ.get("PYTEST_NATIVE_ERRORS_TEST", ""), "type": name, "message": text,
                          "torch": getattr(torch, "__version__", None),
                          "env": {k: v for k, v in os.environ.items() if k.startswith("TORCHPATCH")}}
                with open(path, "a") as out:
                    out.write(json.dumps(record) + "\\n")
        return local

    def call(frame, event, arg):
        if frame.f_code.co_filename != main_file:
            return None
        frame.f_trace_lines = False
        return local

    caller = sys._getframe(1)
    if caller.f_code.co_filename == main_file:  # the prelude of a fresh -c: its frame already runs
        caller.f_trace_lines = False
        caller.f_trace = local
    sys.settrace(call)
    threading.settrace(call)
'''


def python_of(torch: str) -> Path:
    """The nox session venv's python of ``torch`` (tools/checkpoint_fixtures.py's, where the fixtures are made)."""
    from checkpoint_fixtures import venv_python

    return Path(venv_python(torch))


def test_files(torch: str, patches: List[str]) -> List[str]:
    """The test files of ``patches`` (every patch: all) whose patch applies to ``torch``."""
    from torchpatch import _versions
    from torchpatch._registry import catalogue_ranges

    ranges = catalogue_ranges()
    owners = {f"test_patch_{p.replace('-', '_')}.py": [p] for p in ranges}
    owners.update(FILES)
    files = []
    for path in sorted((REPO / "tests").glob("test_patch_*.py")):
        owned = owners.get(path.name, [])
        if (not patches or set(owned) & set(patches)) and any(_versions.matches(ranges[p], torch) for p in owned):
            files.append(str(path.relative_to(REPO)))
    return files


def run(torch: str, files: List[str], directory: Path) -> int:
    """Run the native tests of ``files`` on one venv, recording into ``directory``; pytest's exit status."""
    (directory / "tracer.py").write_text(TRACER)
    env = dict(os.environ, NATIVE_ERRORS_OUT=str(directory),
               PYTHONPATH=os.pathsep.join([str(REPO / "src")] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    cmd = [str(python_of(torch)), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-k", "native",
           *files]
    print(f"torch {torch}: {len(files)} test files", flush=True)
    return subprocess.call(cmd, cwd=REPO, env=env)


def _switched_off(record: Dict[str, Any], patch: str) -> bool:
    """Whether torchpatch was inactive for ``patch`` in the process that made ``record``."""
    env = record["env"]
    if env.get("TORCHPATCH", "").strip().lower() not in ("1", "true", "yes", "on"):
        return True
    switch = "TORCHPATCH_" + patch.upper().replace("-", "_")
    return env.get(switch, "").strip().lower() in ("0", "false", "no", "off") or patch in env.get(
        "TORCHPATCH_DISABLE", "").replace(",", " ").split()


def collect(directory: Path) -> Dict[str, Dict[str, Dict[str, List[str]]]]:
    """patch -> message -> torch version -> the tests that raised it, from the records of ``directory``."""
    out: Dict[str, Dict[str, Dict[str, List[str]]]] = {}
    for path in sorted(directory.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            nodeid = record["test"].rsplit(" (", 1)[0]  # PYTEST_CURRENT_TEST: "<nodeid> (call)"
            file, _, name = nodeid.partition("::")
            file = os.path.basename(file)
            if not name.startswith("test_native") or not file.startswith("test_patch_") or record["torch"] is None:
                continue
            owners = FILES.get(file) or [file[len("test_patch_"):-len(".py")].replace("_", "-")]
            if not all(_switched_off(record, p) for p in owners):
                continue
            patch = "+".join(owners)
            message = f"{record['type']}: {record['message']}" if record["message"] else record["type"]
            tests = out.setdefault(patch, {}).setdefault(message, {}).setdefault(record["torch"].split("+")[0], [])
            if nodeid not in tests:
                tests.append(nodeid)
    return out


def merge(found: Dict[str, Dict[str, Dict[str, List[str]]]], torches: List[str]) -> Dict[str, Any]:
    """The file's content: what was there for torch versions not run now, and what was found."""
    old = json.loads(OUT.read_text())["patches"] if OUT.exists() else {}
    patches: Dict[str, List[Dict[str, Any]]] = {}
    for patch, entries in old.items():
        kept = [e for e in entries if e["torch"] not in torches]
        if kept:
            patches[patch] = kept
    for patch, messages in found.items():
        for message, by_torch in messages.items():
            for torch, tests in by_torch.items():
                patches.setdefault(patch, []).append({"torch": torch, "message": message, "tests": sorted(tests)})
    for entries in patches.values():
        entries.sort(key=lambda e: (tuple(int(p) for p in e["torch"].split(".")), e["message"]))
    return {"_doc": "The exceptions each patch's native-failure tests (test_native* of tests/test_patch_<id>.py) meet "
                    "in their own code, natively or with the patch switched off, per torch version; written by "
                    "tools/native_errors.py, read by tests/test_explain_fixes.py.",
            "patches": dict(sorted(patches.items()))}


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--torch", action="append", help="a matrix torch version (repeatable); default: every venv")
    parser.add_argument("patches", nargs="*", help="patch ids whose tests to run (default: every patch)")
    args = parser.parse_args(argv)
    torches = args.torch or [t for t in MATRIX if python_of(t).exists()]
    found: Dict[str, Dict[str, Dict[str, List[str]]]] = {}
    for torch in torches:
        if not python_of(torch).exists():
            print(f"no venv for torch {torch} at {python_of(torch)}", file=sys.stderr)
            return 2
        files = test_files(torch, args.patches)
        if not files:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            run(torch, files, Path(tmp))
            for patch, messages in collect(Path(tmp)).items():
                for message, by_torch in messages.items():
                    for version, tests in by_torch.items():
                        found.setdefault(patch, {}).setdefault(message, {}).setdefault(version, []).extend(tests)
    if args.patches:  # a partial run: keep what the file holds for the other patches of these torches
        old = json.loads(OUT.read_text())["patches"] if OUT.exists() else {}
        for patch, entries in old.items():
            if not set(patch.split("+")) & set(args.patches):
                for e in entries:
                    if e["torch"] in torches:
                        found.setdefault(patch, {}).setdefault(e["message"], {})[e["torch"]] = e["tests"]
    OUT.write_text(json.dumps(merge(found, torches), indent=1, sort_keys=False) + "\n")
    print(f"wrote {OUT.relative_to(REPO)}: {sum(len(m) for m in found.values())} messages of {len(found)} patches")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
