"""flight-recorder: ``torch.distributed.flight_recorder`` (the dump analyser, ``fr_trace``) served on
torch 2.4-2.9, natively from 2.10. One script builds flight-recorder dumps (the format torch's
recorders write and its analyser reads: per rank a pickle of ``version``, ``pg_config`` and
``entries``) and runs the analyser on them: collectives that match, a size mismatch, an operation
mismatch, a rank that never joined, a missing dump, coalesced point-to-point groups in the dump
formats of torch 2.4 ("2.1") and 2.9+ ("2.10"), the entry table of ``-j``, the database of ``-o``,
and the command line's errors. It runs served (TORCHPATCH=1) where the patch applies and natively
on 2.13+, against the same expectations, so torch's own analyser validates them. On 2.15 a real
gloo dump (the flight recorder's own) checks that the synthetic entries have its keys and types,
and gloo's real dumps are analysed served on 2.9 and natively on 2.13+ alike."""

import os
import subprocess
import sys

import pytest

from conftest import (
    LEAVE_WITHOUT_TEARDOWN, RESULT, clean_env, patch_applies_here, ranks_result, run_json, run_py, through_patch_range,
    torch_matches, until_patch_range_ends, where_patch_applies, where_patch_does_not_apply
)

# A stand-in for the tabulate package (which the analyser's tables need and the venvs lack): a
# table as the repr of its rows, so that the cells themselves are compared.
TABULATE = "def tabulate(rows, headers=()):\n    return 'TABLE ' + repr((list(headers), [[str(c) for c in r] for r in rows]))\n"

DUMPS = """
import os, pickle

def entry(record_id, seq, name, sizes_in, sizes_out, pg=("0", "default_pg"), p2p_seq=0, is_p2p=False,
          state="completed", dtypes=("Float",)):
    return {"frames": [{"name": "train_step", "filename": "train.py", "line": 10 + record_id}],
            "record_id": record_id, "pg_id": int(pg[0]), "process_group": pg, "thread_name": "python",
            "thread_id": "1", "collective_seq_id": seq, "p2p_seq_id": p2p_seq, "op_id": record_id + 1,
            "profiling_name": name, "time_created_ns": 1000 + record_id, "input_sizes": sizes_in,
            "input_dtypes": list(dtypes[:len(sizes_in)]), "output_sizes": sizes_out,
            "output_dtypes": list(dtypes[:len(sizes_out)]), "state": state, "time_discovered_started_ns": None,
            "time_discovered_completed_ns": None, "retired": True, "timeout_ms": 600000, "is_p2p": is_p2p}

def write_dumps(folder, per_rank, world, version="2.10", groups=None):
    os.makedirs(folder, exist_ok=True)
    groups = groups or {"0": ("default_pg", list(range(world)))}
    config = {name: {"name": name, "desc": desc, "ranks": str(ranks)} for name, (desc, ranks) in groups.items()}
    for rank, entries in per_rank.items():
        with open(os.path.join(folder, f"rank_{rank}"), "wb") as f:
            pickle.dump({"version": version, "pg_config": config, "pg_status": {}, "comm_lib_version": "",
                         "entries": entries}, f)

def steady(rank, world):  # all_reduce, all_gather, broadcast; with 2 ranks, a send from rank 0 to rank 1
    out = [entry(0, 1, "nccl:all_reduce", [[4, 4]], [[4, 4]]),
           entry(1, 2, "nccl:all_gather", [[4]], [[4 * world]]),
           entry(2, 3, "nccl:broadcast", [[3]], [[3]])]
    if world == 2:
        out.append(entry(3, 3, f"nccl:{'send 0->1' if rank == 0 else 'recv 1<-0'}", [[5]], [[5]], p2p_seq=1,
                         is_p2p=True))
    return out

def coalesced(rank):  # rank 0 sends rank 1 a tensor in a coalesced group, then both all_reduce
    return [entry(0, 1, f"nccl:{'send 0->1' if rank == 0 else 'recv 1<-0'}", [[6]], [[6]], p2p_seq=1, is_p2p=True),
            entry(1, 1, "nccl:coalesced", [], [], p2p_seq=1, is_p2p=True),
            entry(2, 2, "nccl:all_reduce", [[2]], [[2]])]
"""

ANALYSE = DUMPS + """
import io, json, logging, pickle, sys, tempfile
sys.path.insert(0, TABULATE_DIR)
from torch.distributed.flight_recorder.fr_trace import main
from torch.distributed.flight_recorder.components.types import Collective

handler = logging.getLogger("Flight Recorder").handlers[0]
root = tempfile.mkdtemp()

def run(case, args, per_rank=None, world=2, **dump):
    folder = os.path.join(root, case)
    if per_rank is not None:
        write_dumps(folder, per_rank, world, **dump)
    log = io.StringIO()
    handler.setStream(log)
    output = os.path.join(root, "database")
    if os.path.exists(output):
        os.remove(output)
    out = {}
    try:
        main([folder, "-o", output] + args)
    except (AssertionError, ValueError, KeyError) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    except SystemExit as exc:
        out["exit"] = exc.code
    out["log"] = log.getvalue().splitlines()
    if os.path.exists(output):
        with open(output, "rb") as f:
            types, db = pickle.load(f)
        out["types"] = [[t.name, [name for name, _ in t.fields]] for t in types]
        out["collectives"] = [[c.collective_name, c.pass_check, sorted(c.missing_ranks or ()),
                               sorted(c.mismatch_collectives or ())] for c in db.collectives]
        out["calls"] = [[c.global_rank, c.collective_type, c.collective_id] for c in db.ncclcalls]
        out["groups"] = [[g.desc, g.size] for g in db.groups]
        out["all_rows_collective"] = all(type(c) is Collective for c in db.collectives)
    return out

results = {}
results["match"] = run("match", [], {r: steady(r, 2) for r in range(2)})
results["match3"] = run("match3", [], {r: steady(r, 3) for r in range(3)}, world=3)
size = {r: steady(r, 2) for r in range(2)}
size[1][0] = entry(0, 1, "nccl:all_reduce", [[4, 5]], [[4, 5]])
results["size"] = run("size", [], size)
kind = {r: steady(r, 2) for r in range(2)}
kind[1][2] = entry(2, 3, "nccl:all_reduce", [[3]], [[3]])
results["kind"] = run("kind", [], kind)
stuck = {r: steady(r, 3) for r in range(3)}
stuck[2] = stuck[2][:1]  # rank 2 never got to the all_gather
results["missing_rank"] = run("missing_rank", [], stuck, world=3)
results["missing_dump"] = run("missing_dump", [], {r: steady(r, 3) for r in range(2)}, world=3)  # none of rank 2
results["incomplete"] = run("missing_dump", ["--allow-incomplete-ranks"])
for version in ("2.1", "2.10"):
    results["coalesced_" + version] = run("coalesced_" + version, [], {r: coalesced(r) for r in range(2)},
                                          version=version)
results["print"] = run("missing_rank", ["-j", "--print_stack_trace"])
results["print_selected"] = run("match3", ["-j", "--selected-ranks", "0", "2", "--pg-filters", "default_pg"])
results["selected_without_j"] = run("match", ["--selected-ranks", "0"])
write_dumps(os.path.join(root, "versions"), {0: steady(0, 2)}, 2)
write_dumps(os.path.join(root, "versions"), {1: steady(1, 2)}, 2, version="2.9")
results["versions"] = run("versions", ["-p", "rank_"])
results["no_folder"] = run("nowhere", [])
print(json.dumps(results))
"""

def analyse(tmp_path, **env):
    (tmp_path / "tabulate.py").write_text(TABULATE)
    return run_json(ANALYSE.replace("TABULATE_DIR", repr(str(tmp_path))), env=clean_env(**env), timeout=300)


def check_findings(out):
    types = [["Database", ["groups", "memberships", "tracebacks", "collectives", "ncclcalls"]],
             ["NCCLCall", ["id", "collective_id", "group_id", "global_rank", "traceback_id", "collective_type", "sizes"]],
             ["Collective", ["id", "group_id", "pass_check", "collective_seq_id", "p2p_seq_id", "record_id", "pg_desc",
                             "collective_name", "input_sizes", "output_sizes", "expected_ranks", "collective_state",
                             "collective_frames", "input_numel", "output_numel", "missing_ranks",
                             "mismatch_collectives", "type_of_mismatch"]],
             ["Traceback", ["id", "frames"]], ["Membership", ["group_id", "global_rank"]], ["Group", ["id", "desc", "size"]]]
    match = out["match"]
    assert match["log"] == [] and match["types"] == types and match["all_rows_collective"], match
    assert match["collectives"] == [["nccl:all_reduce", True, [], []], ["nccl:all_gather", True, [], []],
                                    ["nccl:broadcast", True, [], []], ["nccl:send 0->1", True, [], []]], match
    assert match["calls"] == [[rank, name, i] for i, name in enumerate(
        ["nccl:all_reduce", "nccl:all_gather", "nccl:broadcast", "nccl:send 0->1"]) for rank in (0, 1)], match
    assert match["groups"] == [["default_pg", 2]], match
    match3 = out["match3"]
    assert match3["log"] == [] and [c[1] for c in match3["collectives"]] == [True] * 3, match3
    assert len(match3["calls"]) == 9 and match3["groups"] == [["default_pg", 3]], match3

    no_errors = ("No errors found for this collective entry, There could be some other reasons why we see collective "
                 "timeout.")  # entries after a group's first mismatch are no longer paired
    size = out["size"]
    assert size["log"] == [
        "Collective sequence number: 1 has errors", "internal record id: 0", "group info: 0:default_pg",
        "collective: nccl:all_reduce", "input sizes: [[4, 4]]", "output sizes: [[4, 4]]", "world size: 2",
        "expected ranks: {0, 1}", "collective state: completed",
        "error msg: Culprit rank 1; Error type: SIZE_OR_SYNTAX_MISMATCH, Expected input sizes: '[[4, 4]]' does not "
        "match found input sizes: '[[4, 5]]'", "collective stack trace: ", " train_step at train.py:10"] + [no_errors] * 3
    assert size["collectives"][0] == ["nccl:all_reduce", False, [], [1]], size
    kind = out["kind"]
    assert kind["log"][0] == "Collective sequence number: 3 has errors" and kind["log"][-1] == no_errors, kind
    assert ("error msg: Culprit rank 1; Error type: COLLECTIVE_TYPE_MISMATCH, Expected collective type: "
            "'broadcast' does not match found collective type: 'all_reduce'") in kind["log"], kind
    assert [c[1] for c in kind["collectives"]] == [True, True, False, True], kind
    assert kind["collectives"][2] == ["nccl:broadcast", False, [], [1]], kind

    missing = out["missing_rank"]
    report = ["internal record id: 1", "group info: 0:default_pg", "collective: nccl:all_gather", "missing ranks: {2}",
              "input sizes: [[4]]", "output sizes: [[12]]", "world size: 3", "expected ranks: {0, 1, 2}",
              "collective state: completed", "collective stack trace: ", " train_step at train.py:11"]
    assert missing["log"][:12] == ["Not all ranks joining collective, sequence number: 2"] + report, missing
    assert missing["log"][12] == "Not all ranks joining collective, sequence number: 3", missing
    assert missing["collectives"] == [["nccl:all_reduce", True, [], []], ["nccl:all_gather", True, [2], []],
                                      ["nccl:broadcast", True, [2], []]], missing
    assert [c[2] for c in missing["calls"]] == [0, 0, 0, None, None, None, None], missing

    assert out["missing_dump"] == {"error": "AssertionError: Missing dump files from ranks {2}", "log": []}
    undecided = ("We cannot decide what's wrong with this collective entry because we missed FR dumps from ranks ({2}) "
                 "so we don't have enough information. If you want to debug further use -j to dump all raw trace")
    assert out["incomplete"]["log"] == [undecided] * 3, out["incomplete"]

    table = ("TABLE ([], [['send(s=0 d=1, input_sizes=[[6]], state=completed)', 'recv(s=0 d=1, input_sizes=[[6]], "
             "state=completed)'], ['coalesced(input_sizes=None, state=completed)', 'coalesced(input_sizes=None, "
             "state=completed)'], ['None', 'None']])")
    # Format 2.10 coalesces collectives too, and logs NCCL groups not ended by a "*_coalesced" entry.
    ends = ["Rank 0 does not have a coalesced end."] * 2 + ["Rank 1 does not have a coalesced end."]
    for version, log in (("2.1", []), ("2.10", ends)):
        coalesced = out["coalesced_" + version]
        assert coalesced["log"] == log + ["Match ", "", table], coalesced
        assert coalesced["collectives"] == [["nccl:send 0->1", True, [], []], ["nccl:all_reduce", True, [], []]]
        assert coalesced["calls"] == [[0, "nccl:send 0->1", 0], [1, "nccl:send 0->1", 0], [0, "nccl:all_reduce", 1],
                                      [1, "nccl:all_reduce", 1]], coalesced

    def op(name, sizes):
        return f"{name}(input_sizes={sizes}, state=completed)"

    printed = out["print"]
    assert printed["exit"] == 0 and "collectives" not in printed and len(printed["log"]) == 2, printed
    assert eval(printed["log"][0][len("TABLE "):]) == (["Rank 0", "Rank 1", "Rank 2"], [
        [op("all_reduce", [[4, 4]])] * 3, [op("all_gather", [[4]])] * 2 + [""], [op("broadcast", [[3]])] * 2 + [""]])
    assert eval(printed["log"][1][len("TABLE "):]) == (["stack_id", "frame_stack"], [
        [str(i), str([{"name": "train_step", "filename": "train.py", "line": 10 + i}])] for i in range(3)])
    selected = out["print_selected"]
    assert selected["exit"] == 0 and len(selected["log"]) == 1, selected
    assert eval(selected["log"][0][len("TABLE "):]) == (["Rank 0", "Rank 2"], [
        [op("all_reduce", [[4, 4]])] * 2, [op("all_gather", [[4]])] * 2, [op("broadcast", [[3]])] * 2])

    assert out["selected_without_j"] == {"error": "AssertionError: Not support selecting ranks without printing entries",
                                         "log": []}
    assert out["versions"]["error"] in (
        "AssertionError: Rank 1 has different version 2.9 from the given version 2.10",
        "AssertionError: Rank 0 has different version 2.10 from the given version 2.9"), out["versions"]
    assert out["no_folder"]["error"].startswith("AssertionError: folder ") and \
        out["no_folder"]["error"].endswith("/nowhere does not exist"), out["no_folder"]


@until_patch_range_ends("flight-recorder", since="2.4")
def test_native_import_fails():
    proc = run_py("import torch.distributed.flight_recorder.fr_trace")
    assert "ModuleNotFoundError: No module named 'torch.distributed.flight_recorder'" in proc.stderr, proc.stderr[-2000:]


@where_patch_applies("flight-recorder")
def test_served_analyser(tmp_path):
    check_findings(analyse(tmp_path, TORCHPATCH="1"))
    status = run_json("import json, torchpatch, torch.distributed.flight_recorder.fr_trace as m\n"
                      "print(json.dumps([torchpatch.status().get('flight-recorder'), m.main.__module__]))",
                      env=clean_env(TORCHPATCH="1"))
    assert status == ["applied", "torch.distributed.flight_recorder.fr_trace"], status


@where_patch_does_not_apply("flight-recorder")
@through_patch_range("flight-recorder", since="2.13")
def test_native_analyser_gives_the_same_findings(tmp_path):
    check_findings(analyse(tmp_path))


@through_patch_range("flight-recorder", since="2.4")
def test_command_line(tmp_path):
    """``main()`` reads the command line: ``-j`` exits 0 after its table, a bad option exits 2; ``python -m``
    runs it as well (served: the engine's loader gives runpy the module's ``main``)."""
    (tmp_path / "tabulate.py").write_text(TABULATE)
    script = DUMPS + f"write_dumps({str(tmp_path / 'dumps')!r}, {{r: steady(r, 2) for r in range(2)}}, 2)\n"
    assert run_py(script).returncode == 0
    env = clean_env(TORCHPATCH="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")]))  # the tabulate stand-in
    code = "from torch.distributed.flight_recorder.fr_trace import main; main()"
    listed = run_py(code, env=env, args=(str(tmp_path / "dumps"), "-j"))
    assert listed.returncode == 0, listed.stderr[-2000:]
    table = "TABLE (['Rank 0', 'Rank 1'], [['all_reduce(input_sizes=[[4, 4]], state=completed)'"
    assert table in listed.stderr
    as_script = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace",
                                str(tmp_path / "dumps"), "-j"], env=env, capture_output=True, text=True, timeout=180)
    assert as_script.returncode == 0 and table in as_script.stderr, as_script.stderr[-2000:]
    bad = run_py(code, env=env, args=(str(tmp_path / "dumps"), "--mismatch_cap", "many"))
    assert bad.returncode == 2 and "argument --mismatch_cap: invalid int value: 'many'" in bad.stderr, bad.stderr


@where_patch_does_not_apply("flight-recorder")
@through_patch_range("flight-recorder", since="2.4")
def test_patch_stays_out_where_torch_has_it():
    out = run_json("import json, torchpatch, torch.distributed.flight_recorder.fr_trace as m\n"
                   "print(json.dumps([torchpatch.status().get('flight-recorder'), m.__file__]))",
                   env=clean_env(TORCHPATCH="1"))
    assert out[0] != "applied" and "site-packages/torch/distributed/flight_recorder" in out[1], out


# Two gloo ranks record a few collectives with the flight recorder on (gloo's recorder exists from
# torch 2.9), each dumps its recorder to FOLDER/rank_<rank>, and rank 0 compares the real entries with
# the synthetic ones above (keys, and the type of each value).
RECORD = DUMPS + """
import json, torch, torch.distributed as dist
import torch._C._distributed_c10d as c10d
dist.init_process_group("gloo")
rank = dist.get_rank()
pair = dist.new_group([0, 1])
dist.all_reduce(torch.ones(4))
dist.all_gather_into_tensor(torch.empty(8), torch.ones(4), group=pair)
dist.broadcast(torch.ones(3), 0)
dump = pickle.loads(c10d._dump_fr_trace())
with open(os.path.join(FOLDER, f"rank_{rank}"), "wb") as f:
    pickle.dump(dump, f)
synthetic = entry(0, 1, "nccl:all_reduce", [[4]], [[4]])
real = dump["entries"][0]
if rank == 0:
    print(RESULT + json.dumps({
        "names": [e["profiling_name"] for e in dump["entries"]], "version": dump["version"],
        "keys_only_real": sorted(set(real) - set(synthetic)), "keys_only_synthetic": sorted(set(synthetic) - set(real)),
        "types_differ": sorted(k for k in real if k in synthetic and type(real[k]) is not type(synthetic[k])
                               and real[k] is not None),
        "frame_keys": sorted(real["frames"][0]), "top_keys": sorted(dump), "pg_config": dump["pg_config"]}), flush=True)
""" + LEAVE_WITHOUT_TEARDOWN

READ_REAL = """
import io, json, logging, os, pickle, sys
from torch.distributed.flight_recorder.fr_trace import main
folder, fixed = sys.argv[1], sys.argv[2]
out = {}
try:
    main([folder])
except KeyError as exc:
    out["raw"] = f"KeyError: {exc}"
os.makedirs(fixed)
for name in os.listdir(folder):  # the groups as torch's NCCL recorder lists them
    with open(os.path.join(folder, name), "rb") as f:
        dump = pickle.load(f)
    dump["pg_config"] = {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"},
                         "1": {"name": "1", "desc": "undefined", "ranks": "[0, 1]"}}
    with open(os.path.join(fixed, name), "wb") as f:
        pickle.dump(dump, f)
handler = logging.getLogger("Flight Recorder").handlers[0]
handler.setStream(io.StringIO())
main([fixed, "-o", fixed + ".db"])
with open(fixed + ".db", "rb") as f:
    _types, db = pickle.load(f)
out["log"] = handler.stream.getvalue().splitlines()
out["collectives"] = [[c.collective_name, c.pg_desc, c.pass_check, c.input_sizes, c.output_sizes] for c in db.collectives]
print(json.dumps(out))
"""


@through_patch_range("flight-recorder", since="2.9")
def test_real_gloo_dumps(tmp_path):
    """Dumps of gloo's own flight recorder: their format is the synthetic one's; they list no group in
    ``pg_config`` (one empty entry), so the analyser fails with torch's KeyError; with the groups filled
    in, all three collectives match. Served on 2.9, natively on 2.13+: the same results."""
    folder = tmp_path / "dumps"
    folder.mkdir()
    record = ranks_result(RECORD.replace("FOLDER", repr(str(folder))).replace("RESULT", repr(RESULT)),
                          tmp_path=tmp_path, env=clean_env(TORCH_FR_BUFFER_SIZE="100"))
    assert record["names"] == ["gloo:all_reduce", "gloo:all_gather", "gloo:broadcast"], record
    assert record["version"] == "2.10" and record["keys_only_synthetic"] == [], record
    assert record["types_differ"] == [] and record["frame_keys"] == ["filename", "line", "name"], record
    assert set(record["keys_only_real"]) <= {"pg_status"}, record  # what the analyser never reads
    assert {"entries", "pg_config", "version"} <= set(record["top_keys"]), record
    assert list(record["pg_config"]) == [""], record
    env = clean_env(TORCHPATCH="1") if patch_applies_here("flight-recorder") else clean_env()
    out = run_json(READ_REAL, env=env, args=(str(folder), str(tmp_path / "fixed")))
    assert out["raw"] in ("KeyError: ('0', 0)", "KeyError: ('0', 1)"), out
    assert out["log"] == [] or out["log"] == ["tabulate is not installed. Proceeding without it."], out
    assert out["collectives"] == [["gloo:all_reduce", "0:default_pg", True, [[4]], [[4]]],
                                  ["gloo:all_gather", "1", True, [[4]], [[2, 4]]],
                                  ["gloo:broadcast", "0:default_pg", True, [[3]], [[3]]]], out


NEWEST = DUMPS + """
import io, json, logging, sys, tempfile
from torch.distributed.flight_recorder.fr_trace import main
handler = logging.getLogger("Flight Recorder").handlers[0]
handler.setStream(io.StringIO())
folder = tempfile.mkdtemp()
# A backend the analyser does not know, and an all_gather recorded as one buffer per rank (c10d's hook).
write_dumps(folder, {r: [entry(0, 1, "mybackend:all_reduce", [[2]], [[2]]),
                         entry(1, 2, "c10d:all_gather", [[4]], [[4], [4]])] for r in range(2)}, 2)
main([folder, "-o", folder + ".db"])
with open(folder + ".db", "rb") as f:
    _types, db = pickle.load(f)
print(json.dumps({"log": sorted(set(handler.stream.getvalue().splitlines())),
                  "collectives": [[c.collective_name, c.pass_check] for c in db.collectives]}))
"""


@through_patch_range("flight-recorder", since="2.4")
def test_newest_semantics(tmp_path):
    """What torch 2.15's analyser changed (2.14's raises on an unknown backend, and counts a per-rank
    all_gather as a size mismatch): served as 2.15 has it; checked natively on 2.15+ only."""
    if not patch_applies_here("flight-recorder") and not torch_matches(">=2.15"):
        pytest.skip("torch 2.10-2.14's own analyser predates these changes")
    env = clean_env(TORCHPATCH="1") if patch_applies_here("flight-recorder") else clean_env()
    out = run_json(NEWEST, env=env)
    assert out["log"] == ["unrecognized comm library 'mybackend' in profiling name 'mybackend:all_reduce'"], out
    assert out["collectives"] == [["mybackend:all_reduce", True], ["c10d:all_gather", True]], out
