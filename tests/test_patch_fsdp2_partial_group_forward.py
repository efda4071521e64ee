"""fsdp2-partial-group-forward: a grouped ``fully_shard([norm, head])`` run in separate calls.

On 2 real ranks (gloo), float64: two layers, a norm and a head, with ``fully_shard`` on each layer, on
``[norm, head]`` together and on the root, trained 2 SGD steps the way torchtitan 0.3's chunked loss
runs them: the model's forward stops after the norm, the head runs on each chunk of the detached hidden
states with a backward per chunk (its FSDP group kept unsharded, gradient sync only on the last chunk),
then one backward carries the chunks' accumulated gradient through the norm and the layers. The weights
are compared with the same model trained on one process on both ranks' data in the same run. Torch 2.13
and later do this natively (the newest torch validates the expectation); on 2.9 natively the final
backward reaches the norm with its parameters freed (a segmentation fault, or gradients far off);
TORCHPATCH=1 gives the reference.
"""

import signal

from conftest import (
    LEAVE_WITHOUT_TEARDOWN, RESULT, clean_env, patch_applies_here, ranks_result, rank_result, run_ranks,
    through_patch_range, where_patch_applies
)
from fsdp2_scripts import head

RANKS = head(home="torch.distributed.fsdp") + """
class Norm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(dim) + 0.5)

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight

class Model(nn.Module):
    def __init__(self, dim=6, vocab=5):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(dim, dim) for _ in range(2)])
        self.norm, self.head = Norm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, x):  # the head runs in the loss, chunk by chunk
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.norm(x)

class Bridge(torch.autograd.Function):  # torchtitan's _DecoderOutputGradientBackProp
    @staticmethod
    def forward(ctx, hidden, grad, loss):
        ctx.save_for_backward(grad)
        return loss.detach()

    @staticmethod
    def backward(ctx, _):
        return ctx.saved_tensors[0], None, None

CHUNKS = 3
x, y = torch.randn(W, 2, 6, 6, dtype=torch.float64), torch.randint(0, 5, (W, 2, 6))

def chunk_loss(head, h, target):
    return nn.functional.cross_entropy(head(h).flatten(0, 1), target.flatten(), reduction="sum") / 24

def step(m, r, fsdp):
    hidden = m(x[r])
    chunks = [c.detach().requires_grad_() for c in hidden.chunk(CHUNKS, dim=1)]
    targets = y[r].chunk(CHUNKS, dim=1)
    if fsdp:
        m.head.set_reshard_after_forward(False)
        m.head.set_reshard_after_backward(False)
        m.head.set_requires_gradient_sync(False, recurse=False)
        m.head.unshard()
    total, grads = torch.zeros((), dtype=torch.float64), []
    for i, (c, t) in enumerate(zip(chunks, targets)):
        if fsdp and i == CHUNKS - 1:
            m.head.set_requires_gradient_sync(True, recurse=False)
        loss = chunk_loss(m.head, c, t)
        total = total + loss.detach()
        loss.backward()
        grads.append(c.grad)
    if fsdp:
        m.head.set_reshard_after_forward(True)
        m.head.set_reshard_after_backward(True)
        m.head.set_requires_gradient_sync(True, recurse=False)
        m.head.reshard()
    Bridge.apply(hidden, torch.cat(grads, dim=1), total).backward()

model = Model().double()
ref = copy.deepcopy(model)  # one process, both ranks' data: FSDP averages the ranks' gradients
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
for _ in range(2):
    ref_opt.zero_grad()
    for r in range(W):
        step(ref, r, fsdp=False)
    for p in ref.parameters():
        p.grad /= W
    ref_opt.step()

for layer in model.layers:
    fully_shard(layer, mesh=mesh)
fully_shard([model.norm, model.head], mesh=mesh)
fully_shard(model, mesh=mesh)
opt = torch.optim.SGD(model.parameters(), lr=0.5)
for _ in range(2):
    opt.zero_grad()
    step(model, rank, fsdp=True)
    opt.step()
full = {k: v.full_tensor() for k, v in model.state_dict().items()}
diff = max(float((full[k] - v).abs().max()) for k, v in ref.state_dict().items())
import torchpatch
out = {"weights": "reference" if diff < 1e-12 else f"diverged by {diff:.3g}",
       "status": torchpatch.status().get("fsdp2-partial-group-forward")}
gathered = [None] * W
dist.all_gather_object(gathered, out)
if rank == 0:
    print(RESULT + json.dumps(gathered), flush=True)
""".replace("RESULT", repr(RESULT)) + LEAVE_WITHOUT_TEARDOWN


@where_patch_applies("fsdp2-partial-group-forward", "FSDP2 frees the norm's parameters before its backward")
def test_native_frees_the_norm_before_its_backward(tmp_path):
    proc = run_ranks(RANKS, env=clean_env(), tmp_path=tmp_path, timeout=180)
    if proc.returncode:  # the norm's backward reads freed storage (torch 2.9.0 on CPU)
        assert proc.returncode == signal.SIGSEGV, proc.stderr[-3000:]
    else:  # or it computes with whatever the storage holds
        assert all(out["weights"] != "reference" for out in rank_result(proc)), proc.stdout


@through_patch_range("fsdp2-partial-group-forward", "FSDP2 on CPU with a grouped fully_shard", since="2.9")
def test_chunked_loss_trains_to_the_reference(tmp_path):
    for out in ranks_result(RANKS, tmp_path=tmp_path, env=clean_env(TORCHPATCH="1"), timeout=180):
        assert out["status"] == ("applied" if patch_applies_here("fsdp2-partial-group-forward") else None), out
        assert out["weights"] == "reference", out
