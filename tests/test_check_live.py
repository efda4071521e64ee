"""``torchpatch check`` against the installed torch: the helper interpreter that imports it
(``python -m torchpatch._check.helper``), and what happens when that helper hangs or ends."""

import json
import os
import subprocess
import sys
import time

import pytest

from conftest import HERE, TORCH, clean_env, torch_matches
from torchpatch._check import CheckError
from torchpatch._check.live import LiveView

TRAINER = HERE / "fixtures" / "check" / "trainer"


def ask(*queries, patched=False):
    """The helper's answers to ``queries``, one JSON line each."""
    proc = subprocess.run([sys.executable, "-m", "torchpatch._check.helper"] + (["--patched"] if patched else []),
                          input="".join(json.dumps(q) + "\n" for q in queries), env=clean_env(TORCHPATCH_LOG="off"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines()]


@pytest.mark.skipif(TORCH is None, reason="needs an installed torch")
def test_the_helper_answers_what_the_installed_torch_has():
    assert ask(["child", "torch", "nn"], ["child", "torch.nn", "Linear"], ["child", "torch", "no_such_thing"],
               ["op", "aten", "mm"], ["op", "no_such_namespace", "op"]) == [
        ["module", "torch.nn", ""], ["attr", "", ""], ["missing", "", ""], ["attr", "", ""],
        ["unknown", "", "no operator namespace 'no_such_namespace' in this torch: registered at run time by an "
                        "extension or your code, if at all"]]
    if torch_matches(">=2.0"):  # torch._six is gone; torch-six serves it, which --patched sees
        assert ask(["child", "torch", "_six"]) == [["missing", "", ""]]
        assert ask(["child", "torch._six", "inf"], ["child", "torch._six", "nope"], patched=True) == [
            ["attr", "", ""], ["missing", "", ""]]


def test_a_helper_that_does_not_answer_is_stopped_with_the_fix_named():
    view = LiveView(command=[sys.executable, "-c", "import time; time.sleep(120)"], timeout=0.5)
    started = time.monotonic()
    with pytest.raises(CheckError) as caught:
        view.child("torch", "nn")
    assert time.monotonic() - started < 30
    message = str(caught.value)
    for text in ("gave no answer within 0.5 s", "importing torch hangs", "TORCHPATCH_CHECK_TIMEOUT=SECONDS",
                 "--no-import", "--torch VERSION"):
        assert text in message, text
    assert view._proc is not None and view._proc.poll() is not None  # killed, not left behind
    view.close()


def test_a_helper_that_ends_leaves_the_names_unknown():
    view = LiveView(command=[sys.executable, "-c", "pass"], timeout=30)
    stopped = ("unknown", "", "the helper interpreter that imports torch stopped")
    assert view.child("torch", "nn") == stopped
    assert view.op("aten", "mm") == stopped  # at once: nothing is asked of a helper that ended
    view.close()


@pytest.mark.skipif(TORCH is None, reason="needs an installed torch")
def test_check_fails_clearly_where_importing_torch_hangs(tmp_path):
    """A torch whose import hangs (here: a package of that name that sleeps, first on the path)."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("import time\ntime.sleep(120)\n")
    path = os.pathsep.join([str(tmp_path)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "torchpatch", "check", str(TRAINER)], capture_output=True, text=True,
                          env=clean_env(PYTHONPATH=path, TORCHPATCH_CHECK_TIMEOUT="1"), timeout=120)
    assert time.monotonic() - started < 60
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("torchpatch check: the helper interpreter that imports the installed torch")
    assert "gave no answer within 1 s" in proc.stderr and "TORCHPATCH_CHECK_TIMEOUT" in proc.stderr
    bad = subprocess.run([sys.executable, "-m", "torchpatch", "check", str(TRAINER)], capture_output=True, text=True,
                         env=clean_env(TORCHPATCH_CHECK_TIMEOUT="soon"), timeout=120)
    assert bad.returncode == 2 and "TORCHPATCH_CHECK_TIMEOUT='soon' is not a number of seconds" in bad.stderr
