"""Differential fuzzing of DTensor: random programs, each against the same computation on full
tensors, natively, with ``TORCHPATCH=1``, and on the newest torch (the oracle).

    # a long run on one torch: native, TORCHPATCH=1 and torch 2.15.0 natively, by category
    python tools/dtensor_fuzz.py compare --python VENV/bin/python --oracle VENV_2_15/bin/python \
        --count 2000 [--seed 0] [--json runs.json] [--cache DIR]
    # the corpus the tests hold every matrix torch to (run with torch 2.15.0: records its outcomes)
    python tools/dtensor_fuzz.py corpus --python VENV_2_15/bin/python --write tests/fixtures/dtensor_fuzz_corpus.json
    # one torch against the corpus (with TORCHPATCH=1, natively what is not right with it): exit 1 on any
    # program that breaks the rule; --native: torch 2.15.0 still gives the corpus's outcomes
    python tools/dtensor_fuzz.py check --python VENV/bin/python [--native] [--first N]
    # programs one by one, with their errors' words
    python tools/dtensor_fuzz.py run --python VENV/bin/python --start 167 --count 1 [--torchpatch]

The rule (docs/silent-bugs.md): with TORCHPATCH=1 a program gives what torch 2.15.0
gives: its value where 2.15.0 computes one, an error only where 2.15.0 raises. Breaking it (``BAD``):
a value or an error where the program was right natively (a regression), an error where it was wrong
natively and 2.15.0 computes, a wrong value, the ranks going different ways (``split``: one
raises while the other waits in a collective, or fails in it). An error natively and with TORCHPATCH=1 where 2.15.0 computes is counted apart: a
feature this torch lacks that no patch serves. What the programs are:
``tools/dtensor_fuzz_programs.py``; how a rank runs them: ``tools/dtensor_fuzz_worker.py``. Each
job is 2 gloo ranks on this machine (CPU); a job that fails on one rank is replaced by a new one
from the next program on.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from dtensor_fuzz_programs import GENERATOR, draw  # noqa: E402

CORPUS = HERE.parent / "tests" / "fixtures" / "dtensor_fuzz_corpus.json"
Outcomes = Dict[int, str]
HANG = 3  # a worker's exit status when its peer never posted its outcome


def run(python: str, seed: int, programs: Sequence[int], torchpatch: bool, wait_s: float = 10.0,
        stall_s: float = 300.0, words: Optional[Dict[int, str]] = None) -> Outcomes:
    """Each program's outcome (``programs``: their numbers, ascending): ``right``, ``wrong``,
    ``error:<Type>``, ``split``, ``invalid`` (and, into ``words``, the error's type and first line,
    rank 0's where both ranks raise)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHPATCH")}
    env.update(OMP_NUM_THREADS="1", **({"TORCHPATCH": "1"} if torchpatch else {}))
    outcomes: Outcomes = {}
    todo, retries = list(programs), 0
    with tempfile.TemporaryDirectory(prefix="dtensor-fuzz-") as tmp:
        while todo:
            out = os.path.join(tmp, f"job{todo[0]}")
            errors = _job(python, env, seed, todo, out, wait_s, stall_s)
            for rank in (0, 1):
                for line in _lines(f"{out}.{rank}"):
                    outcomes.setdefault(line["i"], _outcome(line))
                    if words is not None and "err" in line:
                        words.setdefault(line["i"], line["err"])
            if todo[0] not in outcomes:  # no program finished: the job itself failed
                retries += 1
                if retries == 3:
                    raise RuntimeError(f"dtensor_fuzz: jobs from program {todo[0]} fail before running it:\n{errors}")
                continue
            retries, todo = 0, [i for i in todo if i > max(outcomes)]
    return outcomes


# What a rank's collective raises when its peer left it or sent what it did not expect: the ranks
# went different ways (a collective mismatch), whatever error each then reports.
DESYNC = ("Connection closed by peer", "Connection reset by peer", "collective mismatch",
          "doesn't match expected size")


def _outcome(line: Dict[str, Any]) -> str:
    """A worker's line as an outcome: a rank that waited for its peer in vain (``hang``) and one whose
    collective failed for it are one outcome, ``split``: which of the two a run sees is a race."""
    if line["kind"] == "hang":
        return "split"
    if line["kind"] != "error":
        return line["kind"]
    return "split" if any(words in line["err"] for words in DESYNC) else "error:" + line["err"].split(":", 1)[0]


def _job(python: str, env: Dict[str, str], seed: int, programs: Sequence[int], out: str,
         wait_s: float, stall_s: float) -> str:
    port = _free_port()
    procs = [subprocess.Popen([python, str(HERE / "dtensor_fuzz_worker.py"), str(seed), ",".join(map(str, programs)),
                               out, str(wait_s)], env=dict(env, RANK=str(r), PORT=str(port)),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for r in (0, 1)]
    last, size, gone = time.monotonic(), -1, None
    while any(p.poll() is None for p in procs):
        now_size = sum(os.path.getsize(f"{out}.{r}") for r in (0, 1) if os.path.exists(f"{out}.{r}"))
        if now_size != size:
            last, size = time.monotonic(), now_size
        codes = [p.poll() for p in procs]
        if HANG in codes or time.monotonic() - last > stall_s:
            break  # a rank found its peer stuck (the peer waits in a collective), or nothing moves at all
        if gone is None and any(c is not None for c in codes):
            gone = time.monotonic()
        if gone is not None and time.monotonic() - gone > wait_s + 5:
            break  # one rank died (not through the store): its peer had wait_s to notice
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            p.kill()
    return "\n".join(p.communicate()[1][-2000:] for p in procs)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _lines(path: str) -> List[Dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


# -- judging against the oracle ------------------------------------------------------------------
BAD = ("regression", "refuses what 2.15 computes", "wrong with TORCHPATCH=1", "split with TORCHPATCH=1")


def category(native: str, patched: str, oracle: str) -> str:
    """What ``TORCHPATCH=1`` did with a program, judged by the oracle's outcome."""
    if "invalid" in (native, patched, oracle):
        return "invalid program (the full-tensor reference raises)"
    if patched == "split":
        return "split with TORCHPATCH=1" if oracle != "split" else f"2.15 splits too; native: {native}"
    if patched == "wrong" and oracle != "wrong":
        return "regression" if native == "right" else "wrong with TORCHPATCH=1"
    if oracle == "right":
        if patched == "right":
            return "right both ways" if native == "right" else f"fixed (native: {native})"
        if native == "right":
            return "regression"
        if native == "wrong":
            return "refuses what 2.15 computes"
        return f"an error natively and with TORCHPATCH=1 where 2.15 computes (not fixed; native: {native})"
    if oracle == "wrong":
        return f"2.15 wrong; native {native}, patched {patched}"
    if oracle == "split":
        return f"2.15 splits; with TORCHPATCH=1 {patched.split(':')[0]} on every rank (native: {native.split(':')[0]})"
    if patched.startswith("error"):
        how = "same error type" if patched == oracle else f"{patched[6:]} where 2.15 raises {oracle[6:]}"
        return f"2.15 raises; error with TORCHPATCH=1 ({how}; native: {native.split(':')[0]})"
    return f"2.15 raises; a value with TORCHPATCH=1 (native: {native.split(':')[0]})"


def needs_native(patched: str) -> bool:
    """Whether a program's native outcome can change whether its ``TORCHPATCH=1`` outcome breaks the
    rule: not where that outcome is ``right`` (never ``BAD``, whatever the program did natively); the
    ``check`` command runs natively only the others."""
    return patched != "right"


def breaks_rule(native: Outcomes, patched: Outcomes, oracle: Outcomes) -> List[Tuple[int, str]]:
    """The programs whose ``TORCHPATCH=1`` outcome breaks the rule (``BAD``), with why; ``native`` may
    lack the programs whose native outcome the rule does not need (``needs_native``)."""
    bad = []
    for i, o in sorted(oracle.items()):
        mine = patched.get(i, "missing")
        cat = category(native.get(i, "missing" if needs_native(mine) else "not run"), mine, o)
        if cat in BAD or "missing" in cat:
            bad.append((i, f"{cat} (2.15.0: {o}; native: {native.get(i)}; TORCHPATCH=1: {patched.get(i)})"))
    return bad


def _programs(start: int, count: int) -> List[int]:
    return list(range(start, start + count))


def describe(seed: int, i: int) -> str:
    return f"#{i}: " + json.dumps({k: v for k, v in draw(seed, i).items() if k != "values"})


def _cached_run(args: argparse.Namespace, python: str, torchpatch: bool) -> Outcomes:
    """``run``; native runs are kept in ``--cache`` (a directory) and read back: they do not depend on
    torchpatch, so a long comparison after a change of a patch reruns only the TORCHPATCH=1 side."""
    path = None
    if args.cache and not torchpatch:
        stem = f"{_torch_version(python)}-native-g{GENERATOR}-seed{args.seed}-from{args.start}"
        path = Path(args.cache) / f"{stem}-{args.count}.json"
        for kept in Path(args.cache).glob(f"{stem}-*.json"):  # a longer run holds this one
            if int(kept.stem.rsplit("-", 1)[1]) >= args.count:
                outcomes = {int(i): o for i, o in json.loads(kept.read_text()).items()}
                return {i: outcomes[i] for i in range(args.start, args.start + args.count)}
    outcomes = run(python, args.seed, _programs(args.start, args.count), torchpatch, args.wait)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({str(i): o for i, o in sorted(outcomes.items())}))
    return outcomes


def _torch_version(python: str) -> str:
    """``python``'s torch version, from its installed metadata (importing torch costs seconds)."""
    code = "from importlib.metadata import version; print(version('torch').split('+')[0])"
    return subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["compare", "corpus", "check", "run"])
    parser.add_argument("--python", default=sys.executable, help="the interpreter of the torch to fuzz")
    parser.add_argument("--oracle", help="compare: the interpreter of torch 2.15.0")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--count", type=int, default=200)
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--json", help="compare: write every program's outcomes here")
    parser.add_argument("--cache", help="compare: a directory of your own where native runs are kept and reused")
    parser.add_argument("--write", help="corpus: the file to write")
    parser.add_argument("--corpus", default=str(CORPUS), help="check: the corpus (default: %(default)s)")
    parser.add_argument("--native", action="store_true", help="check: run natively and require the corpus's "
                        "outcomes exactly (with torch 2.15.0: the corpus is still true)")
    parser.add_argument("--first", type=int, help="check: only the corpus's first N programs (drawn at random "
                        "like the rest: a random sample)")
    parser.add_argument("--torchpatch", action="store_true", help="run: with TORCHPATCH=1")
    parser.add_argument("--wait", type=float, default=10.0, help="seconds a rank waits for its peer's outcome "
                        "before calling it a hang (only ever reached when one rank is stuck)")
    args = parser.parse_args(argv)
    if args.command == "run":
        words: Dict[int, str] = {}
        for i, o in sorted(run(args.python, args.seed, _programs(args.start, args.count), args.torchpatch, args.wait,
                               words=words).items()):
            print(f"{o:28s} {describe(args.seed, i)}" + (f"\n{'':28s} {words[i]}" if i in words else ""))
        return 0
    if args.command == "corpus":
        outcomes = run(args.python, args.seed, _programs(args.start, args.count), False, args.wait)
        corpus = {"generator": GENERATOR, "seed": args.seed, "start": args.start, "count": args.count,
                  "torch": _torch_version(args.python), "outcomes": {str(i): o for i, o in sorted(outcomes.items())}}
        Path(args.write).write_text(json.dumps(corpus, indent=0) + "\n")
        print(f"dtensor_fuzz: {len(outcomes)} outcomes of torch {corpus['torch']} written to {args.write}: "
              + ", ".join(f"{k} {v}" for k, v in collections.Counter(outcomes.values()).most_common()))
        return 0
    if args.command == "check":
        corpus = json.loads(Path(args.corpus).read_text())
        if corpus["generator"] != GENERATOR:
            raise SystemExit(f"dtensor_fuzz: {args.corpus} was drawn by generator {corpus['generator']}, this is "
                             f"{GENERATOR}: rewrite it with the corpus command and torch 2.15.0")
        count = min(corpus["count"], args.first or corpus["count"])
        oracle = {int(i): o for i, o in corpus["outcomes"].items() if int(i) < corpus["start"] + count}
        programs = _programs(corpus["start"], count)
        if args.native:
            got = run(args.python, corpus["seed"], programs, False, args.wait)
            bad = [(i, f"corpus: {o}; here: {got.get(i)}") for i, o in sorted(oracle.items()) if got.get(i) != o]
        else:  # natively only what the rule needs the native outcome of (``needs_native``)
            got = run(args.python, corpus["seed"], programs, True, args.wait)
            native = run(args.python, corpus["seed"], [i for i in programs if needs_native(got.get(i, "missing"))],
                         False, args.wait)
            bad = breaks_rule(native, got, oracle)
        mode = "natively" if args.native else "with TORCHPATCH=1"
        print(f"dtensor_fuzz: torch {_torch_version(args.python)} {mode}: {len(got)} programs, "
              f"{len(bad)} break the rule; " + ", ".join(f"{k} {v}" for k, v in collections.Counter(got.values()).most_common()))
        for i, why in bad:
            print(f"  {why}  {describe(corpus['seed'], i)}")
        return 1 if bad else 0
    if not args.oracle:
        parser.error("compare needs --oracle (the interpreter of torch 2.15.0)")
    runs = {name: _cached_run(args, py, tp) for name, py, tp in (
        ("native", args.python, False), ("patched", args.python, True), ("oracle", args.oracle, False))}
    cats: Dict[str, List[int]] = collections.defaultdict(list)
    for i in range(args.start, args.start + args.count):
        cats[category(runs["native"][i], runs["patched"][i], runs["oracle"][i])].append(i)
    print(f"dtensor_fuzz: torch {_torch_version(args.python)}, {args.count} programs (seed {args.seed}), "
          f"oracle torch {_torch_version(args.oracle)}")
    for cat, ids in sorted(cats.items(), key=lambda kv: (kv[0] not in BAD, -len(kv[1]))):
        print(f"{len(ids):6d}  {'BAD: ' if cat in BAD else ''}{cat}")
        if cat in BAD:
            for i in ids[:5]:
                print(f"          {describe(args.seed, i)}")
    if args.json:
        Path(args.json).write_text(json.dumps({k: {str(i): o for i, o in v.items()} for k, v in runs.items()}))
    return 1 if any(cat in BAD for cat in cats) else 0


if __name__ == "__main__":
    sys.exit(main())
