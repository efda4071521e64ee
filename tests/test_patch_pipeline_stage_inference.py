"""pipeline-stage-inference: PipelineStage without input_args on torch 2.4 (shapes learnt at the first
step). On 2 real ranks, a model whose first stage takes token ids (and a keyword input) and whose
stages are built on the meta device and materialised afterwards, as torchtitan does: 1F1B and GPipe
give the per-microbatch losses, outputs and gradients of the same model on one process; a stage given
input_args is torch 2.4's own; on newer torch the patch stays out of the way."""

import pytest

from conftest import (
    LEAVE_WITHOUT_TEARDOWN, RESULT, clean_env, rank_result, run_py, run_ranks, through_patch_range,
    torch_matches, where_patch_applies
)

BUILD = "import torch; from torch.distributed.pipelining import PipelineStage; PipelineStage(torch.nn.Linear(2, 2), 0, 2, 'cpu')"


@where_patch_applies("pipeline-stage-inference", "torch 2.4 requires input_args")
def test_native_type_error():
    proc = run_py(BUILD)
    assert "missing 1 required positional argument: 'input_args'" in proc.stderr, proc.stderr[-2000:]


RANKS = """
import copy, datetime, inspect, json, torch, torch.distributed as dist, torch.nn as nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import Schedule1F1B, ScheduleGPipe
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
torch.set_default_dtype(torch.float64)
# torch >= 2.7 averages the microbatches' gradients (scale_grads=True); 2.4-2.6 sum them
MEAN = "scale_grads" in inspect.signature(Schedule1F1B).parameters
V, D, BATCH, SEQ, N_MB = 11, 6, 8, 5, 4

class First(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.lin = nn.Embedding(V, D), nn.Linear(D, D)
    def forward(self, tokens, scale=None):
        return torch.tanh(self.lin(self.emb(tokens))) * (1.0 if scale is None else 2.0)

class Last(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.head = nn.Linear(D, D), nn.Linear(D, V)
    def forward(self, h, scale=None):
        return self.head(torch.tanh(self.lin(h)))

torch.manual_seed(0)
blocks = [First(), Last()]
tokens, labels = torch.randint(0, V, (BATCH, SEQ)), torch.randint(0, V, (BATCH, SEQ))
def loss_fn(out, y):
    return nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())

def reference(kwargs):
    ref = copy.deepcopy(blocks)
    losses, outs = [], []
    for xm, ym in zip(tokens.tensor_split(N_MB), labels.tensor_split(N_MB)):
        out = ref[1](ref[0](xm, **kwargs), **kwargs)
        loss = loss_fn(out, ym)
        (loss / N_MB if MEAN else loss).backward()
        losses.append(loss.item())
        outs.append(out.detach())
    return ref, losses, torch.cat(outs)

def shapes(stage, what):  # the shapes of torch 2.4's stage buffers (newer torch keeps them elsewhere: None)
    return [list(t.shape) for t in getattr(stage, what)] if getattr(stage, what, None) is not None else None

def run(schedule_cls, kwargs, meta):
    if meta:  # torchtitan: build the stage on the meta device, materialise it after
        with torch.device("meta"):
            module = type(blocks[rank])()
        stage = PipelineStage(module, rank, 2, torch.device("cpu"))
        module.to_empty(device="cpu")
        module.load_state_dict(blocks[rank].state_dict())
    else:
        module = copy.deepcopy(blocks[rank])
        stage = PipelineStage(module, rank, 2, torch.device("cpu"))
    schedule = schedule_cls(stage, n_microbatches=N_MB, loss_fn=loss_fn)
    ref, ref_losses, ref_out = reference(kwargs)
    steps = []
    for _ in range(2):
        module.zero_grad(set_to_none=True)
        losses = []
        args = [tokens] if rank == 0 else []
        out = schedule.step(*args, target=labels if rank == 1 else None, losses=losses, **kwargs)
        steps.append(([l.item() for l in losses], None if out is None else float((out - ref_out).abs().max())))
    grads = max(float((p.grad - q.grad).abs().max()) for p, q in zip(module.parameters(), ref[rank].parameters()))
    return {"steps": steps, "ref_losses": ref_losses, "grads_max_diff": grads,
            "inputs": shapes(stage, "inputs"), "outputs": shapes(stage, "outputs")}

results = {
    "1f1b": run(Schedule1F1B, {}, meta=True),
    "gpipe_kwargs": run(ScheduleGPipe, {"scale": torch.ones(BATCH)}, meta=False),
}
given = PipelineStage(copy.deepcopy(blocks[rank]), rank, 2, torch.device("cpu"),
                      input_args=tokens[:2] if rank == 0 else torch.zeros(2, SEQ, D),
                      output_args=torch.zeros(2, SEQ, D if rank == 0 else V))
results["given"] = shapes(given, "inputs")
gathered = [None] * 2
dist.all_gather_object(gathered, results)
if rank == 0:
    print(RESULT + json.dumps(gathered), flush=True)
""".replace("RESULT", repr(RESULT)) + LEAVE_WITHOUT_TEARDOWN


@through_patch_range("pipeline-stage-inference")
def test_stages_without_input_args_match_one_process(tmp_path):
    proc = run_ranks(RANKS, env=clean_env(TORCHPATCH="1"), tmp_path=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    first, last = rank_result(proc)
    buffers = torch_matches("<2.5")  # torch 2.4's stage buffers, sized by the learnt shapes
    for key in ("1f1b", "gpipe_kwargs"):
        if buffers:
            assert first[key]["inputs"] == [[2, 5]] and first[key]["outputs"] == [[2, 5, 6]], first[key]
            assert last[key]["inputs"] == [[2, 5, 6]] and last[key]["outputs"] == [[2, 5, 11]], last[key]
        for rank in (first, last):
            assert rank[key]["grads_max_diff"] < 1e-12, (key, rank[key])
        for losses, out_diff in last[key]["steps"]:
            assert losses == pytest.approx(last[key]["ref_losses"], rel=1e-12, abs=0)
            assert out_diff < 1e-12
    if buffers:
        assert first["given"] == [[2, 5]] and last["given"] == [[2, 5, 6]]
