"""The known silent-correctness bugs (``patches/_data/silent_bugs.json``): the data holds together with the
catalogue and the tests, and ``torchpatch doctor`` says of each bug of the installed torch whether this
process's configuration fixes it."""

import ast

import pytest

from conftest import REPO, TORCH_MINORS, clean_env, run_json
from torchpatch import _versions
from torchpatch._known_bugs import entries, known_bugs
from torchpatch._registry import builtin_patches

PATCHES = {p.id: p for p in builtin_patches()}


def test_every_entry_is_complete_and_names_a_correctness_patch_or_why_not():
    ids = [e["id"] for e in known_bugs()]
    assert len(ids) == len(set(ids))
    for e in known_bugs():
        assert {"id", "what", "torch", "upstream", "patch", "test"} <= set(e), e
        # the fix upstream; empty only where no release fixes the bug
        assert e["upstream"].startswith("https://github.com/pytorch/") or (e["upstream"] == "" and e["patch"]), e
        _versions.matches(e["torch"], "2.4.1")  # a valid specifier
        if e["patch"] is None:
            assert e.get("not_fixable"), e
        else:
            assert PATCHES[e["patch"]].category == "correctness", e
            assert "not_fixable" not in e, e


@pytest.mark.torch_independent
def test_an_entry_states_its_own_range_only_where_it_is_not_its_patchs():
    """A bug a patch fixes affects the torch versions of the patch's range, which the entry does not
    repeat; it states its own only where torch fixed the bug before the patch's range ends (a patch
    that fixes several bugs), strictly inside that range. A bug no patch fixes states its own."""
    for e in entries():
        if e["patch"] is None:
            assert "torch" in e, e
        elif "torch" in e:
            own = {v for v in TORCH_MINORS if _versions.matches(e["torch"], v)}
            patchs = {v for v in TORCH_MINORS if _versions.matches(PATCHES[e["patch"]].torch, v)}
            assert own < patchs, (e["id"], e["torch"], f"{e['patch']}: {PATCHES[e['patch']].torch}")


def test_every_correctness_patch_fixes_a_known_bug():
    fixed = {e["patch"] for e in known_bugs()}
    assert {p.id for p in PATCHES.values() if p.category == "correctness"} <= fixed


def test_every_entry_names_a_test_that_exists():
    for e in known_bugs():
        path, _, name = e["test"].partition("::")
        tree = ast.parse((REPO / path).read_text())
        assert name in {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}, e


# doctor on torch 2.4.1 (faked where doctor reads it), with made-up entries for real patches.
DOCTOR = """
import io, json, contextlib
from torchpatch import _cli, _known_bugs, _versions
_versions.torch_version = lambda: "2.4.1"
_known_bugs.known_bugs = lambda: [
    {"id": "a", "what": "sums", "torch": ">=2.2,<2.7", "upstream": "u", "patch": "gloo-avg", "test": "t"},
    {"id": "b", "what": "reads early", "torch": "<2.5", "upstream": "u", "patch": None, "not_fixable": "in C++", "test": "t"},
    {"id": "c", "what": "old", "torch": "<2.2", "upstream": "u", "patch": "gloo-avg", "test": "t"},
    {"id": "d", "what": "narrow", "torch": "<2.5", "upstream": "u", "patch": "sdpa-backport", "test": "t"},
]
with contextlib.redirect_stdout(io.StringIO()) as report:
    _cli.main(["doctor", "--json"])
with contextlib.redirect_stdout(io.StringIO()) as text:
    _cli.main(["doctor"])
print(json.dumps({"bugs": {b["id"]: [b["fixed"], b["why"]] for b in json.loads(report.getvalue())["silent_bugs"]},
                  "lines": [ln for ln in text.getvalue().splitlines() if "silent bug" in ln.lower()]}))
"""


def test_doctor_says_whether_each_known_bug_is_fixed_here():
    out = run_json(DOCTOR, env=clean_env(TORCHPATCH="1"))
    assert out["bugs"] == {
        "a": [True, "fixed by patch gloo-avg"],
        "b": [False, "no patch can fix it: in C++"],
        "d": [False, "patch sdpa-backport does not apply here (for torch <2.3)"],
    }  # "c" is not a bug of torch 2.4.1
    assert out["lines"][0] == "silent bug   fixed: a (torch >=2.2,<2.7): sums; fixed by patch gloo-avg; u"
    assert out["lines"][1].startswith("SILENT BUG   NOT FIXED: b (torch <2.5): reads early; no patch can fix it")
    off = run_json(DOCTOR, env=clean_env())["bugs"]["a"]
    assert off == [False, "torchpatch is off: set TORCHPATCH=1 (patch gloo-avg fixes it)"]
    switched = run_json(DOCTOR, env=clean_env(TORCHPATCH="1", TORCHPATCH_GLOO_AVG="0"))["bugs"]["a"]
    assert switched == [False, "patch gloo-avg is switched off (TORCHPATCH_GLOO_AVG=0)"]


def test_doctor_lists_the_installed_torchs_known_bugs():
    report = run_json("""
        import io, json, contextlib
        from torchpatch import _cli
        with contextlib.redirect_stdout(io.StringIO()) as out:
            _cli.main(["doctor", "--json"])
        print(json.dumps(json.loads(out.getvalue())["silent_bugs"]))
    """, env=clean_env(TORCHPATCH="1"))
    torch = _versions.torch_version()
    expected = [e["id"] for e in known_bugs() if _versions.matches(e["torch"], torch)]
    assert [b["id"] for b in report] == expected
    for b in report:  # with TORCHPATCH=1 and no opt-out, fixed exactly where a patch for this torch exists
        patch = PATCHES.get(b["patch"]) if b["patch"] else None
        assert b["fixed"] is bool(patch and _versions.matches(patch.torch, torch)), b
