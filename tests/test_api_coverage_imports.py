"""The coverage table (tools/api_coverage.py, issue 27) against real imports on this torch: every public
name of the newest inventoried torch is imported (a module) or looked up on its imported module (a
name), natively and with TORCHPATCH=1, in one process each. Natively, what the table says this torch
lacks is absent and the rest is there (the inventory is right); with TORCHPATCH=1, what it says is
served is there, nothing that imports natively breaks (the import survey's rule), and nothing it says
is missing or not servable appears unannounced (a served module's names are declared). Names the
inventory could not see (modules that failed to import when it was taken) are left out."""

import json
import sys

import pytest

from conftest import REPO, TORCH, clean_env, run_json
from torchpatch import _versions
from torchpatch._check.inventory import Inventory, inventory_files

sys.path.insert(0, str(REPO / "tools"))
import api_coverage  # noqa: E402

PROBE = """
import importlib, json, sys, warnings
warnings.simplefilter("ignore")

def present(name):
    try:
        importlib.import_module(name)
        return True
    except ImportError:
        pass
    module, _, attr = name.rpartition(".")
    try:
        return hasattr(importlib.import_module(module), attr)
    except ImportError:
        return False

with open(sys.argv[1]) as f:
    names = json.load(f)
print(json.dumps({name: present(name) for name in names}))
"""

RELEASE = _versions.release(TORCH or "") or ()
INVENTORY = inventory_files().get(".".join(map(str, RELEASE)))
pytestmark = pytest.mark.skipif(
    INVENTORY is None or RELEASE[:2] < api_coverage.OLDEST,
    reason=f"the table covers the inventoried torch releases from {'.'.join(map(str, api_coverage.OLDEST))}; "
           f"have {TORCH}")


@pytest.fixture(scope="module")
def table():
    newest = Inventory.load(inventory_files()[next(reversed(inventory_files()))])
    coverage = api_coverage.coverage_of(Inventory.load(INVENTORY), newest)
    unknown = set(coverage.lacking["unknown"]) | {
        n for n in api_coverage.public_names(newest) if any(n == m or n.startswith(m + ".") for m in newest.failing)}
    return api_coverage.public_names(newest), coverage, unknown


def probe(names, tmp_path, **env):
    listing = tmp_path / "names.json"
    listing.write_text(json.dumps(names))
    return run_json(PROBE, args=(str(listing),), env=clean_env(**env), timeout=600)


def test_the_inventory_is_right_natively(table, tmp_path):
    names, coverage, unknown = table
    lacking = {n for state in api_coverage.LACKING for n in coverage.lacking[state]}
    found = probe([n for n in names if n not in unknown], tmp_path)
    assert sorted(n for n, here in found.items() if here and n in lacking) == []
    assert sorted(n for n, here in found.items() if not here and n not in lacking) == []


def test_served_names_import_and_nothing_else_changes(table, tmp_path):
    names, coverage, unknown = table
    served = set(coverage.lacking["served"])
    unserved = set(coverage.lacking["missing"]) | set(coverage.lacking["not servable"])
    found = probe([n for n in names if n not in unknown], tmp_path, TORCHPATCH="1")
    assert sorted(n for n in served if not found[n]) == []
    assert sorted(n for n, here in found.items() if not here and n not in unserved) == []
    assert sorted(n for n in unserved if found[n]) == []
