"""tools/torchtitan_table.py without torchtitan: the docs' table of the release x torch pairs it ran
replaces only those rows (a release, or a torch, is trained again without training the others)."""

from __future__ import annotations

import sys

from conftest import REPO

sys.path.insert(0, str(REPO / "tools"))
import torchtitan_table as table  # noqa: E402


def _result(release: str, torches, error: str = "") -> dict:
    run = {"losses": [2.0, 1.0], "grad_norms": [1.0, 1.0], "weights": "w", "error": error, "vs_reference": 0.0,
           "is_reference": False, "reference": "native", "same_weights": True}
    resume = {"error": "", "losses": [2.0, 1.0], "vs_uninterrupted": 0.0}
    return {"release": release, "reference": torches[-1], "cannot_start": {"2.4.1": "ModuleNotFoundError: x"},
            "runs": {t: {"native_fsdp_error": "", "dcp_resume": resume, "dcp_from_newest": resume,
                         **{p: {**run, "is_reference": t == torches[-1]} for p in table.PARALLELS}}
                     for t in torches}}


def test_write_replaces_only_the_rows_it_ran(tmp_path, monkeypatch):
    page = tmp_path / "torchtitan.md"
    first = table.markdown([_result("0.1.0", ["2.4.1", "2.15.0"]), _result("0.2.2", ["2.14.1", "2.15.0"]),
                            _result("0.10.0", ["2.15.0"])])
    page.write_text(f"intro\n{table.MARKERS[0]}\nstale\n{table.MARKERS[1]}\noutro\n")
    monkeypatch.setattr(table, "PAGE", page)
    table.write_page(first)
    assert page.read_text() == f"intro\n{table.MARKERS[0]}\n{first}\n{table.MARKERS[1]}\noutro\n"

    again = table.markdown([_result("0.2.2", ["2.13.0", "2.14.1", "2.15.0"], error="RuntimeError: y")])
    table.write_page(again)
    rows = page.read_text().split(table.MARKERS[0])[1].split(table.MARKERS[1])[0].strip().splitlines()
    assert rows[:2] == first.splitlines()[:2]
    releases = [(r.split("|")[1].strip(), r.split("|")[2].split()[0]) for r in rows[2:]]
    assert releases == [("0.1.0", "2.4.1"), ("0.1.0", "2.4.1"), ("0.1.0", "2.15.0"),
                        ("0.2.2", "2.4.1"), ("0.2.2", "2.13.0"), ("0.2.2", "2.14.1"), ("0.2.2", "2.15.0"),
                        ("0.10.0", "2.4.1"), ("0.10.0", "2.15.0")]
    assert [r for r in rows if r.startswith("| 0.2.2 |")] == again.splitlines()[2:]
    assert [r for r in rows if r.startswith("| 0.1.0 |")] == [r for r in first.splitlines() if r.startswith("| 0.1.0 |")]

    newer = table.markdown([_result("0.2.2", ["2.9.0", "2.15.0"], error="RuntimeError: z")])
    table.write_page(newer)
    rows = page.read_text().split(table.MARKERS[0])[1].split(table.MARKERS[1])[0].strip().splitlines()
    assert [r for r in rows if r.startswith("| 0.2.2 |")] == [
        *newer.splitlines()[2:4], *again.splitlines()[3:5], newer.splitlines()[4]]  # 2.4.1, 2.9.0 | 2.13.0, 2.14.1 | 2.15.0


def test_the_reference_is_never_compared_with_itself():
    """The newest torch's native runs are the reference: their cells say so and show the comparison
    with its one process, never "equal" to themselves."""
    rows = table.markdown([_result("0.1.0", ["2.9.0", "2.15.0"])]).splitlines()
    older, newest = next(r for r in rows if "| 2.9.0 |" in r), next(r for r in rows if "2.15.0" in r)
    assert "trains, equal (0.0e+00)" in older and "the reference" not in older
    assert newest.count("the reference; one process: equal (0.0e+00)") == len(table.PARALLELS)
    assert "trains, equal" not in newest
