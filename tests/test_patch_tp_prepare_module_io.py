"""tp-prepare-module-io: PrepareModuleInput/PrepareModuleOutput with torch 2.1's parallelize_module.

One 2-rank gloo script plans a small sequence-parallel block the way torchtitan does (inputs sharded
on rows, gathered for a ColwiseParallel/RowwiseParallel pair, scattered back; a keyword input; a
placeholder input and output left alone) and compares outputs and weight gradients with the same
model on one process. The script is torch-agnostic: on torch 2.13 (and 2.4) it runs torch's own
classes, which checks the served ones' semantics against the reference torch.
"""

from conftest import (
    LEAVE_WITHOUT_TEARDOWN, RESULT, clean_env, import_with_torchpatch, only_torch, rank_result, run_py,
    run_ranks, where_patch_applies
)

IMPORT = "from torch.distributed.tensor.parallel import PrepareModuleInput, PrepareModuleOutput"

SCRIPT = r"""
import copy, datetime, json, torch, torch.distributed as dist, torch.nn as nn
import torch.distributed.tensor.parallel as tp
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                               RowwiseParallel, parallelize_module)
try:
    from torch.distributed.tensor import DeviceMesh, DTensor, Replicate, Shard
except ImportError:  # torch 2.1-2.4 without torchpatch
    from torch.distributed._tensor import DeviceMesh, DTensor, Replicate, Shard

D, H, ROWS = 6, 8, 4 * world

class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wo = nn.Linear(D, H), nn.Linear(H, D)
    def forward(self, x, scale):  # scale: not a tensor (a None layout)
        return self.wo(torch.relu(self.wq(x)) * scale)

class Gate(nn.Module):
    def forward(self, y, *, mask):
        return y * mask.mean(0)

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.attn, self.gate = nn.LayerNorm(D), Attn(), Gate()
    def forward(self, x, mask):
        y = self.gate(x + self.attn(self.norm(x), 0.5), mask=mask)
        return y, torch.tensor(float(rank))  # a second output left alone

torch.manual_seed(0)
reference = Block().double()
model = copy.deepcopy(reference)
x, mask = torch.randn(ROWS, D, dtype=torch.float64), torch.rand(ROWS, D, dtype=torch.float64)
want = reference(x, mask)[0]
want.sum().backward()

mesh = DeviceMesh("cpu", list(range(world)))
out = {"classes": [PrepareModuleInput.__module__, PrepareModuleOutput.__module__]}
returned = parallelize_module(model, mesh, {
    "attn": PrepareModuleInput(input_layouts=(Shard(0), None), desired_input_layouts=(Replicate(), None)),
    "attn.wq": ColwiseParallel(),
    "attn.wo": RowwiseParallel(),
    "gate": PrepareModuleInput(input_kwarg_layouts={"mask": Shard(0)}, desired_input_kwarg_layouts={"mask": Replicate()},
                               use_local_output=True),
})
out["dict_plan_returns_module"] = returned is model
out["style_returns_module"] = parallelize_module(
    model.attn, mesh, PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0))) is model.attn
parallelize_module(model, mesh, PrepareModuleOutput(output_layouts=(Shard(0), None), desired_output_layouts=(Replicate(), None),
                                                    use_local_output=False))
seen = {}
model.attn.wq.register_forward_pre_hook(lambda m, args: seen.update(wq_input=args[0]))  # what each module gets
model.gate.register_forward_pre_hook(lambda m, args, kwargs: seen.update(gate_mask=kwargs["mask"]), with_kwargs=True)

rows = ROWS // world
got, second = model(x[rank * rows:(rank + 1) * rows], mask[rank * rows:(rank + 1) * rows])  # this rank's rows
out["output_is_dtensor"] = isinstance(got, DTensor)
out["output_placements"] = str(list(got.placements)) if isinstance(got, DTensor) else None
out["output_equal"] = torch.allclose(got.to_local(), want)
out["second_output_untouched"] = type(second).__name__ == "Tensor" and float(second) == rank
out["wq_input_full"] = isinstance(seen["wq_input"], DTensor) and torch.equal(seen["wq_input"].to_local(), reference.norm(x))
out["gate_mask_local_full"] = type(seen["gate_mask"]).__name__ == "Tensor" and torch.equal(seen["gate_mask"], mask)
got.to_local().sum().backward()
full = lambda g: g.redistribute(g.device_mesh, [Replicate()]).to_local()
out["grads_equal"] = {
    name: torch.allclose(full(p.grad), dict(reference.named_parameters())[name].grad)
    for name, p in model.named_parameters() if isinstance(p, DTensor)
}
style = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0))
out["repr"] = repr(style) if type(style).__repr__ is not object.__repr__ else None  # torch 2.4 has none
try:
    PrepareModuleInput(input_layouts=(Shard(0), None), desired_input_layouts=(Replicate(),))
except AssertionError as exc:
    out["length_mismatch"] = str(exc)
try:
    import torchpatch
    out["status"] = torchpatch.status().get("tp-prepare-module-io")
except ImportError:
    out["status"] = None
gathered = [None] * world
dist.all_gather_object(gathered, out)
if rank == 0:
    print(RESULT + json.dumps(dict(out, ranks_agree=all(g == out for g in gathered[1:]))), flush=True)
""".replace("RESULT", repr(RESULT)) + LEAVE_WITHOUT_TEARDOWN


def run(tmp_path, **env):
    proc = run_ranks(SCRIPT, env=clean_env(**env), tmp_path=tmp_path)
    out = rank_result(proc)
    assert out.pop("ranks_agree"), out
    return out


def check_semantics(out):
    assert out["dict_plan_returns_module"] and out["style_returns_module"]
    assert out["output_is_dtensor"] and out["output_placements"] == "[Replicate()]"
    assert out["output_equal"] is True
    assert out["second_output_untouched"] is True  # each rank's own, not redistributed
    assert out["wq_input_full"] is True and out["gate_mask_local_full"] is True
    assert out["grads_equal"] == {"attn.wq.weight": True, "attn.wq.bias": True, "attn.wo.weight": True,
                                  "attn.wo.bias": True}, out["grads_equal"]
    assert out["length_mismatch"] == "input_layouts and desired_input_layouts should have same length!"
    assert out["repr"] is None or out["repr"].startswith("PrepareModuleOutput(output_layouts=(Replicate(),), desired_output_layouts=(Shard(dim=0),)")


@where_patch_applies("tp-prepare-module-io", "torch 2.1 has tensor parallel without PrepareModuleInput/Output")
def test_native_import_error():
    proc = run_py(IMPORT)
    assert "ImportError: cannot import name 'PrepareModuleInput' from 'torch.distributed.tensor.parallel'" in proc.stderr, proc.stderr[-2000:]


@where_patch_applies("tp-prepare-module-io")
def test_served_and_equal_to_one_process(tmp_path):
    out = run(tmp_path, TORCHPATCH="1")
    assert out["classes"] == ["torchpatch.patches.tensor_parallel.tp_prepare_module_io"] * 2
    assert out["status"] == "applied" and out["repr"] is not None
    check_semantics(out)


@only_torch(">=2.4", "the reference: torch's own PrepareModuleInput/Output")
def test_inactive_and_native_semantics(tmp_path):
    out = run(tmp_path, TORCHPATCH="1")
    assert out["classes"] == ["torch.distributed.tensor.parallel.style"] * 2
    assert out["status"] is None  # not armed outside torch 2.1
    check_semantics(out)


@only_torch("<2.1", "no tensor parallel at all: nothing is served")
def test_not_served_before_tensor_parallel():
    out = import_with_torchpatch('from torch.distributed.tensor.parallel import PrepareModuleInput', 'tp-prepare-module-io')
    assert out == {"error": "ModuleNotFoundError", "status": None}
