"""pipelining-presplit-inputs: ``schedule.step(arg_mbs=..., kwarg_mbs=..., target_mbs=...)`` on torch
2.4-2.13. 2 gloo ranks, a float64 model of 4 blocks whose first block takes a keyword input (from
torch 2.5; 2.4's stages refuse keyword inputs, split or not): natively
the pre-split names reach the first stage's module as model keyword arguments (``TypeError: ...
unexpected keyword argument 'arg_mbs'``; torchtitan's modules take ``**kwargs`` and get ``Expecting 4
arg_mbs but got 1`` instead) and the other rank is left waiting for its input (bounded by a 10 s
process-group timeout). With torchpatch, 1F1B (2 stages) and Interleaved1F1B (4 stages, 2 per rank) given the
microbatches pre-split give the same per-microbatch losses, output and gradients, bit for bit, as the
same schedule given the whole batch (torch splits it), and mixing the two forms raises torch 2.14's
errors. On torch >= 2.14 the same script runs torch's own pre-split inputs (the reference) and the
patch stays out of the way."""

import json

from conftest import LEAVE_WITHOUT_TEARDOWN, RESULT, clean_env, only_torch, ranks_result, run_ranks, where_patch_applies

SCRIPT = """
import copy, datetime, json, os, torch, torch.distributed as dist, torch.nn as nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import Schedule1F1B, ScheduleInterleaved1F1B
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=PG_TIMEOUT))
rank = dist.get_rank()
torch.set_default_dtype(torch.float64)
D, BATCH, N_MB = 8, 16, 4
torch.manual_seed(0)

class Scaled(nn.Module):  # a block with a keyword input (what kwarg_mbs carries)
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(D, D)

    def forward(self, x, scale=None):  # (None: torch 2.5-2.13 size the stage's output without it)
        return torch.tanh(self.linear(x) if scale is None else self.linear(x) * scale)

class Chain(nn.Module):  # a stage: its blocks in order, the keyword input to the first block
    def __init__(self, blocks):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x, scale=None):
        for block in self.blocks:
            x = block(x, scale) if isinstance(block, Scaled) else block(x)
        return x

blocks = [Scaled()] + [nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(3)]
x, y, scale = torch.randn(BATCH, D), torch.randn(BATCH, D), torch.rand(BATCH, 1) + 0.5
# torch 2.4's stages check a keyword input against a positional one and refuse it, split or not
KWARGS = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 5)
loss_fn = nn.MSELoss()

def build(schedule_cls, groups):
    mine = [s for s in range(len(groups)) if s % 2 == rank]  # stage s on rank s % 2
    modules = {s: copy.deepcopy(Chain([blocks[b] for b in groups[s]])) for s in mine}
    mb = BATCH // N_MB
    stages = [PipelineStage(modules[s], s, len(groups), torch.device("cpu"),
                            input_args=torch.zeros(mb, D)) for s in mine]
    multi = schedule_cls is ScheduleInterleaved1F1B
    return modules, schedule_cls(stages if multi else stages[0], n_microbatches=N_MB, loss_fn=loss_fn), mine

def run(schedule_cls, groups, pre_split):
    modules, schedule, mine = build(schedule_cls, groups)
    first, last = 0 in mine, len(groups) - 1 in mine
    losses = []
    if pre_split:
        out = schedule.step(arg_mbs=[(xm,) for xm in x.tensor_split(N_MB)] if first else None,
                            kwarg_mbs=[{"scale": s} for s in scale.tensor_split(N_MB)] if first and KWARGS else None,
                            target_mbs=list(y.tensor_split(N_MB)) if last else None, losses=losses)
    else:
        out = schedule.step(*([x] if first else []), **({"scale": scale} if first and KWARGS else {}),
                            target=y if last else None, losses=losses)
    return {"losses": [l.item() for l in losses], "out": None if out is None else out.tolist(),
            "grads": [p.grad.tolist() for s in mine for p in modules[s].parameters()]}

def error(call):
    try:
        call()
        return None
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"

if NATIVE:  # one pre-split step; a rank left waiting times out, so leave without a barrier
    with open(os.path.join(OUT_DIR, f"rank{rank}.json"), "w") as f:
        json.dump({"error": error(lambda: run(Schedule1F1B, [[0, 1], [2, 3]], True))}, f)
    os._exit(0)
results = {}
for name, cls, groups in (("1f1b", Schedule1F1B, [[0, 1], [2, 3]]),
                          ("interleaved_1f1b", ScheduleInterleaved1F1B, [[0], [1], [2], [3]])):
    err = error(lambda: results.setdefault(name, run(cls, groups, True)))
    dist.barrier()
    if err is not None:
        results[name] = {"error": err}
        continue
    results[name + "_whole_batch"] = run(cls, groups, False)
_, schedule, _ = build(Schedule1F1B, [[0, 1], [2, 3]])
results["mixed"] = [error(lambda: schedule.step(x, arg_mbs=[(x,)] * N_MB)),
                    error(lambda: schedule.step(arg_mbs=[(x,)] * N_MB, scale=scale)),
                    error(lambda: schedule.step(arg_mbs=[(x,)] * N_MB, target=y)),
                    error(lambda: schedule.step(arg_mbs=[(x,)] * 3)),
                    error(lambda: schedule.step(arg_mbs=[[x]] * N_MB))]
try:
    import torchpatch
    results["status"] = torchpatch.status().get("pipelining-presplit-inputs")
except ImportError:
    results["status"] = None
gathered = [None] * 2
dist.all_gather_object(gathered, results)
if rank == 0:
    print(RESULT + json.dumps(gathered), flush=True)
""".replace("RESULT", repr(RESULT)) + LEAVE_WITHOUT_TEARDOWN

MIXED = [
    "ValueError: When using pre-split inputs, pass pre-split positional inputs through arg_mbs=... instead of positional args.",
    "ValueError: Unexpected keyword arguments with pre-split inputs: scale. Pass pre-split keyword inputs through kwarg_mbs=...",
    "ValueError: When using pre-split inputs, pass pre-split targets through target_mbs=... instead of target=...",
    "ValueError: Expecting 4 arg_mbs but got 3",
    "TypeError: arg_mbs must be a list of tuples, but arg_mbs[0] is a <class 'list'>",
]


def run_script(tmp_path, torchpatch: bool):
    script = SCRIPT.replace("PG_TIMEOUT", "60").replace("NATIVE", "False").replace("OUT_DIR", "None")
    return ranks_result(script, tmp_path=tmp_path, env=clean_env(TORCHPATCH="1") if torchpatch else clean_env(), timeout=180)


@where_patch_applies("pipelining-presplit-inputs")
def test_native_presplit_step_fails(tmp_path):
    script = SCRIPT.replace("PG_TIMEOUT", "10").replace("NATIVE", "True").replace("OUT_DIR", repr(str(tmp_path)))
    proc = run_ranks(script, env=clean_env(), tmp_path=tmp_path, timeout=120)
    paths = [tmp_path / f"rank{rank}.json" for rank in (0, 1)]
    assert all(p.exists() for p in paths), (proc.stdout, proc.stderr[-4000:])
    errors = [json.loads(p.read_text())["error"] for p in paths]
    # where it fails varies (2.13: the first stage's module gets arg_mbs; 2.4 and 2.9: torch splits the
    # lists as if they were whole-batch values), never the step
    assert all(e is not None for e in errors), errors


def check_equal(ranks):
    for name in ("1f1b", "interleaved_1f1b"):
        for r in ranks:
            assert "error" not in r[name], r[name]
            assert r[name] == r[name + "_whole_batch"], name  # losses, output, gradients: bit for bit
        assert len(ranks[1][name]["losses"]) == 4 and ranks[1][name]["out"] is not None  # the last stage
    assert ranks[0]["mixed"] == MIXED, ranks[0]["mixed"]


@where_patch_applies("pipelining-presplit-inputs")
def test_presplit_step_equals_whole_batch_step(tmp_path):
    ranks = run_script(tmp_path, torchpatch=True)
    assert [r["status"] for r in ranks] == ["applied"] * 2
    check_equal(ranks)


@only_torch(">=2.14", "the reference: torch's own pre-split inputs")
def test_inactive_and_native_semantics(tmp_path):
    ranks = run_script(tmp_path, torchpatch=True)
    assert [r["status"] for r in ranks] == [None, None]
    check_equal(ranks)
