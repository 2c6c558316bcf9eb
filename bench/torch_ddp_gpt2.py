"""Anchor for bench/data_parallel.py: PyTorch DDP on GPT-2, the same three measurements.
torchrun --nproc_per_node=2 bench/torch_ddp_gpt2.py [--B 8] [--untied] [--bucket-mib 25]

(1) the step of the model alone on each GPU (no DDP), (2) the same model under
DistributedDataParallel (B sequences per rank), (3) all-reduces of the gradients in buckets of
--bucket-mib by themselves; speedup and the hidden share of (3) as bench/data_parallel.py
computes them. bf16 autocast, SDPA attention, fused AdamW, tanh GeLU, tied embedding and head.
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel


class Block(nn.Module):
    def __init__(self, c, heads):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(c), nn.LayerNorm(c)
        self.c_attn, self.c_proj = nn.Linear(c, 3 * c), nn.Linear(c, c)
        self.c_fc, self.mlp_proj = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).view(b, t, 3, self.heads, -1).transpose(1, 3).unbind(2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, layers=12, c=768, heads=12, vocab=50304, block=1024, tied=True):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, c), nn.Embedding(block, c)
        self.h = nn.ModuleList([Block(c, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(c)
        self.head = nn.Linear(c, vocab, bias=False)
        if tied:
            self.head.weight = self.wte.weight

    def forward(self, ids, targets):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for block in self.h:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


def timed(fn, steps, warmup):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def step_of(model, ids, targets):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(ids, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--B", type=int, default=8)
    p.add_argument("--T", type=int, default=1024)
    p.add_argument("--untied", action="store_true")
    p.add_argument("--bucket-mib", type=float, default=25.0)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(rank)
    ids = torch.randint(0, 50257, (args.B, args.T + 1), device="cuda")
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    torch.manual_seed(0)
    alone = GPT(tied=not args.untied).cuda()
    single = timed(step_of(alone, x, y), args.steps, args.warmup)
    del alone
    torch.manual_seed(0)
    model = GPT(tied=not args.untied).cuda()
    ddp = DistributedDataParallel(model, bucket_cap_mb=args.bucket_mib)
    parallel = timed(step_of(ddp, x, y), args.steps, args.warmup)
    grads = [p for p in model.parameters()]
    buckets, current, size = [], [], 0
    for p in reversed(grads):
        if current and size + p.numel() * 4 > args.bucket_mib * 2 ** 20:
            buckets.append(torch.empty(sum(q.numel() for q in current), device="cuda"))
            current, size = [], 0
        current.append(p)
        size += p.numel() * 4
    buckets.append(torch.empty(sum(q.numel() for q in current), device="cuda"))

    def all_reduce():
        works = [dist.all_reduce(b, async_op=True) for b in buckets]
        for work in works:
            work.wait()
    reduce = timed(all_reduce, args.steps, args.warmup)
    if rank == 0:
        tokens = args.B * args.T
        speedup = (world * tokens / parallel) / (tokens / single)
        hidden = max(0.0, 1 - max(0.0, parallel - single) / reduce)
        print(f"ANCHOR torch-ddp 124M tied={int(not args.untied)} ranks={world} B={args.B}/rank "
              f"T={args.T} buckets={len(buckets)} step_1gpu_ms={1e3 * single:.2f} "
              f"step_ddp_ms={1e3 * parallel:.2f} allreduce_ms={1e3 * reduce:.2f} "
              f"tok/s_1gpu={tokens / single:.0f} tok/s_ddp={world * tokens / parallel:.0f} "
              f"speedup={speedup:.2f} hidden={100 * hidden:.0f}%", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
