"""``torchpatch check`` and the catalogue's shim modules: a name inside a module that only a
torchpatch shim serves is patched only where the shim holds it. The shim's patch declares what it
holds (``Patch.sets`` on the shim's name, or ``Patch.symbol``); where the target torch is installed,
check also builds the shim (a helper with torchpatch on) and looks. A name neither vouches for is
unresolved, or unknown where a shim declares nothing and cannot be built here."""

import json

import pytest

from conftest import HERE, TORCH, clean_env, only_torch, run_json, run_py, torchpatch_command
from torchpatch import Patch
from torchpatch._check import check as run_check
from torchpatch._check import choose_target
from torchpatch._config import Config

FIXTURES = HERE / "fixtures" / "check"
SHIMS = FIXTURES / "shims"
SCHEDULES = "torch.distributed.pipelining.schedules"
LATER = (f"{SCHEDULES}.ScheduleZBVZeroBubble", f"{SCHEDULES}._PipelineScheduleRuntime")  # torch 2.5/2.6


def report(*args, env=None):
    proc = torchpatch_command("check", *args, "--json", env=env, cwd=FIXTURES)
    assert proc.returncode in (0, 1), proc.stderr
    return {r["name"]: r for r in json.loads(proc.stdout)["rows"]}


def declared_modules(version):
    """The modules for which the real catalogue declares names on ``version``."""
    return run_json(f"""
        import json
        from torchpatch._check.serving import Serving
        from torchpatch._config import Config
        from torchpatch._registry import all_patches
        print(json.dumps(sorted(Serving.for_torch({version!r}, all_patches(), Config()).declared)))
        """)


def fake_pipelining(*declared):
    """A shim of torch.distributed.pipelining and its schedules for torch < 2.4, holding ``declared``."""
    patch = Patch(id="fake-pipelining", summary="pipelining for old torch", torch="<2.4",
                  upstream="https://example.invalid")
    patch.module("torch.distributed.pipelining")(lambda module: None)
    patch.module(SCHEDULES)(lambda module: None)
    patch.sets("torch.distributed.pipelining", ("PipelineStage",))
    if declared:
        patch.sets(SCHEDULES, declared)
    return patch


def rows(patch, version="2.1.2"):
    report = run_check([str(SHIMS / "pipeline.py")], choose_target(version, live=False), patches=[patch], cfg=Config())
    return {r["name"]: r for r in report["rows"]}


def test_a_shim_holds_what_its_patch_declares_and_nothing_else():
    found = rows(fake_pipelining("ScheduleGPipe"))
    assert found[f"{SCHEDULES}.ScheduleGPipe"]["kind"] == "patched"
    assert found[f"{SCHEDULES}.ScheduleGPipe"]["patches"] == ["fake-pipelining"]
    assert found["torch.distributed.pipelining.PipelineStage"]["kind"] == "patched"
    for name in LATER:
        assert found[name]["kind"] == "unresolved", found[name]
        assert "2.13.0" in found[name]["exists_in"] and "2.1.2" not in found[name]["exists_in"]


def test_a_shim_that_declares_nothing_leaves_its_names_undecided():
    found = rows(fake_pipelining())
    for name in (f"{SCHEDULES}.ScheduleGPipe",) + LATER:
        assert found[name]["kind"] == "unknown", found[name]
        assert "is a torchpatch shim (fake-pipelining) that declares none of its names" in found[name]["note"]


def test_the_catalogue_never_says_patched_for_a_schedule_that_does_not_import():
    """On 2.1.2 the pipelining patch serves the package without the zero-bubble schedules (the
    import fails with TORCHPATCH=1); on 2.4.1 pipelining-zbv serves them."""
    found = report(SHIMS / "pipeline.py", "--torch", "2.1.2", "--no-import")
    undeclared = "unresolved" if SCHEDULES in declared_modules("2.1.2") else "unknown"
    for name in LATER:
        assert found[name]["kind"] == undeclared, found[name]
    found = report(SHIMS / "pipeline.py", "--torch", "2.4.1", "--no-import")
    for name in LATER:
        assert found[name]["kind"] == "patched" and found[name]["patches"] == ["pipelining-zbv"], found[name]


@only_torch(">=2.0", "torch-six serves torch._six from 2.0 on")
def test_where_torch_is_installed_check_builds_the_shim_to_see():
    found = report(SHIMS / "six.py")
    assert found["torch._six.inf"]["kind"] == found["torch._six.string_classes"]["kind"] == "patched"
    assert found["torch._six.no_such_name"]["kind"] == "unresolved"
    failing = run_py("from torch._six import no_such_name", env=clean_env(TORCHPATCH="1", TORCHPATCH_LOG="off"))
    assert "cannot import name 'no_such_name'" in failing.stderr


@only_torch(">=2.1,<2.4", "the pipelining patch serves torch.distributed.pipelining on 2.1-2.3")
def test_the_installed_torchs_pipelining_shim_is_built_to_see():
    found = report(SHIMS / "pipeline.py")
    assert found[f"{SCHEDULES}.ScheduleGPipe"]["kind"] == "patched"
    for name in LATER:
        assert found[name]["kind"] == "unresolved", found[name]
    failing = run_py(f"from {SCHEDULES} import ScheduleZBVZeroBubble",
                     env=clean_env(TORCHPATCH="1", TORCHPATCH_LOG="off"))
    assert "cannot import name 'ScheduleZBVZeroBubble'" in failing.stderr


def test_the_catalogues_shims_declare_exactly_what_they_hold():
    """Each shim module the catalogue serves on the installed torch, built for real (TORCHPATCH=1),
    holds exactly the names its patches declare: what check says of an inventoried torch is true."""
    if TORCH is None:
        pytest.skip("needs an installed torch")
    found = run_json(f"""
        import importlib, json
        from torchpatch._check.serving import Serving
        from torchpatch._config import Config
        from torchpatch._registry import all_patches
        serving = Serving.for_torch({TORCH!r}, all_patches(), Config())
        out = {{}}
        for name in serving.shims:
            module = importlib.import_module(name)
            if getattr(module, "__file__", None) is not None:
                continue  # torch has it: nothing is served
            out[name] = [sorted(n for n in vars(module)  # its submodules are shims of their own
                                if not n.startswith("__") and f"{{name}}.{{n}}" not in serving.shims),
                         sorted(n for m, n in serving.symbols if m == name)]
        print(json.dumps(out))
        """, env=clean_env(TORCHPATCH="1", TORCHPATCH_LOG="off"))
    for name, (built, declared) in found.items():
        assert built == declared, (name, "built:", built, "declared:", declared)
