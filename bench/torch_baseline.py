#!/usr/bin/env python3
"""PyTorch baselines for bench_fsdp: the same transformer, optimizer and step in Python.

  --mode fsdp2   PyTorch FSDP2 (fully_shard on the token embedding, each block and the head,
                 then the root, as torchtitan; MixedPrecisionPolicy
                 with --param-dtype and fp32 reduce), the yardstick ShardRL's FSDP is measured by
  --mode ddp     DistributedDataParallel (replicated state, one all-reduce of the grads)
  --mode local   one process, no process group

Run it with the venv's torch (scripts/install-deps.sh) under the same launcher as the C++ ranks,
so both get the same rendezvous and thread limits:

    build/bin/shardrl launch -n 2 --threads 1 -- ~/.cache/shardrl/venv/bin/python \
        bench/torch_baseline.py --mode fsdp2 --batch 8
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python"))
from transformer_twin import Transformer  # noqa: E402

MAX_NORM = 1.0
MODEL_SEED, DATA_SEED = 1234, 4321


def next_token_loss(logits, tokens):
    V = logits.shape[-1]
    pred = logits[:, :-1].reshape(-1, V).float()
    target = tokens[:, 1:].reshape(-1)
    return F.cross_entropy(pred, target)


# The two groups of shardrl::optim::make_adamw: 1-D params and names with bias/norm/ln_ get no
# weight decay.
def make_adamw(model, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, fused=None):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        exempt = p.dim() <= 1 or any(s in name for s in ("bias", "norm", "ln_"))
        (no_decay if exempt else decay).append(p)
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr, betas=betas, eps=eps, fused=fused)


def loopback_tx_bytes():
    """Bytes sent on the loopback interface by every process of the machine."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if rest and name.strip() == "lo":
                return int(rest.split()[8])  # 8 receive counters, then tx bytes
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8, help="global batch, split over ranks")
    ap.add_argument("--steps", type=int, default=5, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: keep)")
    ap.add_argument("--json-out", default="")
    ap.add_argument("--mode", choices=("fsdp2", "ddp", "local"), default="ddp")
    ap.add_argument("--no-reshard-after-forward", dest="reshard_after_forward",
                    action="store_false",
                    help="fsdp2: the blocks keep their params from forward to backward (ZeRO-2)")
    ap.add_argument("--param-dtype", choices=("fp32", "bf16"), default="fp32",
                    help="fsdp2: MixedPrecisionPolicy.param_dtype (reduce stays fp32)")
    ap.add_argument("--autocast-bf16", action="store_true",
                    help="torch.autocast(device, bfloat16) around forward: PyTorch's bf16 mixed precision")
    ap.add_argument("--fused-adamw", action="store_true",
                    help="torch.optim.AdamW(fused=True), the kernel ShardRL's AdamW steps with "
                         "(default: PyTorch's own choice, foreach on CUDA, a loop on the CPU)")
    ap.add_argument("--profile-out", default="",
                    help="rank 0 writes a torch.profiler chrome trace of --profile-steps more steps")
    ap.add_argument("--profile-steps", type=int, default=2)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: NCCL and cuda:LOCAL_RANK, as ShardRL's ranks pick when a GPU is visible")
    args = ap.parse_args()

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    distributed = args.mode != "local" and "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if distributed and device.type == "cuda":
        dist.init_process_group("nccl", init_method="env://", device_id=device)
        rank, world = dist.get_rank(), dist.get_world_size()
    elif distributed:
        # Gloo would otherwise pick the interface the hostname resolves to; the C++ ranks use
        # loopback for a loopback master, and the lo byte count below relies on that.
        if os.environ.get("MASTER_ADDR", "127.0.0.1") in ("127.0.0.1", "localhost"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group("gloo", init_method="env://")
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = 0, 1
    if args.batch % world:
        raise SystemExit("--batch must be divisible by WORLD_SIZE")
    local = args.batch // world

    torch.manual_seed(MODEL_SEED)
    model = Transformer(args.vocab, args.seq, args.d_model, args.heads, args.layers).to(device)
    P = sum(p.numel() for p in model.parameters())
    if args.mode == "fsdp2" and distributed:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        dtype = torch.bfloat16 if args.param_dtype == "bf16" else torch.float32
        unit_policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        # torchtitan's recipe, as shardrl::models::shard_transformer: the token embedding, each
        # block and the head are units of their own; the root keeps pos_emb and ln_f. The head
        # runs last in forward and first in backward, so torchtitan keeps it unsharded in between
        # rather than gather it again at once.
        fully_shard(model.tok_emb, mp_policy=unit_policy,
                    reshard_after_forward=args.reshard_after_forward)
        for block in model.blocks:
            fully_shard(block, mp_policy=unit_policy,
                        reshard_after_forward=args.reshard_after_forward)
        fully_shard(model.head, mp_policy=unit_policy, reshard_after_forward=False)
        # fp32 logits from the root, as bench_fsdp's output_dtype.
        fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32,
                                                          output_dtype=torch.float32))
    optimizer = make_adamw(model, fused=True if args.fused_adamw else None)
    if args.mode == "ddp" and distributed:
        model = nn.parallel.DistributedDataParallel(model)
    gen = torch.Generator().manual_seed(DATA_SEED)
    tokens = torch.randint(args.vocab, (args.batch, args.seq), generator=gen)
    tokens = tokens[rank * local:(rank + 1) * local].contiguous().to(device)

    def synchronize():
        # Kernels run asynchronously on a GPU: a step ends when the device has done its work.
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def barrier():
        if distributed:
            dist.barrier()

    times, losses = [], []
    device_memory = None
    lo_start = 0
    profiled_steps = args.profile_steps if args.profile_out else 0
    profiler = None
    for step in range(args.warmup + args.steps + profiled_steps):
        if step == args.warmup + args.steps and args.profile_out and rank == 0:
            # With the allocator's events: where each side reaches its peak.
            activities = [torch.profiler.ProfilerActivity.CPU]
            if device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            profiler = torch.profiler.profile(activities=activities, profile_memory=True)
            profiler.__enter__()
        timed = args.warmup <= step < args.warmup + args.steps
        if timed and step == args.warmup and rank == 0:
            lo_start = loopback_tx_bytes()
        if step == args.warmup and device.type == "cuda":
            # The peak over the timed steps, after warm-up filled the allocator's cache.
            torch.cuda.reset_peak_memory_stats(device)
        synchronize()
        barrier()
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)  # as FSDP's zero_grad: grads dropped, not zeroed
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.autocast_bf16):
            logits = model(tokens)
        loss = next_token_loss(logits, tokens)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        synchronize()
        barrier()
        elapsed = time.perf_counter() - t0
        if timed:
            times.append(elapsed)
            losses.append(loss.item())
        if step == args.warmup + args.steps - 1 and device.type == "cuda":
            # The peak over the timed steps alone, before any profiled step.
            device_memory = {
                "peak_allocated_bytes": torch.cuda.max_memory_allocated(device),
                "peak_reserved_bytes": torch.cuda.max_memory_reserved(device),
            }
    if profiler is not None:
        synchronize()
        profiler.__exit__(None, None, None)
        profiler.export_chrome_trace(args.profile_out)
    lo_bytes = loopback_tx_bytes() - lo_start if rank == 0 else 0
    if rank != 0:
        barrier()
        return

    med = statistics.median(times) if times else 0.0
    per = world * max(args.steps, 1)
    lo_per = lo_bytes / per if distributed else 0.0
    if args.mode == "fsdp2":
        # All-gather in forward, again in backward for the units resharded after forward (the
        # blocks and tok_emb, with reshard_after_forward; never the root or the head, kept until
        # backward), one reduce-scatter: (N-1)/N of each leaves a rank.
        resharded = sum(p.numel() for m in (model.blocks, model.tok_emb) for p in m.parameters())
        regathered = resharded if args.reshard_after_forward else 0
        wire = 2 if args.param_dtype == "bf16" else 4
        theory = ((P + regathered) * wire + P * 4.0) * (world - 1) / world
    else:
        # Ring all-reduce of every fp32 gradient: 2 (N-1)/N of the bytes leave each rank.
        theory = 2.0 * P * 4 * (world - 1) / world
    result = {
        "benchmark": "torch_baseline",
        "impl": f"pytorch-{args.mode}",
        "mode": args.mode if distributed else "local",
        "reshard_after_forward": args.reshard_after_forward,
        "param_dtype": args.param_dtype,
        "fused_adamw": args.fused_adamw,
        "world_size": world,
        "device": str(device),
        "device_memory": device_memory,
        "environment": {
            "threads": torch.get_num_threads(),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", ""),
            "OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS", ""),
            "torch_version": torch.__version__,
        },
        "model": {"d_model": args.d_model, "n_layers": args.layers, "n_heads": args.heads,
                  "vocab_size": args.vocab, "seq_len": args.seq, "mlp_ratio": 4,
                  "param_count": P},
        "batch_global": args.batch,
        "batch_per_rank": local,
        "warmup_steps": args.warmup,
        "timed_steps": args.steps,
        "loss_first": losses[0] if losses else 0.0,
        "loss_last": losses[-1] if losses else 0.0,
        "step_s": times,
        "median_step_s": med,
        "mean_step_s": statistics.fmean(times) if times else 0.0,
        "min_step_s": min(times, default=0.0),
        "max_step_s": max(times, default=0.0),
        "tokens_per_s": args.batch * args.seq / med if med > 0 else 0.0,
        "comm": {
            "theoretical_bytes": theory,
            "loopback_tx_bytes_per_rank_per_step": lo_per,
            "ratio_loopback_to_theoretical": lo_per / theory if theory > 0 else None,
        },
    }
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=2, sort_keys=True)
            f.write("\n")
    peak = (f"  peak {device_memory['peak_allocated_bytes'] / 2**20:.1f} MiB"
            if device_memory else "")
    print(f"{args.mode:<5} {device} N={world} threads={torch.get_num_threads()} B={args.batch}  median step "
          f"{med:.4f} s  {result['tokens_per_s']:.0f} tok/s  lo {lo_per / 1e6:.3f} MB"
          f" (x{(lo_per / theory) if theory else 0:.4f} of the schedule){peak}", flush=True)
    # Rank 0 hosts the store: the others must not find it gone while they finish.
    barrier()


if __name__ == "__main__":
    main()
