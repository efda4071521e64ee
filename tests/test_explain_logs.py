"""``torchpatch explain -`` / ``PATH``: a whole log, every distinct known error once (rank prefixes stripped), and
the known errors no patch makes go away (``patches/_data/known_errors.json``), in a log or as one message."""

import io
import json
import re
import subprocess
import sys

import pytest

from conftest import clean_env, torchpatch_command
from torchpatch._check import logs
from torchpatch._registry import all_patches
from torchpatch import _versions

PARTIAL = "ImportError: cannot import name 'Partial' from 'torch.distributed._tensor'"
STATE_DICT = ("NotImplementedError: 2D state_dict is under development. Please check "
              "https://github.com/pytorch/pytorch/issues/129627 for more details.")
HSDP_TP = "NotImplementedError: Using TP with HSDP is not supported"
MISSING = "RuntimeError: Missing key in checkpoint state_dict: lr_scheduler.verbose."


def scan(text, **kw) -> logs.LogScan:
    return logs.scan(io.BytesIO(text.encode() if isinstance(text, str) else text), **kw)


def explain_json(*args, stdin=None, env=None):
    proc = torchpatch_command("explain", *args, "--json", stdin=stdin, env=env)
    assert proc.returncode in (0, 1), proc.stderr
    return proc.returncode, json.loads(proc.stdout)


@pytest.mark.parametrize("line, rank, text", [
    ("[rank1]: Traceback (most recent call last):", 1, "Traceback (most recent call last):"),
    ("[default3]:[rank3]: ValueError: x", 3, "ValueError: x"),
    ("0: [rank5]: ValueError: x", 5, "ValueError: x"),  # srun --label around torchrun: the innermost rank
    ("  12: RuntimeError: y", 12, "RuntimeError: y"),
    ("srun: error: nid001: task 3: Exited with exit code 1", None, "error: nid001: task 3: Exited with exit code 1"),
    ("[rank0]:[W1128 12:00:01 ProcessGroupGloo.cpp:1] Warning", 0, "[W1128 12:00:01 ProcessGroupGloo.cpp:1] Warning"),
    ("ValueError: 1: not a prefix", None, "ValueError: 1: not a prefix"),
    ("    x = {1: 2}", None, "    x = {1: 2}"),
])
@pytest.mark.torch_independent
def test_rank_prefixes_are_stripped(line, rank, text):
    assert logs.strip_prefix(line) == (rank, text)


def _interleaved() -> str:
    """Eight ranks of a job: steps, a warning, each rank's traceback ending in the same known error, one rank's
    missing name, and an error torchpatch does not know."""
    lines = []
    for step in range(3):
        lines += [f"[rank{r}]:step {step} loss 2.{r}" for r in range(8)]
    lines += ["[rank2]:[W1128 ProcessGroupGloo.cpp:1] Warning: a UserWarning: text"]
    for r in range(8):
        lines += [f"[rank{r}]: Traceback (most recent call last):", f'[rank{r}]:   File "train.py", line 9, in <module>',
                  f"[rank{r}]: {STATE_DICT}"]
    lines += [f"0: [rank7]: {PARTIAL}", "[rank4]: ValueError: bad batch", "srun: error: task 3: Exited with exit code 1"]
    return "\n".join(lines) + "\n"


@pytest.mark.torch_independent
def test_each_distinct_error_once_with_its_ranks_and_first_line():
    found = scan(_interleaved())
    assert found.lines == 24 + 1 + 24 + 3 and not found.binary
    state_dict, partial = sorted(found.found.values(), key=lambda f: f.first_line)
    assert (state_dict.kind, state_dict.key, state_dict.count, sorted(state_dict.ranks), state_dict.first_line) == (
        "known", "fsdp2-2d-state-dict-refused", 8, list(range(8)), 28)
    assert state_dict.text == STATE_DICT  # the prefix stripped
    assert (partial.kind, partial.key, partial.ranks, partial.text) == (
        "name", "torch.distributed._tensor.Partial", [7], PARTIAL)
    assert [(f.text, f.ranks) for f in found.unrecognised.values()] == [("ValueError: bad batch", [4])]


@pytest.mark.torch_independent
def test_blocks_split_lines_nowhere(monkeypatch):
    """Lines are counted and matched the same however the blocks fall; a line longer than a block is cut, not
    held whole."""
    text = _interleaved()
    whole = scan(text)
    for size in (150, 333, 1000):  # at least the longest line
        monkeypatch.setattr(logs, "BLOCK", size)
        parts = scan(text)
        assert parts.lines == whole.lines
        assert {k: f.as_dict() for k, f in parts.found.items()} == {k: f.as_dict() for k, f in whole.found.items()}
    monkeypatch.setattr(logs, "BLOCK", 64)
    long = scan("x" * 1000 + "\n" + MISSING + "\n" + "y" * 1000)
    finding, = long.found.values()
    assert long.lines == 3 and finding.first_line == 2
    assert finding.key == "dcp-missing-key" and finding.details == ["lr_scheduler.verbose"]


@pytest.mark.torch_independent
def test_the_globals_a_weights_only_error_names_are_collected():
    text = ("_pickle.UnpicklingError: Weights only load failed. This file can still be loaded, to do so you have two "
            "options\n\tWeightsUnpickler error: Unsupported global: GLOBAL argparse.Namespace was not an allowed global "
            "by default.\n[rank1]: \tWeightsUnpickler error: Unsupported global: GLOBAL numpy.core.multiarray._reconstruct"
            " was not an allowed global by default.\n")
    finding, = scan(text).found.values()
    assert finding.key == "weights-only-load" and finding.details == ["argparse.Namespace",
                                                                      "numpy.core.multiarray._reconstruct"]


ENTRIES = [e for e in logs.known_errors() if e.get("kind") is None]  # known_errors.json's (patches' errors: test_explain_fixes)
KNOWN = [(entry["id"], example) for entry in ENTRIES for example in entry["examples"]]


@pytest.mark.torch_independent
def test_known_errors_data_is_complete():
    ids = {p.id: p for p in all_patches()}
    for entry in ENTRIES:
        assert {"id", "patterns", "torch", "meaning", "remedy", "upstream", "patches", "patch_note", "examples"} <= set(entry)
        assert entry["upstream"].startswith("https://") and entry["examples"] and "\n" not in entry["remedy"]
        assert set(entry["patches"]) <= set(ids), entry["patches"]
        if entry["torch"]:
            _versions.matches(entry["torch"], "2.4.1")  # a specifier that parses
        for pattern in entry["patterns"]:
            assert set(re.compile(pattern).groupindex) <= {"detail"}


@pytest.mark.parametrize("entry_id, example", KNOWN)
@pytest.mark.torch_independent
def test_each_example_is_found_as_its_entry_alone(entry_id, example):
    matched = logs.known_error_matches(example)
    assert {entry["id"] for entry, _ in matched} == {entry_id}
    assert [f.key for f in scan(f"[rank3]: {example}\n").found.values()] == [entry_id]


@pytest.mark.parametrize("entry_id, example", KNOWN)
@pytest.mark.torch_independent
def test_explain_message_answers_each_known_error(entry_id, example):
    code, found = explain_json(example, "--torch", "2.4.1")
    assert code == 1 and (found["verdict"], found["id"], found["torch"]) == ("known error", entry_id, "2.4.1")
    entry = next(e for e in logs.known_errors() if e["id"] == entry_id)
    assert (found["remedy"], found["upstream"]) == (entry["remedy"], entry["upstream"])


@pytest.mark.parametrize("torch, env, state, verdict", [
    ("2.4.1", None, "on here (on by default); it acts in processes started with TORCHPATCH=1", "fixed here"),
    ("2.4.1", {"TORCHPATCH_FSDP2_HSDP_TP": "0"}, "off here: TORCHPATCH_FSDP2_HSDP_TP=0", "switched off"),
    ("2.9.0", None, "not for torch 2.9.0: it applies to torch >=2.4,<2.5", "not for this torch"),
])
@pytest.mark.torch_independent
def test_an_error_a_patch_fixes_says_whether_that_patch_is_on(torch, env, state, verdict):
    code, found = explain_json(HSDP_TP, "--torch", torch, env=clean_env(**(env or {})))
    assert (found["form"], found["patch"], found["state"], found["verdict"]) == ("patch error", "fsdp2-hsdp-tp", state, verdict)
    assert code == found["exit"] == (0 if verdict == "fixed here" else 1)


@pytest.mark.torch_independent
def test_a_log_on_standard_input_explains_each_error_once():
    code, found = explain_json("-", "--torch", "2.1.2", stdin=_interleaved().encode())
    assert code == 0 and found["exit"] == 0 and found["torch"] == "2.1.2"
    assert [(e["kind"], e["key"], e["count"], e["ranks"]) for e in found["errors"]] == [
        ("known", "fsdp2-2d-state-dict-refused", 8, list(range(8))),
        ("name", "torch.distributed._tensor.Partial", 1, [7])]
    assert found["errors"][0]["explanation"]["raised_here"] is False  # 2.1.2 has no FSDP2 to raise it
    assert found["errors"][1]["explanation"]["verdict"] == "served"
    assert [u["text"] for u in found["unrecognised"]] == ["ValueError: bad batch"]
    text = torchpatch_command("explain", "-", "--torch", "2.1.2", stdin=_interleaved().encode()).stdout.splitlines()
    assert text[0] == ("torchpatch explain: standard input: 52 lines, 2 known errors, 1 other error line "
                       "(torch 2.1.2)")
    assert f"[1] line 28, ranks 0-7, 8 times: {STATE_DICT}" in text and text[-1] == "exit 0"
    assert "  line 51, rank 4: ValueError: bad batch" in text


@pytest.mark.parametrize("data, note, unknown", [
    (b"", "the log is empty", []),
    (bytes(range(256)) * 40, "binary data (NUL bytes), not a text log: no error message read in it", []),
    (("Traceback (most recent call last):\n" + '  File "t.py", line 1, in <module>\n    f()\n' * 3
      + "ValueError: no such shape\n").encode(), None, ["ValueError: no such shape"]),
    ("[rank0]: 错误：无法加载检查点\n[rank0]: RuntimeError: Fehler beim Laden des Prüfpunkts\n".encode(), None,
     ["RuntimeError: Fehler beim Laden des Prüfpunkts"]),
])
@pytest.mark.torch_independent
def test_bad_input_gets_a_clear_answer_and_exit_0(tmp_path, data, note, unknown):
    log = tmp_path / "job.log"
    log.write_bytes(data)
    for args, stdin in ((["-"], data), ([log], None)):
        proc = torchpatch_command("explain", *args, "--torch", "2.4.1", "--json", stdin=stdin)
        assert proc.returncode == 0 and proc.stderr == ""
        found = json.loads(proc.stdout)
        assert found["errors"] == [] and [u["text"] for u in found["unrecognised"]] == unknown
        assert found["notes"] == ([note] if note else [])
    text = torchpatch_command("explain", log, "--torch", "2.4.1").stdout
    assert text.endswith("exit 0\n") and (note or unknown[0]) in text


@pytest.mark.torch_independent
def test_a_missing_path_is_a_usage_error(tmp_path):
    proc = torchpatch_command("explain", tmp_path / "no-such.log")  # no such file: read as a message, in vain
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith(f"torchpatch explain: no such file: '{tmp_path / 'no-such.log'}' (a log to read?)")
    proc = torchpatch_command("explain", tmp_path)
    assert proc.returncode == 2 and proc.stdout == "" and proc.stderr.startswith(f"torchpatch explain: {tmp_path} is a "
                                                                                 "directory: give a log file")


@pytest.mark.torch_independent
def test_the_real_command_prints_only_the_answer(tmp_path):
    """The command's own process: a log file and binary data on standard input; stdout holds the JSON answer
    alone, stderr nothing, exit 0."""
    log = tmp_path / "job.log"
    log.write_text(_interleaved())
    for args, stdin in (([str(log)], None), (["-"], b"\x00\xff\xfe" * 1000), (["/dev/stdin"], log.read_bytes())):
        proc = subprocess.run([sys.executable, "-m", "torchpatch", "explain", *args, "--torch", "2.4.1", "--json"],
                              input=stdin, capture_output=True, env=clean_env(), timeout=300)
        assert proc.returncode == 0 and proc.stderr == b"", proc.stderr
        found = json.loads(proc.stdout)
        assert found["binary"] == (args == ["-"]) and len(found["errors"]) == (0 if args == ["-"] else 2)


@pytest.mark.torch_independent
def test_a_message_of_several_lines_names_what_all_its_lines_name():
    message = ("_pickle.UnpicklingError: Weights only load failed. This file can still be loaded\n\tWeightsUnpickler error: "
               "Unsupported global: GLOBAL argparse.Namespace was not an allowed global by default.")
    code, found = explain_json(message, "--torch", "2.9.0")
    assert code == 1 and found["id"] == "weights-only-load" and found["details"] == ["argparse.Namespace"]
    assert [(p["patch"], p["applies"]) for p in found["patches"]] == [("torch-load-weights-only-globals", True)]


def test_the_torch_the_logs_summary_line_names_is_pointed_out():
    found = scan("torchpatch: 0.1.0 on torch 2.2.2, Python 3.11.7: applied 12 patches\n" + MISSING + "\n")
    assert found.torch_in_log == "2.2.2"
    report = logs.explain_log(found, "job.log", None)  # the installed torch answers
    assert report["notes"] == ["the log's torchpatch summary line names torch 2.2.2: --torch 2.2.2 answers for it"]
    assert logs.explain_log(found, "job.log", "2.2.2")["notes"] == []
