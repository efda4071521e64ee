"""A served module carries its newest counterpart's whole surface (issue 42): on the installed torch, each
module torchpatch serves (a shim, an alias, or a module it serves members onto) has, with TORCHPATCH=1,
every name of the newest inventoried torch's module of that name (tools/served_surface.py says which
names count), or the name is declared in ``served_surface_gaps.json`` (or ``not_backportable.json``); and
no declared gap is there after all. Looked up live, in one process."""

import json
import sys

import pytest

from conftest import REPO, TORCH, clean_env, run_json

sys.path.insert(0, str(REPO / "tools"))
import served_surface  # noqa: E402

from torchpatch._check.inventory import Inventory, inventory_files  # noqa: E402

HERE = served_surface.installed_inventory(TORCH or "")
ORACLE = served_surface.newest()
SERVED = served_surface.served_modules(TORCH or "", HERE, ORACLE) if HERE is not None else {}


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    if HERE is None:
        pytest.skip(f"torch {TORCH} has no inventory: which names it has natively is not known")
    if not SERVED:
        pytest.skip(f"torchpatch serves no module of torch {ORACLE.version}'s on torch {TORCH}")
    asked = served_surface.wanted(SERVED, ORACLE)
    listing = tmp_path_factory.mktemp("surface") / "names.json"
    listing.write_text(json.dumps(asked))
    found = run_json(served_surface.PROBE, args=(str(listing),), env=clean_env(TORCHPATCH="1"), timeout=300)
    return served_surface.difference(found, asked)


def test_served_modules_have_the_newest_names_or_declare_them(probed):
    assert probed.errors == {}, "served modules that fail to import with TORCHPATCH=1"
    assert probed.undeclared(TORCH, served_surface.load_gaps()) == []


def test_declared_gaps_are_missing_here(probed):
    assert served_surface.stale(TORCH, SERVED, probed, served_surface.load_gaps()) == []


@pytest.mark.torch_independent
def test_each_declared_gap_is_a_newest_name_some_inventoried_torch_lacks():
    """Each entry names a counted name of the newest torch's module, and some inventoried torch is
    served that module without the name natively (an entry no torch needs is stale)."""
    gaps = served_surface.load_gaps()
    needed = set()
    for version, path in list(inventory_files().items())[:-1]:
        here = Inventory.load(path)
        for module, served in served_surface.served_modules(version, here, ORACLE).items():
            needed |= {(module, n) for n in served_surface.surface(ORACLE, module) - served.native}
    assert sorted(f"{m}.{n}" for m, n in gaps if n not in served_surface.surface(ORACLE, m)) == []
    assert sorted(f"{m}.{n}" for m, n in set(gaps) - needed) == []
