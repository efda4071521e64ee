"""distributed-config: ``torch.distributed.config`` on torch 2.4-2.10 (torch 2.11 brought it).

One script runs with TORCHPATCH=1 on every torch from 2.4: served on 2.4-2.10, torch's own after (the
reference for what reading and patching the flags give). Where served, turning a flag on raises: the
feature it switches is not in that torch.
"""

import pytest

from conftest import (
    clean_env, run_json, run_py, through_patch_range, torch_matches, where_patch_applies, where_patch_does_not_apply
)

FLAGS = ["compile_on_one_rank", "use_torchcomms", "pipeline_per_edge_p2p"]

SCRIPT = """
import json, warnings, torchpatch
warnings.simplefilter("ignore")  # compile_on_one_rank is a deprecated alias on torch 2.15
import torch.distributed.config as config
out = {"all": config.__all__, "values": [getattr(config, n) for n in %r],
       "copy": sorted(k for k in config.get_config_copy() if k in %r),
       "status": torchpatch.status().get("distributed-config")}
config.use_torchcomms = False
with config.patch(use_torchcomms=False, pipeline_per_edge_p2p=False):
    out["patched"] = [config.use_torchcomms, config.pipeline_per_edge_p2p]
try:
    config.no_such_flag = 1
except AttributeError as exc:
    out["unknown"] = str(exc)
refused = {}
for name, turn_on in {"assign": lambda: setattr(config, "use_torchcomms", True),
                      "patch": lambda: config.patch(pipeline_per_edge_p2p=True).__enter__(),
                      "patch_pair": lambda: config.patch("compile_on_one_rank", True).__enter__()}.items():
    try:
        turn_on()
        refused[name] = None
    except RuntimeError as exc:
        refused[name] = str(exc)
out["refused"] = refused
print(json.dumps(out))
""" % (FLAGS, FLAGS)


def _run() -> dict:
    return run_json(SCRIPT, env=clean_env(TORCHPATCH="1", TORCH_DISTRIBUTED_USE_TORCHCOMMS=None,
                                          TORCH_DISTRIBUTED_PIPELINE_PER_EDGE_P2P=None))


@through_patch_range("distributed-config", "torch 2.11 has it natively")
@pytest.mark.skipif(torch_matches(">=2.11,<2.15"), reason="torch 2.11-2.14's own module lacks pipeline_per_edge_p2p")
def test_flags_read_and_patched():
    out = _run()
    assert out["all"] == FLAGS and out["values"] == [False, False, False]
    assert {"use_torchcomms", "pipeline_per_edge_p2p"} <= set(out["copy"])  # 2.15 lists no alias there
    assert out["patched"] == [False, False]
    assert out["unknown"] == "torch.distributed.config.no_such_flag does not exist"


@where_patch_applies("distributed-config", "torch 2.11 brought it")
def test_native_failure_and_turning_on_refused():
    proc = run_py("import torch.distributed.config")
    assert "ModuleNotFoundError: No module named 'torch.distributed.config'" in proc.stderr, proc.stderr[-2000:]
    out = _run()
    assert out["status"] == "applied"
    for name, flag in (("assign", "use_torchcomms"), ("patch", "pipeline_per_edge_p2p"), ("patch_pair", "compile_on_one_rank")):
        assert out["refused"][name].startswith(f"torch.distributed.config.{flag} = True on torch "), out["refused"]
        assert "(served by torchpatch): this torch lacks " in out["refused"][name]


@where_patch_does_not_apply("distributed-config", "torch's own")
@through_patch_range("distributed-config")
def test_inactive_where_torch_has_it():
    out = run_json("import json, torchpatch, torch.distributed.config as config\n"
                   "print(json.dumps([torchpatch.status().get('distributed-config'), hasattr(config, '__torchpatch__')]))",
                   env=clean_env(TORCHPATCH="1"))
    assert out == [None, False]
