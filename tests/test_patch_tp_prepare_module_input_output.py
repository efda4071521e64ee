"""tp-prepare-module-input-output: ``PrepareModuleInputOutput`` on torch 2.4 (torch 2.8 brought it).

One 2-rank gloo script plans the same small block three ways: its attention module with
``PrepareModuleInputOutput`` (inputs sharded on rows gathered for a ColwiseParallel/RowwiseParallel
pair, the output scattered back; a keyword input as local tensor), with ``PrepareModuleInput`` then
``PrepareModuleOutput`` applied one after the other, and not at all on one process. Outputs and
weight gradients of the first equal the second bit for bit and the one-process model; what the module
sees and returns is checked too. The script is torch-agnostic: on torch >= 2.8 it runs torch's own
class (the reference for the served one's semantics) and the patch stays out of the way.
"""

from conftest import (
    LEAVE_WITHOUT_TEARDOWN, RESULT, clean_env, import_with_torchpatch, only_torch, rank_result, run_py,
    run_ranks, where_patch_applies
)

IMPORT = "from torch.distributed.tensor.parallel import PrepareModuleInputOutput"


@where_patch_applies("tp-prepare-module-input-output", "torch 2.8 brought PrepareModuleInputOutput")
def test_native_import_error():
    proc = run_py(IMPORT)
    assert "ImportError: cannot import name 'PrepareModuleInputOutput' from 'torch.distributed.tensor.parallel'" in proc.stderr, \
        proc.stderr[-2000:]


SCRIPT = r"""
import copy, datetime, json, os, torch, torch.distributed as dist, torch.nn as nn
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleInputOutput,
                                               PrepareModuleOutput, RowwiseParallel, parallelize_module)
from torch.distributed.tensor.parallel.style import ParallelStyle, PrepareModuleInputOutput as FromStyle
try:
    from torch.distributed.tensor import DeviceMesh, DTensor, Replicate, Shard
except ImportError:  # torch 2.4 without torchpatch
    from torch.distributed._tensor import DeviceMesh, DTensor, Replicate, Shard

D, H, ROWS = 6, 8, 4 * world

class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wo = nn.Linear(D, H), nn.Linear(H, D)
    def forward(self, x, scale, *, gate):  # scale: not a tensor (a None layout); gate: a keyword input
        return self.wo(torch.relu(self.wq(x)) * scale) * gate.mean(0)

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.attn = nn.LayerNorm(D), Attn()
    def forward(self, x, gate):
        return x + self.attn(self.norm(x), 0.5, gate=gate)

torch.manual_seed(0)
reference = Block().double()
x, gate = torch.randn(ROWS, D, dtype=torch.float64), torch.rand(ROWS, D, dtype=torch.float64)
want = reference(x, gate)
want.sum().backward()
mesh = DeviceMesh("cpu", list(range(world)))
rows = ROWS // world
mine = slice(rank * rows, (rank + 1) * rows)  # this rank's rows (sequence parallel)

INPUT = dict(input_layouts=(Shard(0), None), desired_input_layouts=(Replicate(), None),
             input_kwarg_layouts={"gate": Shard(0)}, desired_input_kwarg_layouts={"gate": Replicate()})
OUTPUT = dict(output_layouts=Replicate(), desired_output_layouts=Shard(0))

def plan(combined):
    model = copy.deepcopy(reference)
    model.zero_grad(set_to_none=True)
    styles = {"attn.wq": ColwiseParallel(), "attn.wo": RowwiseParallel(use_local_output=False)}  # (times gate: a DTensor)
    if combined:
        style = PrepareModuleInputOutput(**INPUT, use_local_input=False, **OUTPUT, use_local_output=True)
        returned = parallelize_module(model, mesh, dict(styles, attn=style))
    else:
        returned = parallelize_module(model, mesh, styles)
        parallelize_module(model.attn, mesh, PrepareModuleInput(**INPUT, use_local_output=False))
        parallelize_module(model.attn, mesh, PrepareModuleOutput(**OUTPUT, use_local_output=True))
    seen = {}
    model.attn.register_forward_pre_hook(  # after the prepare hooks: what the module's forward gets
        lambda m, args, kwargs: seen.update(x=args[0], scale=args[1], gate=kwargs["gate"]), with_kwargs=True)
    model.attn.register_forward_hook(lambda m, args, output: seen.update(out=output))  # what its caller gets
    got = model(x[mine], gate[mine])
    got.sum().backward()
    full = lambda g: g.redistribute(g.device_mesh, [Replicate()]).to_local()
    grads = {n: full(p.grad) for n, p in model.named_parameters() if isinstance(p, DTensor)}
    found = {
        "returns_module": returned is model,
        "x_replicated": isinstance(seen["x"], DTensor) and list(seen["x"].placements) == [Replicate()]
                        and torch.equal(seen["x"].to_local(), reference.norm(x)),
        "scale_untouched": seen["scale"] == 0.5,
        "gate_replicated": isinstance(seen["gate"], DTensor) and torch.equal(seen["gate"].to_local(), gate),
        "output_local_shard": type(seen["out"]) is torch.Tensor and list(seen["out"].shape) == [rows, D],
        "out_equal_reference": torch.allclose(got, want[mine], rtol=1e-12, atol=1e-12),
        "grads_equal_reference": {n: torch.allclose(g, dict(reference.named_parameters())[n].grad, rtol=1e-12, atol=1e-12)
                                  for n, g in grads.items()},
    }
    return found, got.detach(), grads

combined, got_c, grads_c = plan(combined=True)
sequential, got_s, grads_s = plan(combined=False)
out = {"combined": combined, "sequential": sequential,
       "bitwise_equal_to_sequential": torch.equal(got_c, got_s) and sorted(grads_c) == sorted(grads_s)
                                      and all(torch.equal(grads_c[n], grads_s[n]) for n in grads_c)}

# use_local_input=True: the module gets plain local tensors; use_local_output=False: its caller a DTensor.
model = copy.deepcopy(reference.attn)
seen = {}
parallelize_module(model, mesh, PrepareModuleInputOutput(input_layouts=(Shard(0), None), desired_input_layouts=(Replicate(), None),
                                                         use_local_input=True, output_layouts=Replicate(),
                                                         desired_output_layouts=Shard(0), use_local_output=False))
model.register_forward_pre_hook(lambda m, args, kwargs: seen.update(x=args[0]), with_kwargs=True)
with torch.no_grad():
    y = model(reference.norm(x)[mine], 0.5, gate=gate)
    y_want = reference.attn(reference.norm(x), 0.5, gate=gate)
out["local_input"] = type(seen["x"]) is torch.Tensor and torch.equal(seen["x"], reference.norm(x))
out["dtensor_output"] = (isinstance(y, DTensor) and list(y.placements) == [Shard(0)] and list(y.shape) == [ROWS, D]
                         and torch.equal(y.to_local(), y_want[mine]))

style = PrepareModuleInputOutput(input_layouts=Shard(0), desired_input_layouts=Replicate(), output_layouts=Replicate(),
                                 desired_output_layouts=Shard(0))
pi, po = PrepareModuleInput(input_layouts=Shard(0), desired_input_layouts=Replicate()), \
         PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0))
out["repr"] = repr(style)
out["expected_repr"] = (f"PrepareModuleInputOutput(input_layouts={pi.input_layouts}, desired_input_layouts={pi.desired_input_layouts}, "
                        f"input_kwarg_layouts={pi.input_kwarg_layouts}, desired_input_kwarg_layouts={pi.desired_input_kwarg_layouts}, "
                        f"use_local_input=False, output_layouts={po.output_layouts}, desired_output_layouts={po.desired_output_layouts}, "
                        f"use_local_output=True)")
out["defaults"] = [style.prepare_module_input.use_local_output, style.prepare_module_output.use_local_output]
out["style_class"] = [isinstance(style, ParallelStyle), FromStyle is PrepareModuleInputOutput, PrepareModuleInputOutput.__module__]
out["source"] = PrepareModuleInputOutput.__init__.__code__.co_filename.replace(os.sep, "/")
errors = {}
for name, make in {"positional": lambda: PrepareModuleInputOutput(Shard(0), Replicate()),
                   "no_output_layouts": lambda: PrepareModuleInputOutput(input_layouts=Shard(0), desired_input_layouts=Replicate())}.items():
    try:
        make()
    except TypeError as exc:
        errors[name] = "TypeError"
try:
    PrepareModuleInputOutput(input_layouts=(Shard(0), None), desired_input_layouts=(Replicate(),), output_layouts=Replicate(),
                             desired_output_layouts=Shard(0))
except AssertionError as exc:
    errors["length_mismatch"] = str(exc)
out["errors"] = errors
try:
    import torchpatch
    out["status"] = torchpatch.status().get("tp-prepare-module-input-output")
except ImportError:
    out["status"] = None
gathered = [None] * world
dist.all_gather_object(gathered, out)
if rank == 0:
    print(RESULT + json.dumps(dict(out, ranks_agree=all(g == out for g in gathered[1:]))), flush=True)
""".replace("RESULT", repr(RESULT)) + LEAVE_WITHOUT_TEARDOWN


def run(tmp_path):
    proc = run_ranks(SCRIPT, env=clean_env(TORCHPATCH="1"), tmp_path=tmp_path, timeout=180)
    out = rank_result(proc)
    assert out.pop("ranks_agree"), out
    return out


def check_semantics(out):
    grads = {"attn.wq.weight": True, "attn.wq.bias": True, "attn.wo.weight": True, "attn.wo.bias": True}
    for how in ("combined", "sequential"):
        assert out[how] == {"returns_module": True, "x_replicated": True, "scale_untouched": True, "gate_replicated": True,
                            "output_local_shard": True, "out_equal_reference": True, "grads_equal_reference": grads}, (how, out[how])
    assert out["bitwise_equal_to_sequential"] is True
    assert out["local_input"] is True and out["dtensor_output"] is True
    assert out["repr"] == out["expected_repr"]
    assert out["defaults"] == [False, True]  # use_local_input=False, use_local_output=True
    assert out["style_class"][:2] == [True, True]
    assert out["errors"] == {"positional": "TypeError", "no_output_layouts": "TypeError",
                             "length_mismatch": "input_layouts and desired_input_layouts should have same length!"}


@where_patch_applies("tp-prepare-module-input-output")
def test_served_equals_input_then_output_and_one_process(tmp_path):
    out = run(tmp_path)
    assert out["status"] == "applied"
    assert out["style_class"][2] == "torch.distributed.tensor.parallel.style"  # as torch 2.8's
    assert out["source"].endswith("torchpatch/patches/tensor_parallel/tp_prepare_module_input_output.py"), out["source"]
    check_semantics(out)


@only_torch(">=2.8", "the reference: torch's own PrepareModuleInputOutput")
def test_inactive_and_native_semantics(tmp_path):
    out = run(tmp_path)
    assert out["status"] is None
    assert out["source"].endswith("torch/distributed/tensor/parallel/style.py"), out["source"]
    check_semantics(out)


@only_torch("<2.4", "served only where torch 2.8's semantics were checked (2.4)")
def test_not_served_before_2_4():
    out = import_with_torchpatch('from torch.distributed.tensor.parallel import PrepareModuleInputOutput', 'tp-prepare-module-input-output')
    assert out["error"] in ("ImportError", "ModuleNotFoundError") and out["status"] is None
