"""``torchpatch check``: the scan of fixture training repositories (tests/fixtures/check), run as the
real command, against the installed torch (each row checked by importing the name, with torchpatch
off and on) and against inventoried torches that need not be installed (--torch). Members and
constructor calls: test_check_members.py; shims: test_check_shims.py; the helper: test_check_live.py."""

import gzip
import json
import os
import subprocess
import sys

import pytest

from conftest import HERE, REPO, TORCH, clean_env, run_json, run_py, torchpatch_command
from torchpatch import _versions
from torchpatch._check.target import pick_version

FIXTURES = HERE / "fixtures" / "check"
TRAINER = FIXTURES / "trainer"
CLEAN = FIXTURES / "clean"
INVENTORY = REPO / "src" / "torchpatch" / "patches" / "_data" / "inventory"


def check(*args, env=None, cwd=FIXTURES):
    """``torchpatch check *args``, run in this process (its helper, which imports torch, is a process of its
    own either way); the real command's own process: the tests of a terminal and of what it imports."""
    return torchpatch_command("check", *args, env=env, cwd=cwd)


def report(*args, env=None):
    proc = check(*args, "--json", env=env)
    assert proc.returncode in (0, 1), proc.stderr
    data = json.loads(proc.stdout)
    assert proc.returncode == data["exit"]
    return data


def kinds(data):
    return {row["name"]: row["kind"] for row in data["rows"]}


def inventory(version):
    return json.loads(gzip.decompress((INVENTORY / f"torch-{version}.json.gz").read_bytes()))


def inventoried():
    """The inventoried torch versions, oldest first, as the directory has them."""
    found = [p.name[len("torch-"):-len(".json.gz")] for p in INVENTORY.glob("torch-*.json.gz")]
    return sorted(found, key=_versions.release)


OFF = clean_env(TORCHPATCH_DISABLE="*")  # torch alone: what each row says without the catalogue

# What the trainer fixture uses that is not native on each inventoried torch, with the catalogue
# switched off; everything else it uses must come out native. Each entry is a fact about that torch
# (the fixture's comments say which version brought what) or about the guard around it.
OPS = {"torch.ops._c10d_functional.reduce_scatter_tensor": "unknown", "torch.ops.aten.mm": "unknown",
       "torch.ops.trainer_kernels.fused_rmsnorm": "unknown"}  # an inventory has no operator list
PUBLIC_DTENSOR = {f"torch.distributed.tensor.{n}": "unresolved" for n in ("DTensor", "Replicate", "Shard")}  # 2.5
NOT_NATIVE = {
    "2.4.1": {
        **PUBLIC_DTENSOR,
        "torch.distributed.fsdp.fully_shard": "guarded",  # public FSDP2 name: 2.6; try-branch
        "torch.distributed.tensor.experimental.context_parallel": "guarded",  # 2.5; behind a version test
        "torch.distributed.tensor.experimental.local_map": "guarded",  # 2.5; under contextlib.suppress
        "torch._six": "unknown",  # gone since 2.0, but torch's own submodules are not walked
        **OPS,
    },
    "2.1.2": {
        **PUBLIC_DTENSOR,
        "torch.distributed._composable.fsdp.fully_shard": "unresolved",  # the except-branch runs: FSDP2 is 2.3+
        "torch.distributed.checkpoint.load": "unresolved",  # dcp.save/load, state_dict, stateful: 2.2
        "torch.distributed.checkpoint.save": "unresolved",
        "torch.distributed.checkpoint.state_dict.StateDictOptions": "unresolved",
        "torch.distributed.checkpoint.state_dict.get_state_dict": "unresolved",
        "torch.distributed.checkpoint.state_dict.set_state_dict": "unresolved",
        "torch.distributed.checkpoint.stateful.Stateful": "unresolved",
        "torch.distributed.device_mesh.init_device_mesh": "unresolved",  # 2.1 has it as _tensor.device_mesh
        "torch.distributed.tensor.parallel.RowwiseParallel.__init__": "unresolved",  # output_layouts=: 2.2
        "torch.uint32": "unresolved",  # 2.3
        "torch.distributed.fsdp.fully_shard": "guarded",
        "torch.distributed.tensor.experimental.context_parallel": "guarded",
        "torch.distributed.tensor.experimental.local_map": "guarded",
        "torch.nn.RMSNorm": "guarded",  # 2.4, behind hasattr
        "torch.nn.attention.SDPBackend": "guarded",  # torch.nn.attention: 2.2; try/except ImportError
        "torch.nn.attention.sdpa_kernel": "guarded",
        "torch.uint64": "guarded",  # behind hasattr in a conditional expression
        "torch._six": "unknown",
        **OPS,
    },
    "1.13.1": {
        **PUBLIC_DTENSOR,
        "torch.distributed._composable.fsdp.fully_shard": "unresolved",
        "torch.distributed.checkpoint": "unresolved",  # 1.13 has it as _shard.checkpoint
        "torch.distributed.checkpoint.load": "unresolved",
        "torch.distributed.checkpoint.save": "unresolved",
        "torch.distributed.checkpoint.state_dict.StateDictOptions": "unresolved",
        "torch.distributed.checkpoint.state_dict.get_state_dict": "unresolved",
        "torch.distributed.checkpoint.state_dict.set_state_dict": "unresolved",
        "torch.distributed.checkpoint.stateful.Stateful": "unresolved",
        "torch.distributed.device_mesh.init_device_mesh": "unresolved",  # no DTensor at all on 1.13
        "torch.distributed.tensor.parallel.ColwiseParallel": "unresolved",  # 2.0
        "torch.distributed.tensor.parallel.RowwiseParallel": "unresolved",
        "torch.distributed.tensor.parallel.parallelize_module": "unresolved",
        "torch.nn.functional.scaled_dot_product_attention": "unresolved",  # 2.0
        "torch.uint32": "unresolved",
        "torch.compile": "guarded",  # 2.0, behind hasattr
        "torch.distributed.fsdp.fully_shard": "guarded",
        "torch.distributed.tensor.experimental.context_parallel": "guarded",
        "torch.distributed.tensor.experimental.local_map": "guarded",
        "torch.nn.RMSNorm": "guarded",
        "torch.nn.attention.SDPBackend": "guarded",
        "torch.nn.attention.sdpa_kernel": "guarded",
        "torch.uint64": "guarded",
        "torch._six.inf": "unknown",  # torch._six exists, but its names are not inventoried
        **OPS,
    },
}


@pytest.mark.parametrize("version", sorted(NOT_NATIVE))
def test_inventoried_torch(version):
    data = report(TRAINER, "--torch", version, "--no-import", env=OFF)  # the inventory alone, even where installed
    assert data["torch"] == version
    found = kinds(data)
    assert {n: k for n, k in found.items() if k != "native"} == NOT_NATIVE[version]
    assert {"torch.nn.Linear", "torch.distributed.all_reduce", "torch.optim.AdamW"} <= set(found)
    assert data["exit"] == 1 if "unresolved" in NOT_NATIVE[version].values() else 0
    # the file that does not parse is reported and skipped; the others are scanned
    assert data["skipped"] == [{"file": "trainer/trainer/config.py", "line": 5, "error": data["skipped"][0]["error"]}]
    assert "SyntaxError" in data["skipped"][0]["error"]
    assert data["files"] == 8 and data["files_with_torch"] == 6  # __init__.py names no torch


@pytest.mark.parametrize("version", sorted(NOT_NATIVE))
def test_patched_rows_are_the_catalogues_doing(version):
    """With the catalogue on, a row changes only to "patched", naming the patches that serve it
    (switched off, that row is what torch alone gives and says which patch would serve it), or to
    "unknown" where a patch serves it as a module the inventory could not import, or as a shim
    module that declares none of its names."""
    off = {r["name"]: r for r in report(TRAINER, "--torch", version, "--no-import", env=OFF)["rows"]}
    on = {r["name"]: r for r in report(TRAINER, "--torch", version, "--no-import")["rows"]}
    catalogue = {r["id"]: r for r in json.loads(torchpatch_command("list", "--json").stdout)}
    for name, row in on.items():
        if row["kind"] != "patched":
            undecided = row["kind"] == "unknown" and (" serves it as " in row["note"]  # a served module's target
                                                      or "declares none of its names" in row["note"])
            assert off.get(name, {}).get("kind") == row["kind"] or undecided, (name, row)
            continue
        assert row["patches"] and all(_versions.matches(catalogue[p]["torch"], version) for p in row["patches"])
        was = off.get(name) or next(r for n, r in off.items() if name.startswith(n + "."))  # cut where it fails
        assert was["kind"] in ("unresolved", "guarded", "unknown"), (name, was)
        assert any(f"patch {p} would serve it but is off" in was["note"] for p in row["patches"]) or (
            was["kind"] == "unknown"), (name, was)
    patched = {n for n, r in on.items() if r["kind"] == "patched"}
    # the catalogue's long-standing patches, on the torch versions they are for
    expected = {
        "2.4.1": {"torch.distributed.tensor.DTensor"},
        "2.1.2": {"torch.distributed.tensor.DTensor", "torch.distributed.device_mesh.init_device_mesh",
                  "torch.distributed.checkpoint.save"},
        "1.13.1": set(),  # torch.distributed.checkpoint is served as _shard.checkpoint, which did not import there
    }[version]
    assert expected <= patched
    # names in shim modules: patched where the shim declares its names, else undecided
    in_shims = {"2.4.1": {"torch._six.inf": "torch._six"},
                "2.1.2": {"torch.distributed.checkpoint.stateful.Stateful": "torch.distributed.checkpoint.stateful"},
                "1.13.1": {}}[version]
    declared = run_json(f"""
        import json
        from torchpatch._check.serving import Serving
        from torchpatch._config import Config
        from torchpatch._registry import all_patches
        print(json.dumps(sorted(Serving.for_torch({version!r}, all_patches(), Config()).declared)))
        """)
    for name, shim in in_shims.items():
        assert on[name]["kind"] == ("patched" if shim in declared else "unknown"), on[name]


def test_rows_name_versions_guards_and_what_cannot_be_backported():
    data = report(TRAINER, "--torch", "2.1.2", "--no-import")
    rows = {r["name"]: r for r in data["rows"]}
    fsdp2 = rows["torch.distributed._composable.fsdp.fully_shard"]
    have = [v for v in inventoried()
            if "fully_shard" in inventory(v)["modules"].get("torch.distributed._composable.fsdp", {})]
    assert fsdp2["exists_in"] == have and {"2.4.1", "2.9.0", "2.13.0"} <= set(have) and "2.1.2" not in have
    assert fsdp2["not_backportable"]["torch"] == ">=2.3" and "FSDP2" in fsdp2["not_backportable"]["what"]
    assert fsdp2["locations"] == [{"file": "trainer/trainer/parallel.py", "line": 11}]
    assert not fsdp2["guarded"]  # an except-branch whose try-branch fails here runs
    public = rows["torch.distributed.fsdp.fully_shard"]
    assert public["guarded"] and public["guards"] == ["try/except ImportError (trainer/trainer/parallel.py:8)"]
    assert rows["torch.nn.RMSNorm"]["guards"] == ['if hasattr(nn, "RMSNorm") (trainer/trainer/model.py:11)']
    assert rows["torch.distributed.tensor.experimental.context_parallel"]["guards"] == [
        'if TORCH_VERSION >= Version("2.5") (trainer/trainer/compat.py:14)']
    assert rows["torch.uint32"]["not_backportable"]["torch"] == ">=2.3"
    assert rows["torch.distributed.tensor.DTensor"]["patches"] == ["dtensor-public"]
    assert rows["torch.distributed.tensor.DTensor"]["locations"] == [  # annotation, import, chain on an imported class
        {"file": "trainer/trainer/compat.py", "line": 22}, {"file": "trainer/trainer/parallel.py", "line": 5},
        {"file": "trainer/trainer/parallel.py", "line": 55}]
    assert rows["torch.distributed.ReduceOp"]["locations"] == [{"file": "trainer/trainer/parallel.py", "line": 45}]
    assert rows["torch.distributed.device_mesh.init_device_mesh"]["how"] == [
        "torch.distributed.device_mesh = torch.distributed._tensor.device_mesh (dtensor-public)"]

    # on 2.4.1 the try-branch fails and the except-branch resolves, so nothing fails
    rows = {r["name"]: r for r in report(TRAINER, "--torch", "2.4.1", "--no-import")["rows"]}
    assert rows["torch.distributed._composable.fsdp.fully_shard"]["kind"] == "native"
    # on 2.13 the try-branch resolves and the except-branch never runs
    rows = {r["name"]: r for r in report(TRAINER, "--torch", "2.13.0", "--no-import")["rows"]}
    assert rows["torch.distributed.fsdp.fully_shard"]["kind"] == "native"


def test_switched_off_patch_leaves_the_name_unresolved_and_says_why():
    data = report(TRAINER, "--torch", "2.1.2", "--no-import", env=clean_env(TORCHPATCH_DISABLE="dtensor-public"))
    rows = {r["name"]: r for r in data["rows"]}
    assert rows["torch.distributed.tensor.DTensor"]["kind"] == "unresolved"
    assert "dtensor-public would serve it but is off (in TORCHPATCH_DISABLE)" in rows["torch.distributed.tensor.DTensor"]["note"]


PROBE = r"""
import importlib, json, sys
import torch  # (first: the probe of every name imports it; the suite forks such code)

def probe(name):
    parts = name.split(".")
    if name.startswith("torch.ops."):
        import torch.distributed
        obj = torch.ops
        for part in parts[2:]:
            obj = getattr(obj, part)
        return
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module)
            break
        except ModuleNotFoundError as exc:
            if exc.name and not (module + ".").startswith(exc.name + "."):
                return  # torch has the module; a third-party package it imports is missing here
            continue
    for part in parts[i:]:
        obj = getattr(obj, part)

found = {}
for name in json.loads(sys.argv[1]):
    try:
        probe(name)
        found[name] = True
    except Exception:
        found[name] = False
print(json.dumps(found))
"""


def test_installed_torch_rows_match_what_importing_finds():
    """The reference: each name looked up for real, with torchpatch off and then on."""
    data = report(TRAINER)
    assert data["installed"] == TORCH and "installed torch" in data["source"]
    rows = [r for r in data["rows"] if r["kind"] != "unknown" and not r["name"].endswith(".__init__")]  # names
    names = json.dumps([r["name"] for r in rows])
    off = run_json(PROBE, args=[names], env=clean_env(), cwd=FIXTURES)
    on = run_json(PROBE, args=[names], env=clean_env(TORCHPATCH="1", TORCHPATCH_LOG="off"), cwd=FIXTURES)
    for row in rows:
        name, kind = row["name"], row["kind"]
        expected = {"native": (True, True), "patched": (False, True), "unresolved": (False, False),
                    "guarded": (False, False)}[kind]
        assert (off[name], on[name]) == expected, (name, kind, row)
    unknown = {r["name"]: r["note"] for r in data["rows"] if r["kind"] == "unknown"}
    assert "no operator namespace 'trainer_kernels'" in unknown["torch.ops.trainer_kernels.fused_rmsnorm"]
    assert "torch.ops.aten.mm" not in unknown and "torch.utils.data.DataLoader" not in unknown  # decided live


def test_clean_repository_exits_zero_and_reports_the_file_that_does_not_parse():
    for args in ((), ("--torch", "2.1.2"), ("--torch", "1.13.1")):
        proc = check(CLEAN, *args)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "skipped    clean/notes.py:5: SyntaxError" in proc.stdout
        assert "0 unresolved" in proc.stdout and proc.stdout.rstrip().endswith("exit 0")
    proc = check(CLEAN, "--torch", "1.13.1", env=OFF)
    assert "guarded    torch.nn.attention.sdpa_kernel" in proc.stdout and proc.returncode == 0


def test_text_report_and_usage_errors():
    proc = check(TRAINER, "--torch", "1.13.1", "--no-import", env=OFF)
    assert proc.returncode == 1
    data = report(TRAINER, "--torch", "1.13.1", "--no-import", env=OFF)
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"torchpatch check: 8 files (6 use torch), {len(data['rows'])} torch names")
    assert "torch 1.13.1" in lines[0]
    first = [line.split()[0] for line in lines[1:] if line.startswith("  ") and not line.startswith("   ")]
    assert first == sorted(first, key=["unresolved", "guarded", "unknown", "patched", "native", "skipped"].index)
    assert any("not backportable: FSDP2 (fully_shard), torch >=2.3" in line for line in lines)
    counts = data["counts"]
    assert counts["unresolved"] == 17 and counts["patched"] == 0
    assert lines[-1] == (f"17 unresolved, {counts['guarded']} guarded, {counts['unknown']} unknown, 0 patched, "
                         f"{counts['native']} native; exit 1")

    assert check(FIXTURES / "nope").returncode == 2
    help_text = check("--help").stdout
    for text in ("native", "patched", "unresolved", "guarded", "unknown", "--torch", "--json", "--no-import",
                 "Exit status: 0", "try/except ImportError", "hasattr", "TORCH_VERSION", "members",
                 "TORCHPATCH_CHECK_TIMEOUT", "X.Y"):
        assert text in help_text, text


def test_torch_version_names_a_release_or_the_newest_of_a_minor():
    known = inventoried()
    for minor in {".".join(v.split(".")[:2]) for v in known}:
        newest = max((v for v in known if v.startswith(minor + ".")), key=_versions.release)
        if not TORCH or _versions.release(TORCH)[:2] != _versions.release(minor):  # else: the installed one
            assert report(CLEAN, "--torch", minor, "--no-import")["torch"] == newest, minor
    assert report(CLEAN, "--torch", known[0], "--no-import")["torch"] == known[0]
    for bad in ("3.99", "2.4.7", "2", "latest", ""):  # never the installed torch by default
        proc = check(CLEAN, "--torch", bad)
        assert proc.returncode == 2 and f"inventoried {', '.join(known)}" in proc.stderr, (bad, proc.stderr)
        assert proc.stdout == ""
    assert "--torch '2' is ambiguous: name a minor, X.Y (its newest release), or a release, X.Y.Z" in check(
        CLEAN, "--torch", "2").stderr
    # the choice itself: the installed torch counts as a release of its minor
    assert pick_version("2.9", None, ["2.1.2", "2.9.0", "2.9.1"]) == "2.9.1"
    assert pick_version("2.9.0", None, ["2.9.0", "2.9.1"]) == "2.9.0"
    assert pick_version("2.9", "2.9.2", ["2.9.0", "2.9.1"]) == "2.9.2"
    assert pick_version("2.10", None, ["2.1.2", "2.10.0"]) == "2.10.0"  # 2.1 is not a prefix of 2.10
    with pytest.raises(ValueError, match="neither installed nor inventoried: installed 2.13.0; inventoried 2.1.2"):
        pick_version("2.2", "2.13.0", ["2.1.2"])


@pytest.mark.torch_independent
@pytest.mark.parametrize("bad", ["2.x", "1e5", "2.1.x", "1" * 5000])
def test_a_torch_that_is_no_version_is_a_usage_error(bad):
    proc = check(CLEAN, "--torch", bad)
    assert proc.returncode == 2 and proc.stdout == ""
    shown = bad if len(bad) <= 40 else bad[:37] + "..."  # not 5,000 digits back, nor Python's int-conversion limit
    assert proc.stderr.startswith(f"torchpatch check: --torch {shown!r} is not a torch version: give X.Y (the newest"
                                  " release of that minor) or X.Y.Z (installed"), proc.stderr
    assert pick_version(" v2.9.0+cu121", None, ["2.9.0"]) == pick_version("2.9.0rc1", None, ["2.9.0"]) == "2.9.0"


def test_a_directory_without_python_files_is_a_usage_error(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "notes.txt").write_text("import torch\n")
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / "hidden.py").write_text("import torch\n")  # hidden directories are skipped
    proc = check(tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith(f"torchpatch check: no Python files under {tmp_path} (hidden directories,")
    assert check(tmp_path, CLEAN, "--torch", "2.1.2").returncode == 2  # one empty directory among others
    (tmp_path / "train.py").write_text("import torch.distributed\n")
    assert check(tmp_path, "--torch", "2.1.2").returncode == 0


@pytest.mark.torch_independent
def test_only_regular_files_are_read_and_none_too_large(tmp_path):
    """A FIFO named *.py would block the scan for good and a link to /dev/zero fill the memory: neither
    is opened; a file over 10 MB is not read either. Each is a skipped row, and the scan goes on."""
    (tmp_path / "train.py").write_text("import torch.distributed\n")
    os.mkfifo(tmp_path / "fifo.py")
    (tmp_path / "zero.py").symlink_to("/dev/zero")
    with open(tmp_path / "huge.py", "wb") as f:
        f.truncate(10 * 1024 * 1024 + 1)  # sparse: nothing to read, and nothing is
    proc = check(".", "--torch", "2.1.2", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "  skipped    fifo.py: not a regular file (a FIFO)\n" in proc.stdout
    assert "  skipped    zero.py: not a regular file (a character device)\n" in proc.stdout
    assert "  skipped    huge.py: too large (10485761 bytes; files over 10485760 are not scanned)\n" in proc.stdout
    data = json.loads(check(".", "--torch", "2.1.2", "--json", cwd=tmp_path).stdout)
    assert [(s["file"], s["line"]) for s in data["skipped"]] == [("fifo.py", 0), ("huge.py", 0), ("zero.py", 0)]
    assert [r["name"] for r in data["rows"]] == ["torch.distributed"] and data["files_with_torch"] == 1


@pytest.mark.torch_independent
def test_a_fifo_that_replaces_a_file_after_its_stat_never_blocks(tmp_path):
    """The stat says a regular file (a FIFO is put in its place just after): the opening does not wait
    for a writer, and the open file is seen for what it is."""
    os.mkfifo(tmp_path / "swapped.py")
    code = f"""
import os, stat
from torchpatch._check import scan
real_stat = os.stat
os.stat = lambda path, *a, **k: os.stat_result((stat.S_IFREG | 0o644,) + tuple(real_stat(path))[1:])
print(scan.read_source({str(tmp_path / "swapped.py")!r}))
"""
    assert run_py(code, timeout=60).stdout.strip() == "(None, 'not a regular file (a FIFO)')"


def test_problems_shows_only_unresolved_guarded_and_unknown_rows():
    whole = report(TRAINER, "--torch", "2.1.2", "--no-import")
    problems = report(TRAINER, "--torch", "2.1.2", "--no-import", "--problems")
    assert problems["rows"] == [r for r in whole["rows"] if r["kind"] in ("unresolved", "guarded", "unknown")]
    assert problems["counts"] == whole["counts"] and problems["exit"] == whole["exit"] == 1
    assert problems["hidden"] == whole["counts"]["native"] + whole["counts"]["patched"] > 0
    text = check(TRAINER, "--torch", "2.1.2", "--no-import", "--problems").stdout.splitlines()
    kinds_shown = {line.split()[0] for line in text[1:-1] if line.startswith("  ") and not line.startswith("   ")}
    assert kinds_shown <= {"unresolved", "guarded", "unknown", "skipped"} and "unresolved" in kinds_shown
    assert text[0].startswith(f"torchpatch check: 8 files (6 use torch), {len(whole['rows'])} torch names")
    assert text[-1].endswith(f"; --problems: {problems['hidden']} patched and native rows not shown; exit 1")


def test_progress_is_shown_on_a_terminal_only():
    """stderr a terminal: a status line rewritten in place and cleared at the end; stderr a pipe:
    nothing but the report on stdout."""
    import pty

    main, tty = pty.openpty()
    try:
        proc = subprocess.run([sys.executable, "-m", "torchpatch", "check", str(TRAINER), "--torch", "2.1.2"],
                              stdout=subprocess.PIPE, stderr=tty, env=clean_env(), text=True, timeout=300, cwd=FIXTURES)
        os.close(tty)
        shown = b""
        while True:
            try:
                chunk = os.read(main, 65536)
            except OSError:  # the terminal's other end is closed: all read
                break
            if not chunk:
                break
            shown += chunk
    finally:
        os.close(main)
    text = shown.decode()
    assert "\rtorchpatch check: scanning file 1/8: " in text, text
    assert text.endswith("\r"), text  # cleared: the report is not mixed with it
    assert proc.stdout.startswith("torchpatch check: 8 files") and proc.returncode == 1
    piped = check(TRAINER, "--torch", "2.1.2")
    assert piped.stderr == "" and piped.stdout == proc.stdout


def test_check_never_imports_torch_in_its_own_process():
    result = run_json(
        f"""
        import json, sys
        from torchpatch import _check
        for requested in ("2.1.2", None):
            report = _check.check([{str(TRAINER)!r}], _check.choose_target(requested, live=True))
        print(json.dumps({{"torch": "torch" in sys.modules, "rows": len(report["rows"])}}))
        """
    )
    assert result["torch"] is False and result["rows"] > 50


def test_doctor_names_what_cannot_be_backported_to_this_torch():
    report = json.loads(subprocess.run([sys.executable, "-m", "torchpatch", "doctor", "--json"], capture_output=True,
                                       text=True, env=clean_env(), timeout=120).stdout)
    table = json.loads((REPO / "src" / "torchpatch" / "patches" / "_data" / "not_backportable.json").read_text())["entries"]
    named = {e["name"] for e in report["not_backportable"]}
    names = json.dumps([e["name"] for e in table])
    found = run_json(PROBE, args=[names], env=clean_env())
    served = run_json(PROBE, args=[names], env=clean_env(TORCHPATCH="1"))
    # named exactly where torch lacks it and no patch serves it (fsdp-public: the public FSDP2 name on 2.4-2.5)
    assert {e["name"] for e in table if not found[e["name"]] and not served[e["name"]]} == named
