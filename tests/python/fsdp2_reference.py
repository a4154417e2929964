"""PyTorch FSDP2 trains ShardRL's test transformer: the independent reference for mixed precision.

    fsdp2_reference.py DIR --world 2 --param-dtype bf16 --reduce-dtype fp32

DIR (written by the C++ test) holds init.safetensors (the initial parameters under their names),
tokens.safetensors (the global token batch of step k as `tokens.k`) and config.json (the model
config, the steps and the learning rate). Each of `--world` ranks (processes over Gloo) trains on its contiguous slice of
every global batch with `fully_shard` on each block and then the root, MixedPrecisionPolicy(
param_dtype, reduce_dtype, output_dtype=fp32) and torch.optim.AdamW on the fp32 sharded params.
Rank 0 writes DIR/fsdp2_params.safetensors (the full params after training) and
DIR/fsdp2_losses.json (the mean over ranks of each step's loss).
"""
import argparse
import json
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from transformer_twin import Transformer  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build(config, initial):
    model = Transformer(config["vocab_size"], config["max_seq_len"], config["d_model"],
                        config["n_heads"], config["n_layers"], config["mlp_ratio"])
    # The test scenario's params that never get a grad, where ShardRL's test model has them.
    if "unused_root" in initial:
        model.register_parameter("unused_root", torch.nn.Parameter(torch.empty(5, 3)))
    if "blocks.0.unused_in_block" in initial:
        model.blocks[0].register_parameter("unused_in_block", torch.nn.Parameter(torch.empty(7)))
    model.load_state_dict(initial, strict=True)
    return model


def run_rank(rank, args, port):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=args.world)
    config = json.load(open(os.path.join(args.dir, "config.json")))
    initial = load_file(os.path.join(args.dir, "init.safetensors"))
    batches = load_file(os.path.join(args.dir, "tokens.safetensors"))
    model = build(config, initial)
    precision = dict(param_dtype=DTYPES[args.param_dtype], reduce_dtype=DTYPES[args.reduce_dtype])
    for block in model.blocks:
        fully_shard(block, mp_policy=MixedPrecisionPolicy(**precision))
    # fp32 logits from the root only, as ShardRL's output_dtype (FSDP2 casts every module's
    # outputs to its policy's output_dtype).
    fully_shard(model, mp_policy=MixedPrecisionPolicy(**precision, output_dtype=torch.float32))
    # Weight decay on matrices only, written out here rather than taken from ShardRL's rule.
    decay = [p for _, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for _, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=config["lr"], betas=(0.9, 0.999), eps=1e-8, foreach=False)
    losses = []
    for step in range(config["steps"]):
        tokens = batches[f"tokens.{step}"]
        local = tokens.shape[0] // args.world
        tokens = tokens[rank * local:(rank + 1) * local]
        optimizer.zero_grad(set_to_none=True)
        logits = model(tokens)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                               tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / args.world)
    full = {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}
    if rank == 0:
        save_file(full, os.path.join(args.dir, "fsdp2_params.safetensors"))
        with open(os.path.join(args.dir, "fsdp2_losses.json"), "w") as f:
            json.dump(losses, f)
    dist.barrier()
    # Every rank is done and rank 0's results are on disk: leave without PyTorch's teardown. Its
    # Gloo teardown aborted now and then in a rank that had finished ("terminate called without an
    # active exception", about 1 run in 40 here), failing a reference that had run to the end.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("dir")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--param-dtype", default="bf16", choices=DTYPES)
    parser.add_argument("--reduce-dtype", default="fp32", choices=DTYPES)
    args = parser.parse_args()
    mp.start_processes(run_rank, args=(args, free_port()), nprocs=args.world, join=True,
                       start_method="spawn")


if __name__ == "__main__":
    main()
