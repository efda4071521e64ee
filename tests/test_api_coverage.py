"""tools/api_coverage.py's rules, on made-up inventories: which names are public, and how a name the
older torch lacks is classified (served, not servable, missing, unknown). The real figures are the tool's
output, not asserted here."""

import sys

import pytest

from conftest import REPO
from torchpatch._check.inventory import Inventory, InventoryView
from torchpatch._check.resolve import Resolver
from torchpatch._check.serving import Serving

sys.path.insert(0, str(REPO / "tools"))
import api_coverage  # noqa: E402

pytestmark = pytest.mark.torch_independent  # made-up inventories and serving

NEWEST = Inventory({"torch": "2.15.0", "walked": ["torch.distributed"], "failing": {}, "modules": {
    "torch.distributed": {
        "old_fn": "torch.distributed:old_fn", "served_fn": "torch.distributed:served_fn",
        "Impl": "torch.distributed._impl:Impl",  # defined in a private submodule: public here
        "Hook": "torch._C._distributed_c10d:Hook",  # a C binding imported (no __all__ here): not public
        "new_fn": "torch.distributed.distributed_c10d:new_fn",  # re-exported: counted where defined
        "Sequence": "collections.abc:Sequence", "Optional": "", "annotations": "", "logger": "",
        "CONST": "", "_hidden": "torch.distributed:_hidden", "os": "<module>", "newmod": "<module>"},
    "torch.distributed.distributed_c10d": {"new_fn": "torch.distributed.distributed_c10d:new_fn",
                                           "Store": "torch._C._distributed_c10d:Store",  # listed: public
                                           "Hidden": "torch._C._distributed_c10d:Hidden",  # not listed
                                           "helper": "torch.distributed.distributed_c10d:helper"},
    "torch.distributed.newmod": {"thing": "torch.distributed.newmod:thing",
                                 "Reexported": "torch.distributed.blocked:x"},  # listed, counted in blocked
    "torch.distributed.blocked": {"x": "torch.distributed.blocked:x"},
    "torch.distributed.flaky": {"y": "torch.distributed.flaky:y"},
    "torch.distributed._private": {"pub": "torch.distributed._private:pub"},
    "torch.nn": {"Linear": "torch.nn:Linear"},
}, "exports": {"torch.distributed.distributed_c10d": ["new_fn", "Store"],
               "torch.distributed.newmod": ["thing", "Reexported"]}})
OLDER = Inventory({"torch": "2.4.1", "walked": ["torch.distributed"], "modules": {
    "torch.distributed": {"old_fn": "torch.distributed:old_fn", "Impl": "torch.distributed._impl:Impl",
                          "Hook": "torch._C._distributed_c10d:Hook", "CONST": ""},
    "torch.distributed.distributed_c10d": {"Store": "torch._C._distributed_c10d:Store"},
}, "failing": {"torch.distributed.flaky": "ModuleNotFoundError: No module named 'etcd'"}})


def test_public_names_are_those_listed_in_all_or_else_defined_in_public_modules():
    assert api_coverage.public_names(NEWEST) == [
        "torch.distributed", "torch.distributed.CONST", "torch.distributed.Impl",
        "torch.distributed.blocked", "torch.distributed.blocked.x",
        "torch.distributed.distributed_c10d", "torch.distributed.distributed_c10d.Store",
        "torch.distributed.distributed_c10d.new_fn",
        "torch.distributed.flaky", "torch.distributed.flaky.y",
        "torch.distributed.newmod", "torch.distributed.newmod.thing",
        "torch.distributed.old_fn", "torch.distributed.served_fn"]


@pytest.mark.parametrize("module, value, defined", [
    ("torch.distributed.tensor", "torch.distributed.tensor:DTensor", True),
    ("torch.distributed.tensor", "torch.distributed.tensor._api:DTensor", True),
    ("torch.distributed", "torch.distributed.device_mesh:DeviceMesh", False),  # a public submodule's
    ("torch.distributed.tensor", "torch.distributed._functional_collectives:wait", False),  # not beneath it
    ("torch.distributed", "torch._C._distributed_c10d:Store", False),  # a binding, imported
    ("torch.distributed", "typing:cast", False),
    ("torch.distributed", "", True),
])
def test_defined_in(module, value, defined):
    assert api_coverage.defined_in(module, value) is defined


def test_classify_each_lacking_name(monkeypatch):
    entry = {"name": "torch.distributed.blocked", "torch": ">=2.5", "what": "a kernel", "why": "needs CUDA code"}
    monkeypatch.setattr(api_coverage, "not_backportable_for",
                        lambda name: entry if name.startswith(entry["name"]) else None)
    serving = Serving(symbols={("torch.distributed", "served_fn"): "some-patch",
                               ("torch.distributed", "new_fn"): "some-patch"})  # served as a re-export only
    resolver = Resolver(InventoryView(OLDER, [OLDER, NEWEST]), OLDER.version, serving)
    homes = api_coverage.reexports(NEWEST)
    assert homes == {"torch.distributed.distributed_c10d.new_fn": ["torch.distributed.new_fn"],
                     "torch.distributed.blocked.x": ["torch.distributed.newmod.Reexported"]}
    found = api_coverage.classify(api_coverage.public_names(NEWEST), resolver, OLDER.version, homes)
    assert found.lacking == {
        "served": ["torch.distributed.served_fn"],
        "not servable": ["torch.distributed.blocked", "torch.distributed.blocked.x"],
        "missing": ["torch.distributed.distributed_c10d.new_fn", "torch.distributed.newmod",
                    "torch.distributed.newmod.thing"],
        "unknown": ["torch.distributed.flaky", "torch.distributed.flaky.y"]}
    assert found.reasons["torch.distributed.blocked.x"] == "a kernel (torch >=2.5): needs CUDA code"
    assert "failed to import" in found.reasons["torch.distributed.flaky"]
    assert found.reasons["torch.distributed.distributed_c10d.new_fn"] == "served as torch.distributed.new_fn"
    assert found.total == 6 and found.share("served") == pytest.approx(1 / 6)  # unknown ones aside


def test_targets_and_grouping():
    assert [api_coverage.target(v) for v in ("2.3.1", "2.4.1", "2.8.0", "2.9.1", "2.12.1", "2.14.1")] == [
        None, 0.6, 0.6, 0.8, 0.8, 0.9]
    grouped = api_coverage.by_module(["torch.distributed.newmod", "torch.distributed.newmod.thing", "torch.distributed.a.b"],
                                     ["torch.distributed", "torch.distributed.newmod"])
    assert grouped == {"torch.distributed.newmod": ["(the module)", "thing"], "torch.distributed": ["a.b"]}


def test_backend_classes_count_only_between_builds_that_have_the_backend():
    cpu = Inventory({"torch": "2.13.0", "failing": {}, "modules": {"torch.distributed.distributed_c10d": {}}})
    cuda = Inventory({"torch": "2.13.0", "failing": {}, "modules": {
        "torch.distributed.distributed_c10d": {"ProcessGroupNCCL": "torch.distributed.distributed_c10d:ProcessGroupNCCL"}}})
    assert sorted(api_coverage.not_built(cpu)) == [
        "torch.distributed.distributed_c10d.ProcessGroupNCCL", "torch.distributed.distributed_c10d.ProcessGroupNCCL2",
        "torch.distributed.distributed_c10d.ProcessGroupNCCLLazy"]
    assert api_coverage.not_built(cuda) == {}
    resolver = Resolver(InventoryView(cpu, [cpu, NEWEST]), cpu.version, Serving())
    found = api_coverage.classify(["torch.distributed.distributed_c10d.ProcessGroupNCCL"], resolver, cpu.version,
                                  unbuilt=api_coverage.not_built(cpu))
    assert found.lacking["unknown"] == ["torch.distributed.distributed_c10d.ProcessGroupNCCL"] and found.total == 0
    assert "build without NCCL" in found.reasons["torch.distributed.distributed_c10d.ProcessGroupNCCL"]
