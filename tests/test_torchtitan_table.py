"""tools/torchtitan_table.py without torchtitan: the docs' table of the release x torch pairs it ran
replaces only those rows (a release, or a torch, is trained again without training the others), and its
"DCP older to newer" column, or the columns of some parallelisms (alone, or with the FSDP and DCP ones), are
written alone into the rows they ran."""

from __future__ import annotations

import json
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
                         "dcp_from_older": _older(torches[0], t),
                         **{p: {**run, "is_reference": t == torches[-1]} for p in table.PARALLELS}}
                     for t in torches}}


def _older(saver: str, torch: str, error: str = "") -> dict:
    if torch == saver:
        return {"saves": True, "error": ""}
    return {"saved_by": saver, "error": error, "losses": [2.0, 1.0], "same_weights": True, "vs_uninterrupted": 0.0}


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


def test_older_to_newer_column_alone(tmp_path, monkeypatch):
    """``--only-dcp-from-older --write`` adds the column to a page without it, fills the rows it ran (which
    torch saved, the difference, or the resume's error) and keeps every other cell."""
    page = tmp_path / "torchtitan.md"
    full = table.markdown([_result("0.1.0", ["2.4.1", "2.9.0", "2.15.0"])]).splitlines()
    without = [row.rsplit("|", 2)[0] + "|" for row in full]  # the page before the column existed
    page.write_text(f"intro\n{table.MARKERS[0]}\n" + "\n".join(without) + f"\n{table.MARKERS[1]}\noutro\n")
    monkeypatch.setattr(table, "PAGE", page)
    error = "RuntimeError: Missing key in checkpoint state_dict: lr_scheduler._is_initial."
    table.write_columns({table.OLDER_COLUMN: {("0.1.0", "2.9.0"): table._dcp_from_older(_older("2.4.1", "2.9.0")),
                                              ("0.1.0", "2.15.0"): table._dcp_from_older(_older("2.4.1", "2.15.0", error))}})
    rows = page.read_text().split(table.MARKERS[0])[1].split(table.MARKERS[1])[0].strip().splitlines()
    assert rows[0] == full[0] and rows[1] == full[1]
    cells = {row.split("|")[2].split()[0]: row.rsplit("|", 2)[1].strip() for row in rows[2:]}
    assert cells == {"2.4.1": "", "2.9.0": "from 2.4.1: resumes, equal (0.0e+00)",
                     "2.15.0": f"from 2.4.1: fails: `{error}`"}
    assert [row.rsplit("|", 2)[0] for row in rows] == [row.rsplit("|", 2)[0] for row in full]
    assert next(r for r in full if "| 2.4.1 |" in r and "cannot" not in r).endswith(
        "| saves the checkpoint the newer torches resume |")


def test_parallel_columns_alone(tmp_path, monkeypatch):
    """``--only-parallel --write`` adds the parallelisms' columns a page lacks where ``PARALLELS`` puts them
    (before the DCP columns), fills the rows it ran, leaves the others' new cells empty and keeps every
    other cell; a newest torch's cell whose native run failed says so before its run with TORCHPATCH=1."""
    page = tmp_path / "torchtitan.md"
    old = [p for p in table.PARALLELS if p not in ("pp+fsdp+tp", "hsdp+tp")]
    full = table.markdown([_result("0.1.0", ["2.4.1", "2.9.0", "2.15.0"])], old).splitlines()
    page.write_text(f"intro\n{table.MARKERS[0]}\n" + "\n".join(full) + f"\n{table.MARKERS[1]}\noutro\n")
    monkeypatch.setattr(table, "PAGE", page)
    run = {"losses": [2.0, 1.0], "grad_norms": [1.0, 1.0], "weights": "w", "error": "", "vs_reference": 1e-7,
           "is_reference": False, "reference": "one process", "same_weights": True}
    refused = {**run, "error": "NotImplementedError: Using TP with HSDP is not supported", "vs_reference": None}
    patched = {**run, "native_error": "RuntimeError: Cannot use ReduceOp.PREMUL_SUM with Gloo"}
    table.write_columns({"hsdp+tp": {("0.1.0", "2.9.0"): table._cell(refused), ("0.1.0", "2.15.0"): table._cell(patched)},
                         "pp+fsdp+tp": {("0.1.0", "2.9.0"): table._cell(run)}})
    rows = page.read_text().split(table.MARKERS[0])[1].split(table.MARKERS[1])[0].strip().splitlines()
    headers = [c.strip() for c in rows[0].split("|")[1:-1]]
    assert headers == [c.strip() for c in full[0].split("|")[1:-1][:3 + len(old)]] + [
        "pp+fsdp+tp", "hsdp+tp", "DCP save + resume", "DCP from the newest torch", table.OLDER_COLUMN]
    cells = {row.split("|")[2].split()[0]: [c.strip() for c in row.split("|")[1:-1]] for row in rows[2:] if "cannot" not in row}
    at = headers.index("pp+fsdp+tp")
    assert cells["2.9.0"][at:at + 2] == ["trains, equal (1.0e-07) to one process",
                                         "fails: `NotImplementedError: Using TP with HSDP is not supported`"]
    assert cells["2.15.0"][at:at + 2] == ["", "natively `RuntimeError: Cannot use ReduceOp.PREMUL_SUM with Gloo`; "
                                          "TORCHPATCH=1: trains, equal (1.0e-07) to one process"]
    assert cells["2.4.1"][at:at + 2] == ["", ""]
    for row, before in zip(rows, full):  # every other cell kept
        assert [c for i, c in enumerate(row.split("|")) if i - 1 not in (at, at + 1)] == before.split("|")


def test_whole_run_with_some_parallels(tmp_path, monkeypatch):
    """A whole run with some ``--parallel`` writes its FSDP, parallelisms' and DCP cells into the rows it
    ran, a row that said "cannot start" included, and keeps the other columns and rows; a torch that cannot
    start now gets that row's cells."""
    page = tmp_path / "torchtitan.md"
    full = table.markdown([_result("0.2.2", ["2.9.0", "2.15.0"])]).splitlines()  # with 2.4.1 cannot start
    page.write_text(f"intro\n{table.MARKERS[0]}\n" + "\n".join(full) + f"\n{table.MARKERS[1]}\noutro\n")
    monkeypatch.setattr(table, "PAGE", page)
    some = ["fsdp", "pp"]
    now = {**_result("0.2.2", ["2.4.1", "2.15.0"], error="RuntimeError: y"), "cannot_start": {}}
    now["runs"]["2.4.1"]["native_fsdp_error"] = "ImportError: z"
    json_file = tmp_path / "run.json"
    json_file.write_text(json.dumps([now]))
    assert table.main(["--from-json", str(json_file), *(f"--parallel={p}" for p in some), "--write"]) == 0
    rows = page.read_text().split(table.MARKERS[0])[1].split(table.MARKERS[1])[0].strip().splitlines()
    assert rows[:2] == full[:2] and len(rows) == len(full)
    headers = [c.strip() for c in full[0].split("|")[1:-1]]
    cells = {row.split("|")[2].split()[0]: [c.strip() for c in row.split("|")[1:-1]] for row in rows[2:]}
    written = {"natively (FSDP)", *some, "DCP save + resume", "DCP from the newest torch", table.OLDER_COLUMN}
    for torch in ("2.4.1", "2.15.0"):
        before = next(r for r in full if f"| {torch}" in r)
        for header, cell, old in zip(headers, cells[torch], before.split("|")[1:-1]):
            assert cell == (old.strip() if header not in written else cell)
        assert all(cells[torch][headers.index(p)] == "fails: `RuntimeError: y`" for p in some)
    assert cells["2.4.1"][:3] == ["0.2.2", "2.4.1", "`ImportError: z`"]
    assert cells["2.4.1"][headers.index("tp")] == ""  # not run: the cannot-start row's empty cell kept
    assert cells["2.4.1"][headers.index(table.OLDER_COLUMN)] == "saves the checkpoint the newer torches resume"
    assert cells["2.15.0"][headers.index(table.OLDER_COLUMN)] == "from 2.4.1: resumes, equal (0.0e+00)"
    assert rows[[r.split("|")[2].split()[0] for r in rows].index("2.9.0")] == next(r for r in full if "| 2.9.0 |" in r)

    gone = {**now, "runs": {"2.15.0": now["runs"]["2.15.0"]}, "cannot_start": {"2.4.1": "ModuleNotFoundError: w"}}
    json_file.write_text(json.dumps([gone]))
    assert table.main(["--from-json", str(json_file), *(f"--parallel={p}" for p in some), "--write"]) == 0
    rows = page.read_text().split(table.MARKERS[0])[1].split(table.MARKERS[1])[0].strip().splitlines()
    row = [c.strip() for c in next(r for r in rows if "| 2.4.1 |" in r).split("|")[1:-1]]
    assert row[2] == "cannot start with TORCHPATCH=1: `ModuleNotFoundError: w`"
    assert all(row[headers.index(h)] == "" for h in written - {"natively (FSDP)"})
