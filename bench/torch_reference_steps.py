"""The first training steps of cupytp's GPT-2 beside a PyTorch GPT-2 given the same initial
weights (cupytp's, exported with `hf_state_dict()`), the same batches, the same AdamW, clipping
and learning-rate schedule, on the CPU:

    python bench/torch_reference_steps.py                      # 2 layers, 128 wide, bytes, T=64
    python bench/torch_reference_steps.py --n-layer 12 --n-embd 768 --n-head 12 --steps 12

Prints both losses, their difference and the learning rate per step, so a divergence (ours) can
be told from a loss curve that both frameworks share (the schedule's). Needs `torch` (not a
dependency of cupytp). On a GPU both run there; `CUPY_TF32=1` (what train_gpt2.py sets) gives
both frameworks TF32 matmuls.
"""
import argparse
import math
import os

import torch
import torch.nn.functional as F

import cupytp
from cupytp import backend
from cupytp.data import ByteTokenizer, TokenLoader, default_corpus_path, prepare_corpus, read_tokens
from cupytp.models.gpt2 import GPT2, GPT2Config
from cupytp.optim import AdamW, clip_grad_norm_, cosine_with_warmup, decay_groups
from cupytp.tensor import Replicated, from_local, local_mesh


def torch_forward(w, config, ids, targets):
    """GPT-2 (Hugging Face GPT2LMHeadModel's math and weight layout) on {HF key: tensor}."""
    b, t = ids.shape
    c, h = config.n_embd, config.n_head

    def norm(x, name):
        return F.layer_norm(x, (c,), w[name + ".weight"], w[name + ".bias"],
                            config.layer_norm_epsilon)

    x = w["transformer.wte.weight"][ids] + w["transformer.wpe.weight"][:t]
    for i in range(config.n_layer):
        p = f"transformer.h.{i}."
        qkv = norm(x, p + "ln_1") @ w[p + "attn.c_attn.weight"] + w[p + "attn.c_attn.bias"]
        q, k, v = (z.view(b, t, h, c // h).transpose(1, 2) for z in qkv.split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(b, t, c)
        x = x + y @ w[p + "attn.c_proj.weight"] + w[p + "attn.c_proj.bias"]
        m = norm(x, p + "ln_2") @ w[p + "mlp.c_fc.weight"] + w[p + "mlp.c_fc.bias"]
        m = F.gelu(m, approximate="tanh")
        x = x + m @ w[p + "mlp.c_proj.weight"] + w[p + "mlp.c_proj.bias"]
    logits = norm(x, "transformer.ln_f") @ w["transformer.wte.weight"].T
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=6e-4, help="default: train_gpt2's 124M default")
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--total-steps", type=int, default=300, help="the cosine's length")
    p.add_argument("--dtype", default="fp64", choices=["fp32", "fp64"])
    p.add_argument("--seed", type=int, default=1337)
    args = p.parse_args()
    cupytp.init()
    torch.manual_seed(args.seed)
    device = "cuda" if backend.on_gpu else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = os.environ.get("CUPY_TF32") == "1"
    dtype = {"fp32": torch.float32, "fp64": torch.float64}[args.dtype]
    tokenizer = ByteTokenizer()
    config = GPT2Config(vocab_size=tokenizer.vocab_size, block_size=args.seq_len,
                        n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)

    cupytp.manual_seed(args.seed)
    ours = GPT2(config).to(args.dtype)
    weights = {k: torch.tensor(v, dtype=dtype, device=device, requires_grad=True)
               for k, v in ours.hf_state_dict().items() if k != "lm_head.weight"}
    ours_opt = AdamW(decay_groups(ours.named_parameters(), 0.1), lr=args.lr,
                     betas=(0.9, 0.95), eps=1e-8)
    torch_opt = torch.optim.AdamW(     # nanoGPT's grouping: matrices decay, biases and norms not
        [{"params": [w for w in weights.values() if w.ndim >= 2], "weight_decay": 0.1},
         {"params": [w for w in weights.values() if w.ndim < 2], "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8)

    paths = prepare_corpus(default_corpus_path(), "out/torch_reference/data", tokenizer)
    loader = TokenLoader(read_tokens(paths[0]), args.batch_size, args.seq_len, seed=args.seed)
    replicated = (Replicated(),)
    print(f"GPT-2 {args.n_layer} layers, {args.n_embd} wide, {args.n_head} heads, vocab "
          f"{config.vocab_size}, B={args.batch_size}, T={args.seq_len}, {args.dtype} on "
          f"{device}, lr {args.lr:g}, warmup {args.warmup}, cosine over {args.total_steps}")
    print(f"{'step':>4}  {'lr':>9}  {'cupytp':>10}  {'pytorch':>10}  {'|difference|':>12}  "
          f"{'|g| cupytp':>10}  {'|g| torch':>10}")
    worst = 0.0
    for step in range(args.steps):
        lr = cosine_with_warmup(step, args.lr, args.warmup, args.total_steps, args.lr * 0.1)
        for group in ours_opt.param_groups + torch_opt.param_groups:
            group["lr"] = lr
        x, y = loader.next_batch()
        _, loss = ours(*(from_local(backend.asarray(a), local_mesh(), replicated, shape=a.shape)
                         for a in (x, y)))
        loss.backward()
        norm = float(clip_grad_norm_(ours.parameters(), 1.0))
        ours_opt.step()
        ours_opt.zero_grad()
        torch_loss = torch_forward(weights, config, torch.from_numpy(x).to(device),
                                   torch.from_numpy(y).to(device))
        torch_loss.backward()
        torch_norm = float(torch.nn.utils.clip_grad_norm_(weights.values(), 1.0))
        torch_opt.step()
        torch_opt.zero_grad()
        a, b = loss.item(), torch_loss.item()
        worst = max(worst, abs(a - b))
        print(f"{step:4d}  {lr:9.3e}  {a:10.6f}  {b:10.6f}  {abs(a - b):12.3e}  {norm:10.4f}  "
              f"{torch_norm:10.4f}", flush=True)
    print(f"largest |difference| of the losses: {worst:.3e} (ln vocab = "
          f"{math.log(config.vocab_size):.4f})")


if __name__ == "__main__":
    main()
