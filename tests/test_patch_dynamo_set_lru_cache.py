"""dynamo-set-lru-cache: torch 2.10's ``torch._C._dynamo.eval_frame._set_lru_cache`` on torch 2.4-2.9.

Without torchpatch the name is missing. With it (and natively on torch >= 2.15; 2.10-2.14's returns
None) the switch returns the previous setting (True at first), and a compiled function computes the same values with the
switch off as eagerly (checked against the eager function, for two input shapes: two cached graphs).
"""

from conftest import clean_env, only_torch, run_json, run_py, where_patch_applies


@where_patch_applies("dynamo-set-lru-cache", "torch 2.10 added it")
def test_native_attribute_error():
    proc = run_py("import torch; torch._C._dynamo.eval_frame._set_lru_cache(False)")
    assert "has no attribute '_set_lru_cache'" in proc.stderr, proc.stderr[-2000:]


SCRIPT = """
import json, torch
switch = torch._C._dynamo.eval_frame._set_lru_cache
previous = [switch(False), switch(False)]
f = lambda x: torch.cos(x).sum(-1) * 2
compiled = torch.compile(f, backend="eager")
xs = [torch.randn(3, 4), torch.randn(5, 4), torch.randn(3, 4)]
same = all(torch.equal(compiled(x), f(x)) for x in xs)
previous.append(switch(True))
import torchpatch
print(json.dumps({"previous": previous, "same": same, "status": torchpatch.status().get("dynamo-set-lru-cache")}))
"""


def check_switch() -> None:
    out = run_json(SCRIPT, env=clean_env(TORCHPATCH="1"))
    assert out["previous"] == [True, False, False] and out["same"], out


@where_patch_applies("dynamo-set-lru-cache")
def test_switch_served():
    check_switch()


@only_torch(">=2.15", "torch 2.15's own switch, the oracle (2.10-2.14's returns None)")
def test_switch_of_the_newest_torch():
    check_switch()
