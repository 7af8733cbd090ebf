"""PyTorch FSDP2 on the zoo's GPTs, on the same CPU: the contestant users know.

The same model as ``zoo.py``'s ``user_gpt`` (attention by hand, biases everywhere,
untied head) or ``plain`` (``scaled_dot_product_attention``, no attention biases,
tied embeddings), the same shapes, AdamW, fp32, global batch split over ``--ranks``
gloo processes on 127.0.0.1, each block and the root ``fully_shard``-ed (FSDP2's
ZeRO-3). ``--attention`` swaps the attention kernel, to see what it is worth.
Needs torch (not a jaxzero dependency): run it with a Python that has it:

    /path/to/torch/venv/bin/python -m experiments.fsdp2_step --model user_gpt
    /path/to/torch/venv/bin/python -m experiments.fsdp2_step --model user_gpt --attention sdpa

Prints the median step time and tokens/s of ``--runs`` passes of ``--steps`` steps
(after 2 warm-up steps); a step is timed on rank 0 from its start until every rank
has finished it (a barrier), as ``bench_step.py`` waits for the whole output.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

SHAPES = dict(d_model=256, layers=4, heads=4, seq_len=128, vocab=256, batch=16)


def hand_attention(q, k, v):
    """``zoo.user_gpt_attention`` in PyTorch: (B, heads, S, head dim) in and out."""
    import torch

    s = q.shape[-2]
    att = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    return att.masked_fill(~causal, -1e9).softmax(-1) @ v


def build(args):
    import torch
    import torch.nn.functional as F
    from torch import nn

    biased = args.model == "user_gpt"

    class Block(nn.Module):
        def __init__(self, d: int):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv = nn.Linear(d, 3 * d, bias=biased)
            self.proj = nn.Linear(d, d, bias=biased)
            self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            b, s, d = x.shape
            q, k, v = (
                t.view(b, s, args.heads, d // args.heads).transpose(1, 2)
                for t in self.qkv(self.ln1(x)).split(d, dim=-1)
            )
            if args.attention == "sdpa":
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                y = hand_attention(q, k, v)
            x = x + self.proj(y.transpose(1, 2).reshape(b, s, d))
            return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            d = args.d_model
            self.tok, self.pos = nn.Embedding(args.vocab, d), nn.Embedding(args.seq_len, d)
            self.blocks = nn.ModuleList(Block(d) for _ in range(args.layers))
            self.ln_f = nn.LayerNorm(d)
            self.head = None if not biased else nn.Linear(d, args.vocab)
            for p in self.parameters():
                if p.dim() == 2:
                    nn.init.normal_(p, std=0.02)

        def forward(self, tokens, targets):
            x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
            for blk in self.blocks:
                x = blk(x)
            x = self.ln_f(x)
            logits = self.head(x) if self.head is not None else x @ self.tok.weight.T
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    return GPT()


def worker(rank: int, args, port: int, out) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = build(args)
    n_params = sum(p.numel() for p in model.parameters())
    for blk in model.blocks:
        fully_shard(blk)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=1e-4)
    g = torch.Generator().manual_seed(rank)
    per_rank = args.batch // args.ranks
    tokens = torch.randint(0, args.vocab, (per_rank, args.seq_len + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]

    def step() -> float:
        t = time.perf_counter()
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        dist.barrier()
        return time.perf_counter() - t

    for _ in range(2):
        step()
    runs = [statistics.median(step() for _ in range(args.steps)) for _ in range(args.runs)]
    if rank == 0:
        out.put((n_params, runs))
    dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=["user_gpt", "plain"], default="user_gpt")
    p.add_argument("--attention", choices=["hand", "sdpa"], help="default: the model's own")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    p.add_argument("--steps", type=int, default=21)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--port", type=int, default=29517)
    for k, v in SHAPES.items():
        p.add_argument(f"--{k.replace('_', '-')}", type=int, default=v)
    args = p.parse_args(argv)
    args.attention = args.attention or ("hand" if args.model == "user_gpt" else "sdpa")
    if args.batch % args.ranks:
        p.error(f"--batch {args.batch} is not divisible by --ranks {args.ranks}")

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.start_processes(worker, (args, args.port, out), nprocs=args.ranks, start_method="spawn")
    n_params, runs = out.get()
    tokens = args.batch * args.seq_len
    print(
        f"FSDP2 {args.model} ({n_params / 1e6:.1f}M params, attention {args.attention}), "
        f"{args.ranks} gloo ranks x {args.threads} thread(s), global batch {args.batch} x "
        f"{args.seq_len}: median step "
        + ", ".join(f"{t * 1e3:.1f}" for t in runs)
        + f" ms over {args.runs} runs; {tokens / statistics.median(runs):.0f} tokens/s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
