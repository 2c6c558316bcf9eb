"""Anchor for bench/train_llama.py on several GPUs: the Llama-3-style decoder of the shared
`torch_llama.py` anchor (RMSNorm, rotate-half RoPE, SwiGLU, grouped-query SDPA, no biases, untied
head) in PyTorch, tensor-parallel or fully sharded as torchtitan applies them.

    torchrun --nproc_per_node=2 bench/torch_llama_parallel.py --mode tp|fsdp [--compile 1]

--mode tp: DTensor's plan over all ranks: q, k, v, gate and up split by columns, o and down by
rows, the embedding and the head by vocabulary (`loss_parallel` cross-entropy); one batch of B
sequences for the job; bf16 autocast over fp32 parameters. --mode fsdp: `fully_shard` per layer
and at the root, bf16 parameters and fp32 gradient reduction (`MixedPrecisionPolicy`), B sequences
per rank. Both: fused AdamW, --compile compiles each layer (after TP, before FSDP). Prints one
ANCHOR line on rank 0: the job's tokens/s, the step, rank 0's peak allocated and reserved memory.
`--device cpu` runs it on CPU ranks (gloo) for a check of the script itself.
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def arguments():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("tp", "fsdp"), required=True)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--B", type=int, default=4, help="sequences: the job's (tp), each rank's (fsdp)")
    p.add_argument("--T", type=int, default=2048)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--compile", type=int, default=0)
    p.add_argument("--theta", type=float, default=500000.0)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    return p.parse_args()


def rotate(x, cos, sin):
    """HF's rotate-half RoPE."""
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Attention(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.hd = a.dim // a.heads
        self.q_proj = nn.Linear(a.dim, a.heads * self.hd, bias=False)
        self.k_proj = nn.Linear(a.dim, a.kv_heads * self.hd, bias=False)
        self.v_proj = nn.Linear(a.dim, a.kv_heads * self.hd, bias=False)
        self.o_proj = nn.Linear(a.heads * self.hd, a.dim, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape        # heads from the local widths: a tensor-parallel rank has its share
        q = self.q_proj(x).view(b, t, -1, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.hd).transpose(1, 2)
        y = F.scaled_dot_product_attention(rotate(q, cos, sin), rotate(k, cos, sin), v,
                                           is_causal=True, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.gate_proj = nn.Linear(a.dim, a.ffn, bias=False)
        self.up_proj = nn.Linear(a.dim, a.ffn, bias=False)
        self.down_proj = nn.Linear(a.ffn, a.dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(a.dim, eps=1e-5)
        self.self_attn = Attention(a)
        self.post_attention_layernorm = nn.RMSNorm(a.dim, eps=1e-5)
        self.mlp = MLP(a)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.a = a
        self.embed_tokens = nn.Embedding(a.vocab, a.dim)
        self.layers = nn.ModuleList([Layer(a) for _ in range(a.layers)])
        self.norm = nn.RMSNorm(a.dim, eps=1e-5)
        self.lm_head = nn.Linear(a.dim, a.vocab, bias=False)

    def forward(self, idx):
        a, device = self.a, idx.device
        hd = a.dim // a.heads
        inv = 1.0 / (a.theta ** (torch.arange(0, hd, 2, device=device).float() / hd))
        angles = torch.outer(torch.arange(idx.size(1), device=device).float(), inv)
        cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
        x = self.embed_tokens(idx)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


def tensor_parallel(model, mesh):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, RowwiseParallel, parallelize_module)
    parallelize_module(model, mesh, {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)})
    for layer in model.layers:
        parallelize_module(layer, mesh, {
            "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel()})


def main():
    a = arguments()
    cuda = a.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        torch.backends.cuda.matmul.allow_tf32 = True
    device = torch.device(a.device, torch.cuda.current_device()) if cuda else torch.device("cpu")
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh(a.device, (world,))
    torch.manual_seed(0)
    model = Llama(a).to(device)
    params = sum(p.numel() for p in model.parameters())
    if a.mode == "tp":
        if a.kv_heads % world or a.heads % world:
            raise SystemExit(f"--mode tp: {world} ranks must divide --heads {a.heads} and "
                             f"--kv-heads {a.kv_heads}")
        tensor_parallel(model, mesh)
    if a.compile:
        for i, layer in enumerate(model.layers):
            model.layers[i] = torch.compile(layer)
    if a.mode == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if cuda else torch.float32,
                                      reduce_dtype=torch.float32)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
    # fused AdamW takes a group's tensors all DTensors or all plain: tensor parallelism leaves
    # the norms' weights plain (replicated, no sequence parallelism), so they are a group apart
    from torch.distributed.tensor import DTensor
    groups = [[p for p in model.parameters() if isinstance(p, DTensor) == d] for d in (1, 0)]
    optimizer = torch.optim.AdamW([{"params": g} for g in groups if g], lr=1e-4, fused=cuda)
    generator = torch.Generator().manual_seed(1 + (rank if a.mode == "fsdp" else 0))
    idx, tgt = (torch.randint(0, a.vocab, (a.B, a.T), generator=generator).to(device)
                for _ in range(2))
    autocast = a.mode == "tp" and cuda      # FSDP2 casts the parameters itself

    def step():
        with torch.autocast(a.device, dtype=torch.bfloat16, enabled=autocast):
            logits = model(idx)
        if a.mode == "tp":
            from torch.distributed.tensor.parallel import loss_parallel
            with loss_parallel():
                loss = F.cross_entropy(logits.float().flatten(0, 1), tgt.flatten())
                loss.backward()
        else:
            loss = F.cross_entropy(logits.float().flatten(0, 1), tgt.flatten())
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    for _ in range(5 if a.compile else 3):
        step()
    synchronize = torch.cuda.synchronize if cuda else (lambda: None)
    synchronize()
    start = time.perf_counter()
    for _ in range(a.steps):
        loss = step()
    synchronize()
    step_s = (time.perf_counter() - start) / a.steps
    tokens = a.B * a.T * (world if a.mode == "fsdp" else 1)
    allocated = torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else 0.0
    reserved = torch.cuda.max_memory_reserved() / 2 ** 30 if cuda else 0.0
    loss = loss.detach()
    loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
    if rank == 0:
        print(f"ANCHOR torch-llama-{a.mode}{'-compile' if a.compile else ''} world={world} "
              f"L={a.layers} D={a.dim} H={a.heads} KV={a.kv_heads} F={a.ffn} V={a.vocab} "
              f"B={a.B} T={a.T} params={params / 1e6:.1f}M step_ms={step_s * 1e3:.1f} "
              f"tok/s={tokens / step_s:,.0f} peak_mem_GiB={allocated:.2f} "
              f"peak_reserved_GiB={reserved:.2f} loss={float(loss):.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
