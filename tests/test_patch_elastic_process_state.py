"""elastic-process-state: ``torch.distributed.elastic.utils.process_state`` and its constants on
torch 2.4-2.12 (torch 2.13 brought them; ``DEFAULT_PORT`` came with 2.5).

One script runs with TORCHPATCH=1 on every torch from 2.4: served on 2.4-2.12, torch's own after (the
reference for the served semantics). Process states are checked where they are certain: this very
process is running (``R``) while it reads its own state, also under a command name holding spaces and
parentheses; a process that does not exist has none.
"""

from conftest import clean_env, run_json, run_py, through_patch_range, where_patch_applies, where_patch_does_not_apply

SCRIPT = """
import json, os, subprocess, torchpatch
from torch.distributed.elastic.utils.process_state import is_uninterruptible_state, read_proc_state
from torch.distributed.elastic.agent.server.local_elastic_agent import TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import DEFAULT_PORT
import torch.distributed.elastic.utils.process_state as module

states = {"self": read_proc_state(os.getpid())}
with open("/proc/self/comm", "w") as comm:  # a command name that the naive split would misread
    comm.write("a) b ( c")
states["odd_name"] = read_proc_state(os.getpid())
gone = subprocess.Popen(["true"])
gone.wait()  # reaped: the pid is free
states["gone"] = read_proc_state(gone.pid)
print(json.dumps({
    "states": states, "all": module.__all__,
    "uninterruptible": [is_uninterruptible_state(s) for s in ("D", "D+", "S", "R", "", None)],
    "constants": [TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT, DEFAULT_PORT],
    "status": torchpatch.status().get("elastic-process-state"),
}))
"""


@through_patch_range("elastic-process-state", "torch 2.13 has them natively")
def test_process_state_and_constants():
    out = run_json(SCRIPT, env=clean_env(TORCHPATCH="1"))
    assert out["states"] == {"self": "R", "odd_name": "R", "gone": None}
    assert out["all"] == ["read_proc_state", "is_uninterruptible_state"]
    assert out["uninterruptible"] == [True, True, False, False, False, False]
    assert out["constants"] == ["TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT", 29400]


@where_patch_applies("elastic-process-state", "torch 2.13 brought them")
def test_native_failure_and_served():
    proc = run_py("import torch.distributed.elastic.utils.process_state")
    assert "ModuleNotFoundError: No module named 'torch.distributed.elastic.utils.process_state'" in proc.stderr
    proc = run_py("from torch.distributed.elastic.agent.server.local_elastic_agent import TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT")
    assert "ImportError: cannot import name 'TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT'" in proc.stderr
    assert run_json(SCRIPT, env=clean_env(TORCHPATCH="1"))["status"] == "applied"


@where_patch_does_not_apply("elastic-process-state", "torch's own")
@through_patch_range("elastic-process-state")
def test_inactive_where_torch_has_them():
    out = run_json(SCRIPT + "print(json.dumps([module.read_proc_state.__module__, getattr(module, '__torchpatch__', None)]))",
                   env=clean_env(TORCHPATCH="1"))
    assert out == ["torch.distributed.elastic.utils.process_state", None]
