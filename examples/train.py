"""The main job: a tiny DiT trained with sequence parallelism and an EMA copy, on CPU/gloo.

Run it on 2 ranks (any torch from 1.13.1 to 2.13.0):

    TORCHPATCH=1 torchrun --nproc_per_node 2 examples/train.py [--steps 8]
    TORCHPATCH=1 python examples/launch.py --nproc 2 examples/train.py   # when torchrun is broken

The model keeps its sequence-parallel group as an attribute (``self.sp_group``), the way Open-Sora
does, so ``ema = copy.deepcopy(model)`` fails on every torch without torchpatch with
``TypeError: cannot pickle 'torch._C._distributed_c10d.ProcessGroup' object``
(``...ProcessGroupGloo`` on torch 1.13); with ``TORCHPATCH=1`` the copy shares the group and
training runs. The 16 patch
tokens of each image are split across the ranks (1, 2, 4, 8 or 16 of them); attention all-gathers
K/V over ``sp_group`` (backward: all-reduce, then keep this rank's slice), so every rank sees the
same data and DDP's gradient average is the exact gradient of the global loss: the losses match a
1-rank run.
"""

from __future__ import annotations

import argparse
import copy
import math
from typing import Any, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class GatherSeq(torch.autograd.Function):
    """All-gather along dim 1 over a group; backward sums the gradients and keeps our slice."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group, ctx.rank = group, dist.get_rank(group)
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)  # gloo has no reduce_scatter on torch 1.13
        return grad.chunk(dist.get_world_size(ctx.group), dim=1)[ctx.rank], None


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class Block(nn.Module):
    """Transformer block with adaLN conditioning and sequence-parallel attention."""

    def __init__(self, dim: int, heads: int, sp_group: Any) -> None:
        super().__init__()
        self.heads, self.sp_group = heads, sp_group
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.ada = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        if dist.get_world_size(self.sp_group) > 1:  # keys/values of the whole sequence
            k, v = GatherSeq.apply(k, self.sp_group), GatherSeq.apply(v, self.sp_group)
        q, k, v = (t.reshape(b, -1, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1) / math.sqrt(d // self.heads)).softmax(dim=-1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, n, d))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        sh1, sc1, g1, sh2, sc2, g2 = self.ada(c).chunk(6, dim=-1)
        x = x + g1.unsqueeze(1) * self.attention(modulate(self.norm1(x), sh1, sc1))
        return x + g2.unsqueeze(1) * self.mlp(modulate(self.norm2(x), sh2, sc2))


class TinyDiT(nn.Module):
    """Patchify 4x8x8 latents into 16 tokens, keep this rank's share, predict the noise."""

    def __init__(self, sp_group: Any, channels: int = 4, size: int = 8, patch: int = 2,
                 dim: int = 64, depth: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.sp_group, self.patch = sp_group, patch  # the attribute that breaks deepcopy
        self.embed = nn.Conv2d(channels, dim, patch, stride=patch)
        self.pos = nn.Parameter(torch.randn(1, (size // patch) ** 2, dim) * 0.02)
        self.t_mlp = nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.blocks = nn.ModuleList(Block(dim, heads, sp_group) for _ in range(depth))
        self.norm = nn.LayerNorm(dim, elementwise_affine=False)
        self.head = nn.Linear(dim, patch * patch * channels)

    def local(self, tokens: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous slice of the sequence (dim 1)."""
        return tokens.chunk(dist.get_world_size(self.sp_group), dim=1)[dist.get_rank(self.sp_group)]

    def t_embed(self, t: torch.Tensor) -> torch.Tensor:
        half = self.pos.shape[-1] // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half)
        args = t.float()[:, None] * freqs[None]
        return self.t_mlp(torch.cat([torch.cos(args), torch.sin(args)], dim=-1))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        tokens = self.local(self.embed(x).flatten(2).transpose(1, 2) + self.pos)
        c = self.t_embed(t)
        for block in self.blocks:
            tokens = block(tokens, c)
        return self.head(self.norm(tokens))  # (batch, local tokens, patch*patch*channels)

    def patchify(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> this rank's (B, local tokens, p*p*C), matching the head's layout."""
        b, ch, h, w = x.shape
        p = self.patch
        x = x.reshape(b, ch, h // p, p, w // p, p).permute(0, 2, 4, 3, 5, 1)
        return self.local(x.reshape(b, (h // p) * (w // p), p * p * ch))


def diffusion_loss(model: nn.Module, net: TinyDiT, x0: torch.Tensor, t: torch.Tensor,
                   noise: torch.Tensor, alpha_bar: torch.Tensor) -> torch.Tensor:
    a = alpha_bar[t].view(-1, 1, 1, 1)
    xt = a.sqrt() * x0 + (1 - a).sqrt() * noise
    return F.mse_loss(model(xt, t), net.patchify(noise))


def global_mean(value: torch.Tensor, group: Optional[Any] = None) -> float:
    value = value.detach().clone()
    dist.all_reduce(value, group=group)
    return value.item() / dist.get_world_size(group)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    opts = parser.parse_args()
    if opts.steps < 1:
        parser.error("--steps must be at least 1")

    dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from torchrun
    rank = dist.get_rank()
    torch.manual_seed(opts.seed)  # the same weights and data on every rank
    sp_group = dist.new_group(list(range(dist.get_world_size())))
    net = TinyDiT(sp_group)
    ema = copy.deepcopy(net)  # without torchpatch: TypeError: cannot pickle '...ProcessGroup'
    ema.requires_grad_(False)
    model = DDP(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    alpha_bar = torch.cumprod(1 - torch.linspace(1e-4, 0.02, 1000), dim=0)

    data = torch.Generator().manual_seed(opts.seed)
    x0 = torch.randn(64, 4, 8, 8, generator=data)  # a small synthetic "latent" data set
    for step in range(opts.steps):
        idx = torch.randint(0, x0.shape[0], (opts.batch,), generator=data)
        t = torch.randint(0, alpha_bar.shape[0], (opts.batch,), generator=data)
        noise = torch.randn(opts.batch, 4, 8, 8, generator=data)
        loss = diffusion_loss(model, net, x0[idx], t, noise, alpha_bar)
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            for e, p in zip(ema.parameters(), net.parameters()):
                e.mul_(0.9).add_(p, alpha=0.1)
        value = global_mean(loss)
        if rank == 0:
            print(f"step {step} loss {value:.6f}", flush=True)

    with torch.no_grad():  # the EMA copy uses the shared group too
        ema_loss = global_mean(diffusion_loss(ema, ema, x0[idx], t, noise, alpha_bar))
        pairs = zip(ema.parameters(), net.parameters())
        distance = torch.stack([(e - p).pow(2).sum() for e, p in pairs]).sum().sqrt()
    if rank == 0:
        print(f"result: steps {opts.steps} loss {value:.6f} ema_loss {ema_loss:.6f} "
              f"ema_distance {float(distance):.6f} ema_shares_group {ema.sp_group is net.sp_group}",
              flush=True)
    # Drain the gloo worker threads first: a ProcessGroup freed with the GIL held (e.g. by DDP's
    # reducer) joins them, and one still freeing a collective's tensors needs the GIL (a
    # deadlock, about 1 run in 6 on torch 2.1.2 without the barriers).
    for group in (sp_group, None):
        dist.barrier(group)
    del model
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
