"""Train torchtitan's debug model with the installed torchtitan's own trainer, on CPU with gloo.

    pip install --no-deps torchtitan==0.1.0      # plus its light dependencies (docs/torchtitan.md)
    python examples/torchtitan_cpu.py --make-seed-checkpoint /tmp/seed
    TORCHPATCH=1 torchrun --nproc_per_node 2 examples/torchtitan_cpu.py --parallel fsdp --steps 5 --seed-checkpoint /tmp/seed

Under torchrun, rank 0 prints the digest of the weights training starts from (``{"weights": sha256}``,
after the seed checkpoint is loaded) and one JSON line per step, ``{"step": k, "loss": x, "grad_norm":
g}`` (with pipeline parallelism the loss lives on the last stage; it is taken from there). Every
configuration trains on the same global batch of 4 sequences a step, each data-parallel rank on its own
part of it, so a run on one process computes what every parallelism does (the reference); gradients
are not clipped (``max_norm`` is infinite) and their norm is reported, so a gradient of the wrong scale
shows. ``--debug-grad-scale S`` multiplies rank 1's gradient of the model's output by S (to show that
a wrong gradient is seen). What makes a GPU trainer run
on a CPU machine lives here, not in torchpatch's catalogue: the device (torchtitan picks "cuda" when
it finds no accelerator; this script points it at the CPU, so gloo is the backend), a byte-level
tiktoken tokenizer and a small text dataset written on the spot (no downloads), float32 parameters
(bf16 on CPU would only add rounding), torchtitan 0.3's FlexAttention computed by
scaled_dot_product_attention (torch's FlexAttention has no backward on CPU), and the trainer's flags
for each parallelism. It speaks the trainer interfaces of torchtitan 0.1 (``torchtitan.config_manager``,
a tiktoken tokenizer), 0.2 (``torchtitan.config``, a Hugging Face ``tokenizer.json``) and 0.3
(``--module``/``--config`` from its config registry, tyro flags, ``config.build()``), told apart from
the installed files.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib
import importlib.util
import json
import math
import os
import platform
import random
import shutil
import socket
import sys
import tempfile
import types
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Tuple

import torch  # noqa: F401  (first of the non-standard modules: the tests fork ranks that have imported it)

# --parallel -> (ranks, data-parallel ranks, the trainer's parallelism flags, activation checkpointing:
# "none" or per-op selective "op"). The seed checkpoint is made on one process.
PARALLEL: Dict[str, Tuple[int, int, List[str], str]] = {
    "single": (1, 1, ["--parallelism.data_parallel_shard_degree", "1"], "none"),
    "fsdp": (2, 2, ["--parallelism.data_parallel_shard_degree", "2"], "none"),
    "tp": (2, 1, ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.tensor_parallel_degree", "2"], "none"),
    "pp": (2, 1, ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.pipeline_parallel_degree", "2",
                  "--parallelism.pipeline_parallel_schedule", "1F1B"], "none"),
    "fsdp+tp+sac": (4, 2, ["--parallelism.data_parallel_shard_degree", "2",
                           "--parallelism.tensor_parallel_degree", "2"], "op"),
    # 8 ranks: 2 pipeline ranks of 2 stages each (Interleaved1F1B splits the model into 4) x FSDP 2 x TP 2
    "pp+fsdp+tp": (8, 2, ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.tensor_parallel_degree", "2",
                          "--parallelism.pipeline_parallel_degree", "2",
                          "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"], "none"),
    # 8 ranks: HSDP (replicate 2 x shard 2) x TP 2
    "hsdp+tp": (8, 4, ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2",
                       "--parallelism.tensor_parallel_degree", "2"], "none"),
}
GLOBAL_BATCH = 4  # sequences a step, split over the data-parallel ranks
SEQ_LEN = 32
BATCHES = 100  # distinct global batches in the dataset (a longer run starts it again)
WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma "
         "tau upsilon phi chi psi omega torch patch train step loss rank mesh shard tensor").split()


def documents() -> List[str]:
    """BATCHES x GLOBAL_BATCH distinct documents of SEQ_LEN - 1 bytes: with the begin and end tokens
    each is exactly one sample of SEQ_LEN + 1 tokens (every release packs samples from a token stream;
    0.3 shifts labels within a document), so no sample spans two documents."""
    rng = random.Random(0)
    docs = []
    for _ in range(BATCHES * GLOBAL_BATCH):
        text = ""
        while len(text) < SEQ_LEN - 1:
            text += rng.choice(WORDS) + " "
        docs.append(text[:SEQ_LEN - 1])
    return docs


def write_assets(folder: str, dp: int) -> Dict[str, str]:
    """A byte-level tiktoken vocabulary (256 tokens) and the dataset in the order that gives each of
    ``dp`` data-parallel ranks its own part of every global batch: torchtitan gives rank r the r-th
    contiguous 1/dp of the file and reads GLOBAL_BATCH / dp documents a step, so the file holds rank
    0's parts of batches 0, 1, ..., then rank 1's. The same global batches for every ``dp``."""
    os.makedirs(os.path.join(folder, "data"), exist_ok=True)
    tokenizer = os.path.join(folder, "tokenizer.model")
    with open(tokenizer, "w") as f:
        f.writelines(f"{base64.b64encode(bytes([i])).decode()} {i}\n" for i in range(256))
    docs, local = documents(), GLOBAL_BATCH // dp
    ordered = [docs[k * GLOBAL_BATCH + r * local + i] for r in range(dp) for k in range(BATCHES) for i in range(local)]
    with open(os.path.join(folder, "data", "train.json"), "w") as f:
        f.writelines(json.dumps({"text": doc}) + "\n" for doc in ordered)
    return {"tokenizer": tokenizer, "data": os.path.join(folder, "data"),
            "hf_assets": write_hf_tokenizer(folder) if API.hf_tokenizer else ""}


def write_hf_tokenizer(folder: str) -> str:
    """The same byte-level vocabulary as a Hugging Face ``tokenizer.json`` (torchtitan >= 0.2), with
    begin/end-of-text tokens; returns its directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    path = os.path.join(folder, "hf_assets")
    os.makedirs(path, exist_ok=True)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|begin_of_text|>", "<|end_of_text|>"])
    tokenizer.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}, f)
    return path


class CPUDeviceModule:
    """What torchtitan asks of its device module (``torch.cuda`` on a GPU), answered for the CPU:
    the machine's name and memory, one device, no memory statistics (torchtitan logs -1)."""

    @staticmethod
    def get_device_properties(device=None):
        return types.SimpleNamespace(total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))

    get_device_name = staticmethod(lambda device=None: platform.processor() or "cpu")
    current_device = staticmethod(lambda: 0)
    memory_stats = staticmethod(lambda device=None: {})
    set_device = reset_peak_memory_stats = empty_cache = synchronize = staticmethod(lambda *a, **k: None)


@dataclass(frozen=True)
class TrainerAPI:
    """Where torchtitan's trainer interface differs between its releases."""

    config_module: str  # the module holding ConfigManager
    seed_flags: Tuple[str, ...]
    enable_checkpoint: str
    model_only_last_save: str
    hf_tokenizer: bool  # a Hugging Face tokenizer.json instead of a tiktoken file
    seed_save: Dict[str, bool]  # checkpointer.save(curr_step=0, **seed_save) writes the seed checkpoint
    model: Tuple[str, ...]  # the flags that pick llama3's debug model (and what a CPU needs beside)
    flag: Dict[str, str]  # the flags that moved, by their 0.1 spelling
    activation_checkpoint: Dict[str, List[str]]  # "none" / "op" (per-op selective) -> the flags
    config_builds: bool  # the parsed config builds the trainer (0.3), or torchtitan.train.Trainer(config)
    flex_attention_only: bool  # its language models attend with FlexAttention (or CUDA's varlen) only (0.3)
    registry: str = ""  # the config registry --module loads (0.3), imported first: ConfigManager hides its errors


_MODE_AC = {"none": ["--activation_checkpoint.mode", "none"],
            "op": ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"]}
API_0_1 = TrainerAPI("torchtitan.config_manager", ("--training.seed", "42", "--training.deterministic"),
                     "--checkpoint.enable_checkpoint", "--checkpoint.last_save_model_weights_only", False, {"force": True},
                     ("--model.name", "llama3", "--model.flavor", "debugmodel"), {}, _MODE_AC, False, False)
API_0_2 = TrainerAPI("torchtitan.config", ("--debug.seed", "42", "--debug.deterministic"),
                     "--checkpoint.enable", "--checkpoint.last_save_model_only", True, {"last_step": True},
                     API_0_1.model, {"--model.tokenizer_path": "--model.hf_assets_path"}, _MODE_AC, False, False)
# 0.3: a registry of typed configs (--module/--config), tyro flags, activation checkpointing as a subcommand
API_0_3 = TrainerAPI("torchtitan.config", API_0_2.seed_flags, "--checkpoint.enable", "--checkpoint.last_save_model_only",
                     True, {"last_step": True}, ("--module", "llama3", "--config", "llama3_debugmodel", "--training.disable_cuda_graphs"),
                     {"--model.tokenizer_path": "--hf_assets_path", "--training.dataset": "--dataloader.dataset",
                      "--training.dataset_path": "--dataloader.dataset_path", "--job.dump_folder": "--dump_folder"},
                     {"none": ["activation-checkpoint:none"], "op": ["activation-checkpoint:selective"]}, True, True,
                     "torchtitan.models.llama3.config_registry")


def _trainer_api() -> TrainerAPI:
    """The installed torchtitan's interface, told from its files (importing it would fix its device)."""
    spec = importlib.util.find_spec("torchtitan")
    if spec is None:
        sys.exit("examples/torchtitan_cpu.py: torchtitan is not installed (pip install --no-deps torchtitan==0.1.0 ...)")
    root = list(spec.submodule_search_locations)[0]
    if os.path.isfile(os.path.join(root, "trainer.py")):
        return API_0_3
    return API_0_2 if os.path.isdir(os.path.join(root, "config")) else API_0_1


API = _trainer_api()


def flex_attention_on_cpu(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux, kernel_options):
    """What torchtitan 0.3's FlexAttention computes, differentiable on the CPU: torch's FlexAttention
    has no backward there ("FlexAttention does not support backward on CPU"), so the block mask's
    mask_mod becomes a dense boolean mask for scaled_dot_product_attention (the same masked softmax)."""
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import create_mask

    if score_mod is not None or return_aux.lse:
        raise NotImplementedError("examples/torchtitan_cpu.py: FlexAttention's score_mod and lse are not served on CPU")
    mask = create_mask(block_mask.mask_mod, q.shape[0], 1, q.shape[-2], k.shape[-2], device=q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa), None


def configure_on_cpu(flags: List[str]) -> Callable[[], Any]:
    """Parse the trainer's flags with the installed torchtitan, imported so that it picks the CPU:
    torchtitan asks torch for the available accelerator once, at import time (and takes "cuda" when
    there is none); during that import (0.3 imports its model and trainer while it parses) torch
    answers "cpu" with ``CPUDeviceModule``. Returns what builds the trainer."""
    import torch._utils

    saved = torch._utils._get_available_device_type, torch._utils._get_device_module
    torch._utils._get_available_device_type = lambda: "cpu"
    torch._utils._get_device_module = lambda device_type=None: CPUDeviceModule
    try:
        if API.registry:
            importlib.import_module(API.registry)
        config = importlib.import_module(API.config_module).ConfigManager().parse_args(flags)
        if API.flex_attention_only:
            from torchtitan.models.common.attention import FlexAttention

            FlexAttention.compiled_flex_attn = staticmethod(flex_attention_on_cpu)
        if API.config_builds:
            return config.build
        from torchtitan.train import Trainer
    finally:
        torch._utils._get_available_device_type, torch._utils._get_device_module = saved
    return lambda: Trainer(config)


def trainer_flags(args: argparse.Namespace, assets: Dict[str, str], work: str, dp: int) -> List[str]:
    """The trainer's flags, written in torchtitan 0.1's spelling and renamed for the installed release."""
    tokenizer = assets["hf_assets"] if API.hf_tokenizer else assets["tokenizer"]
    flags = [
        *API.model, "--model.tokenizer_path", tokenizer,
        "--training.dataset", "c4_test", "--training.dataset_path", assets["data"],
        "--training.local_batch_size", str(GLOBAL_BATCH // dp), "--training.seq_len", str(SEQ_LEN),
        "--training.steps", str(args.steps), "--training.max_norm", "inf",
        *API.seed_flags, "--training.mixed_precision_param", "float32",
        "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1", "--job.dump_folder", work,
        "--optimizer.implementation", "foreach",
        "--comm.trace_buf_size", "0",
    ]
    if args.make_seed_checkpoint:
        flags += [API.enable_checkpoint, "--checkpoint.create_seed_checkpoint", API.model_only_last_save,
                  "--checkpoint.folder", os.path.abspath(args.make_seed_checkpoint)]
        ac = "none"
    else:
        _, _, parallel, ac = PARALLEL[args.parallel]
        flags += parallel
    if args.seed_checkpoint or args.checkpoint_dir:
        flags += [API.enable_checkpoint, "--checkpoint.folder",
                  os.path.abspath(args.checkpoint_dir or os.path.join(work, "checkpoint")),
                  "--checkpoint.interval", str(args.checkpoint_interval)]
    if args.load_step is not None:
        flags += ["--checkpoint.load_step", str(args.load_step)]
    if args.seed_checkpoint:
        flags += ["--checkpoint.initial_load_path", os.path.join(os.path.abspath(args.seed_checkpoint), "step-0")]
    # a tyro subcommand (0.3) comes after every flag
    return [API.flag.get(flag, flag) for flag in flags] + API.activation_checkpoint[ac]


def _over_ranks(trainer, value: Callable[[Any], Any], grads: bool = False) -> Dict[str, Any]:
    """``value`` of every parameter's full tensor (sharded ones gathered), or of its full gradient, by
    name over all ranks (pipeline stages hold different parameters)."""
    import torch.distributed as dist

    values = {}
    for part in trainer.model_parts:
        for name, param in sorted(part.named_parameters()):
            tensor = param.grad if grads else param
            if tensor is None:
                continue
            full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            values[name.replace("_checkpoint_wrapped_module.", "")] = value(full.detach())  # activation checkpointing's wrapper
    every: List[Dict[str, Any]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(every, values)
    return {name: v for part in every for name, v in part.items()}


def weights_digest(trainer) -> str:
    """The SHA-256 of every parameter's full value, by name: equal digests are bitwise equal weights,
    however they are parallelised."""
    digests = _over_ranks(trainer, lambda t: hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest())
    return hashlib.sha256(json.dumps(sorted(digests.items())).encode()).hexdigest()


def grad_norm(trainer) -> float:
    """The gradients' total norm, summed in float64 from each parameter's full gradient: what the
    optimizer is given, however the run is parallelised. torchtitan's own clipping norm sums in float32,
    over shards for FSDP and TP: on 0.3.0's debug model it reads 1.3e-4 (one process) and 5e-5 (FSDP,
    TP) below this, so it differs between parallelisms that give the same gradients."""
    squares = _over_ranks(trainer, lambda t: float(t.double().pow(2).sum()), grads=True)
    return math.fsum(squares.values()) ** 0.5


def instrument(trainer, grad_scale: float) -> None:
    """Rank 0 prints the digest of the weights after the (seed) checkpoint is loaded and, for each
    logged step, the loss and the gradients' total norm (``grad_norm``, taken where torchtitan clips;
    under pipeline parallelism ranks without the last stage hold loss -1, so the largest value over all
    ranks is the loss). ``grad_scale`` != 1 scales rank 1's gradient of the model output (a wrong gradient)."""
    import torch.distributed as dist

    utils = importlib.import_module("torchtitan.distributed.utils")
    clip, load, log = utils.clip_grad_norm_, trainer.checkpointer.load, trainer.metrics_processor.log
    norms: List[float] = []

    def clip_grad_norm_(*args, **kwargs):
        norms.append(grad_norm(trainer))  # before clipping (none: max_norm is inf)
        return clip(*args, **kwargs)

    def loaded(*args, **kwargs):
        # torchtitan 0.1 pops ``freqs_cis`` from its model's cached state dict (what it saves) when it loads
        # a model-only checkpoint (the seed): what it saved after that could not be resumed (``Missing key
        # in checkpoint state_dict: model.freqs_cis``, on every torch; 0.2 no longer pops). The entry goes
        # back (the same buffer, loaded in place or not at all).
        model = getattr(trainer.checkpointer, "states", {}).get("model")
        cached = dict(model.state_dict()) if model is not None else {}
        result = load(*args, **kwargs)
        for name, value in cached.items():
            model.state_dict().setdefault(name, value)
        digest = weights_digest(trainer)
        if dist.get_rank() == 0:
            print(json.dumps({"weights": digest}), flush=True)
        return result

    def logged(step, global_avg_loss, global_max_loss, *rest, **kw):
        loss = torch.tensor([float(global_avg_loss)], dtype=torch.float64)
        dist.all_reduce(loss, op=dist.ReduceOp.MAX)
        if dist.get_rank() == 0:
            print(json.dumps({"step": step, "loss": loss.item(), "grad_norm": norms[-1]}), flush=True)
        return log(step, global_avg_loss, global_max_loss, *rest, **kw)

    utils.clip_grad_norm_, trainer.checkpointer.load, trainer.metrics_processor.log = clip_grad_norm_, loaded, logged
    if grad_scale != 1 and dist.get_rank() == 1:

        class ScaleGrad(torch.autograd.Function):
            """The identity forward; backward multiplies the gradient by ``grad_scale``."""

            @staticmethod
            def forward(ctx, x):
                return x.view_as(x)

            @staticmethod
            def backward(ctx, grad):
                return grad * grad_scale

        trainer.model_parts[0].register_forward_hook(lambda module, args, out: ScaleGrad.apply(out))


def main(argv: List[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parallel", choices=list(PARALLEL), default="fsdp",
                        help="parallelism: single (1 process); fsdp, tp, pp on 2 ranks; fsdp+tp+sac on 4; pp+fsdp+tp "
                             "(Interleaved1F1B, 2 stages a pipeline rank) and hsdp+tp (replicate 2 x shard 2 x TP 2) on 8 (default fsdp)")
    parser.add_argument("--steps", type=int, default=5, help="training steps (default 5)")
    parser.add_argument("--seed-checkpoint", metavar="DIR", help="start from this seed checkpoint (made by --make-seed-checkpoint)")
    parser.add_argument("--make-seed-checkpoint", metavar="DIR", help="write torchtitan's seed checkpoint into DIR on one process and exit")
    parser.add_argument("--checkpoint-dir", metavar="DIR", help="save DCP checkpoints here (and resume from the newest one in it)")
    parser.add_argument("--checkpoint-interval", type=int, default=500, help="steps between checkpoint saves (default 500)")
    parser.add_argument("--load-step", type=int, metavar="N", help="resume from the checkpoint of step N in --checkpoint-dir (default: the newest)")
    parser.add_argument("--debug-grad-scale", type=float, default=1.0, metavar="S",
                        help="multiply rank 1's gradient of the model output by S: a wrong gradient the comparison must see")
    args = parser.parse_args(argv)
    if "MASTER_PORT" not in os.environ:  # a plain `python` run is a one-process job, on a free port
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(name, value)
    if args.make_seed_checkpoint and os.environ["WORLD_SIZE"] != "1":
        parser.error("--make-seed-checkpoint runs on one process: use python, not torchrun with several ranks")
    ranks, dp = PARALLEL[args.parallel][:2]
    if not args.make_seed_checkpoint and int(os.environ["WORLD_SIZE"]) != ranks:
        parser.error(f"--parallel {args.parallel} runs on {ranks} ranks: torchrun --nproc_per_node {ranks}")

    work = tempfile.mkdtemp(prefix=f"torchtitan-cpu-{os.environ['RANK']}-")
    try:  # this rank's assets and scratch go when it leaves, failed or not (os._exit skips any cleanup)
        dp = 1 if args.make_seed_checkpoint else dp
        assets = write_assets(work, dp)
        trainer = configure_on_cpu(trainer_flags(args, assets, work, dp))()
        try:
            if args.make_seed_checkpoint:
                trainer.checkpointer.save(curr_step=0, **API.seed_save)
            else:
                instrument(trainer, args.debug_grad_scale)
                trainer.train()
        finally:
            trainer.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # leave without gloo's teardown, which can hang on torch 2.1/2.4


if __name__ == "__main__":
    sys.exit(main())
