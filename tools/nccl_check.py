#!/usr/bin/env python3
"""The patches whose code takes NCCL's path, run on a CUDA machine: a check to run by hand, never in CI.

CI has no GPU, so every test of the suite runs on gloo. The code below is what differs on NCCL: a
``ProcessGroupNCCL`` held by a module that is deep-copied (``processgroup-deepcopy``),
``dist.gather_single`` (``c10d-single-names``: gloo has no such collective, NCCL runs it through
``gather``), the renamed ``all_gather_single`` / ``reduce_scatter_single`` on CUDA tensors, and FSDP2's
manual backward finalization on CUDA (``fsdp2-manual-finalization``: FSDP2 reduces gradients on its
own CUDA streams there; ``finalize_backward(async_op=True)`` must hand back a handle whose ``wait``
leaves the gradients torch's automatic finalization gives).

Each check runs twice, in fresh processes of one rank (world size 1: one GPU): with ``TORCHPATCH``
unset, where the torch in use lacks the name the check needs, the native failure must show (else
the check is natively supported and the patch must stay out of the way); then with ``TORCHPATCH=1``,
where the result must equal the reference computed in the same process (the input itself, for a
collective over one rank; for FSDP2, the same model and micro-batches with torch's automatic
finalization, compared bitwise). One line a check; exit status 0 when every check passes.

    TORCHPATCH= python tools/nccl_check.py            # a python with torch (CUDA) and torchpatch
    python tools/nccl_check.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from typing import Any, Callable, Dict

CHECKS: Dict[str, Callable[[], str]] = {}


def check(function: Callable[[], str]) -> Callable[[], str]:
    CHECKS[function.__name__] = function
    return function


@check
def deepcopy_nccl_group() -> str:
    """A module holding a ProcessGroupNCCL deep-copies, and the copy shares the group."""
    import copy

    import torch
    import torch.distributed as dist

    model = torch.nn.Linear(4, 4).cuda()
    model.group = dist.new_group(backend="nccl")
    twin = copy.deepcopy(model)
    assert twin.group is model.group, "the copy holds another group"
    assert torch.equal(twin.weight, model.weight) and twin.weight.data_ptr() != model.weight.data_ptr()
    return f"copied, sharing {type(model.group).__name__}"


@check
def gather_single() -> str:
    """``dist.gather_single`` on NCCL: a gather into one tensor on the destination."""
    import torch
    import torch.distributed as dist

    tensor = torch.arange(6, dtype=torch.float32, device="cuda").reshape(2, 3)
    out = torch.empty(dist.get_world_size() * 2, 3, device="cuda")
    dist.gather_single(tensor, out, dst=0)
    assert torch.equal(out, tensor), (out, tensor)
    work = dist.gather_single(tensor + 1, out, dst=0, async_op=True)
    work.wait()
    assert torch.equal(out, tensor + 1), (out, tensor + 1)
    return "equal to the input, sync and async"


@check
def single_collectives() -> str:
    """``all_gather_single`` and ``reduce_scatter_single`` on CUDA tensors."""
    import torch
    import torch.distributed as dist

    tensor = torch.randn(4, 3, device="cuda")
    gathered = torch.empty_like(tensor)
    dist.all_gather_single(gathered, tensor)
    scattered = torch.empty_like(tensor)
    dist.reduce_scatter_single(scattered, tensor)
    assert torch.equal(gathered, tensor) and torch.equal(scattered, tensor)
    return "equal to the input"


@check
def fsdp2_manual_finalization() -> str:
    """Two micro-batches, backward finalized by hand (async), against torch's automatic finalization."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cuda", (1,))

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)).cuda()
        for layer in (net[0], net[2]):
            fully_shard(layer, mesh=mesh)
        return fully_shard(net, mesh=mesh)

    batches = [torch.randn(4, 16, device="cuda", generator=torch.Generator("cuda").manual_seed(i)) for i in range(2)]
    auto, manual = model(), model()
    for x in batches:
        auto(x).square().sum().backward()
    manual.set_manual_backward_finalization(True)
    for x in batches:
        manual(x).square().sum().backward()
    manual.finalize_backward(async_op=True).wait()
    torch.cuda.synchronize()
    for (name, a), (_, m) in zip(auto.named_parameters(), manual.named_parameters()):
        assert torch.equal(a.grad.to_local(), m.grad.to_local()), f"{name}: gradients differ"
    return "gradients bitwise equal to automatic finalization"


def rank_main(name: str) -> None:
    """Run one check in this process (rank 0 of 1), print its result as JSON."""
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        result: Dict[str, Any] = {"ok": True, "what": CHECKS[name]()}
    except Exception as error:  # reported to the parent: the native failure is an expected outcome
        result = {"ok": False, "what": f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"}
    finally:
        dist.destroy_process_group()
    result["torchpatch"] = "torchpatch" in sys.modules and sys.modules["torchpatch"].is_installed()
    print("RESULT " + json.dumps(result), flush=True)


def run(name: str, patched: bool) -> Dict[str, Any]:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", TORCHPATCH="1" if patched else "")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        env["MASTER_PORT"] = str(s.getsockname()[1])
    proc = subprocess.run([sys.executable, __file__, "--rank", name], env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        return {"ok": False, "what": f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}", "torchpatch": None}
    return json.loads(lines[-1][len("RESULT "):])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="one JSON object instead of lines")
    parser.add_argument("--rank", metavar="CHECK", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        rank_main(args.rank)
        return 0
    import torch

    results, passed = {}, True
    for name in CHECKS:
        native, patched = run(name, False), run(name, True)
        ok = patched["ok"] and patched["torchpatch"] is True
        results[name] = {"native": native, "torchpatch": patched, "pass": ok}
        passed &= ok
        if not args.json:
            print(f"{'PASS' if ok else 'FAIL'} {name}: natively {'works' if native['ok'] else 'fails'} "
                  f"({native['what']}); with TORCHPATCH=1: {patched['what']}")
    summary = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0), "checks": results, "pass": passed}
    print(json.dumps(summary, indent=1) if args.json else f"torch {summary['torch']} on {summary['gpu']}: "
          f"{'every check passes' if passed else 'a check fails'}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
