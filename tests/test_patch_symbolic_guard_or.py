"""symbolic-guard-or: ``torch.fx.experimental.symbolic_shapes.guard_or_false`` / ``guard_or_true`` on
torch 2.4-2.6.

Natively 2.4 has neither (``ImportError``). With the patch: a plain bool is returned as it is, a
non-bool raises, a backed SymBool is guarded (its value), and an unbacked (data-dependent) one gives the
default, as torch 2.15 does natively (its venv, the same test).
"""

from conftest import clean_env, run_json, run_newest_torch_json, run_py, where_patch_applies

SCRIPT = '''
import json, torch
from torch.fx.experimental.symbolic_shapes import ShapeEnv, guard_or_false, guard_or_true
env = ShapeEnv()
backed = env.create_symintnode(env.create_symbol(5, source=torch._dynamo.source.ConstantSource("s")), hint=5)
unbacked = env.create_unbacked_symint()
out = {"plain": [guard_or_false(True), guard_or_false(False), guard_or_true(True), guard_or_true(False)],
       "backed": [guard_or_false(backed == 5), guard_or_true(backed == 4)],
       "unbacked": [guard_or_false(unbacked == 3), guard_or_true(unbacked == 3)]}
try:
    guard_or_false(1)
    out["error"] = ""
except AssertionError:
    out["error"] = "AssertionError"
print(json.dumps(out))
'''


@where_patch_applies("symbolic-guard-or", "torch 2.7 added them")
def test_native_import_error():
    proc = run_py(SCRIPT)
    assert "cannot import name 'guard_or_false'" in proc.stderr, proc.stderr[-2000:]


@where_patch_applies("symbolic-guard-or")
def test_guards_as_on_the_newest_torch():
    out = run_json(SCRIPT, env=clean_env(TORCHPATCH="1"))
    assert out == run_newest_torch_json(SCRIPT)
    assert out["unbacked"] == [False, True] and out["backed"] == [True, False], out
