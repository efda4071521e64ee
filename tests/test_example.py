"""The main job (examples/train.py): dies without torchpatch, trains with it under torchrun (the README's
first command); 2 ranks equal 1 rank. The failure and the 1-rank reference are what a rank computes,
which does not depend on the launcher: their ranks are forked (tests/forkserver.py), with no agent."""

import re

from conftest import REPO, clean_env, run_ranks

SCRIPT = (REPO / "examples" / "train.py").read_text()
RESULT = re.compile(r"result: steps (\d+) loss ([\d.]+) ema_loss ([\d.]+) ema_distance ([\d.]+) ema_shares_group (\w+)")


def test_fails_without_torchpatch(tmp_path):
    proc = run_ranks(SCRIPT, env=clean_env(), tmp_path=tmp_path)
    assert proc.returncode != 0
    assert "TypeError: cannot pickle" in proc.stderr and "ProcessGroup" in proc.stderr


def test_trains_with_torchpatch_and_matches_one_rank(tmp_path):
    two = run_ranks(SCRIPT, env=clean_env(TORCHPATCH="1"), tmp_path=tmp_path, launcher="torchrun")
    assert two.returncode == 0, two.stderr[-3000:]
    one = run_ranks(SCRIPT, nproc=1, env=clean_env(TORCHPATCH="1"), tmp_path=tmp_path)
    assert one.returncode == 0, one.stderr[-3000:]
    got = [RESULT.search(p.stdout).groups() for p in (two, one)]
    assert got[0] == got[1]  # sequence parallelism over 2 ranks is the 1-rank computation
    steps, loss, ema_loss, distance, shares = got[0]
    assert int(steps) == 8 and shares == "True" and float(distance) > 0
