"""A small Qwen3-Next-like hybrid model: three GatedDeltaNet blocks to one GQLAttention block, MLPs between.

Random weights. Prompts of different lengths are prefilled one sequence at a time into the layers' caches
(chunked gated delta rule + SDPA); then every decode step of the whole model (embedding, all blocks, logits,
greedy argmax feeding the next step) runs as one CUDA graph replay. The GQLA blocks decode through the absorb
path (LatentCache) and then, on the same weights and prompts, the grouped path (GroupedCache). Every step's
logits are checked against the same model run eagerly with ``impl="reference"`` (pure-torch layers) on the same
tokens. Prints prefill and decode tokens/s per path. Without CUDA it runs the Triton kernels in the CPU
interpreter at a tiny size, eagerly (timings there mean nothing).

    python examples/hybrid_lm.py [--blocks 2 --batch 16 --prompt 256 --new 64]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

if not torch.cuda.is_available():  # must be set before gqla_triton (and triton) are imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from gqla_triton.layers import GatedDeltaNet, GQLAttention, RMSNorm  # noqa: E402

CUDA = torch.cuda.is_available()
BIG = dict(vocab=32000, hidden=2048, gdn=dict(num_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128),
           gqla=dict(num_heads=32, num_groups=2, head_dim=128, rope_dim=64, kv_rank=512), page=64)
TINY = dict(vocab=128, hidden=64, gdn=dict(num_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16),
            gqla=dict(num_heads=16, num_groups=2, head_dim=16, rope_dim=16, kv_rank=32), page=16)
PATTERN = ("gdn", "gdn", "gdn", "gqla")


class Block(nn.Module):
    def __init__(self, kind: str, cfg: dict, impl: str, **fk):
        super().__init__()
        self.kind = kind
        h = cfg["hidden"]
        self.norm1 = RMSNorm(h, **fk)
        if kind == "gdn":
            self.mixer = GatedDeltaNet(h, **cfg["gdn"], impl=impl, **fk)
        else:
            self.mixer = GQLAttention(h, **cfg["gqla"], impl=impl, **fk)
        self.norm2 = RMSNorm(h, **fk)
        self.up = nn.Linear(h, 2 * h, bias=False, **fk)
        self.down = nn.Linear(2 * h, h, bias=False, **fk)

    def forward(self, x, cache, slots):
        y = self.norm1(x)
        if self.kind == "gdn":
            y = self.mixer(y, cache, slots=slots)
        else:
            y = self.mixer(y, cache=cache, seq_ids=slots)
        x = x + y
        return x + self.down(F.silu(self.up(self.norm2(x))))


class HybridLM(nn.Module):
    def __init__(self, cfg: dict, blocks: int, impl: str = "auto", **fk):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg["vocab"], cfg["hidden"], **fk)
        self.blocks = nn.ModuleList(Block(kind, cfg, impl, **fk) for _ in range(blocks) for kind in PATTERN)
        self.norm = RMSNorm(cfg["hidden"], **fk)
        self.head = nn.Linear(cfg["hidden"], cfg["vocab"], bias=False, **fk)

    def make_caches(self, batch: int, max_len: int, path: str):
        return [blk.mixer.init_cache(batch) if blk.kind == "gdn"
                else blk.mixer.make_cache(batch, max_len, path=path, page_size=self.cfg["page"])
                for blk in self.blocks]

    def forward(self, tokens, caches, slots=None):
        """``tokens [B, T]`` -> logits ``[B, T, vocab]`` fp32; the caches of ``slots`` receive the tokens."""
        x = self.embed(tokens)
        for blk, cache in zip(self.blocks, caches, strict=True):
            x = blk(x, cache, slots)
        return self.head(self.norm(x)).float()


def sync():
    if CUDA:
        torch.cuda.synchronize()


@torch.no_grad()
def prefill(model, prompts, caches):
    """Each prompt into its own slot; returns the first generated tokens ``[B, 1]`` and the seconds taken."""
    sync()
    t0 = time.perf_counter()
    first = []
    for i, p in enumerate(prompts):
        logits = model(p[None], caches, slots=[i])
        first.append(logits[0, -1].argmax(-1))
    sync()
    return torch.stack(first)[:, None], time.perf_counter() - t0


@torch.no_grad()
def decode(model, tok, caches, new: int):
    """``new`` greedy steps of the whole model from ``tok [B, 1]``: one CUDA graph replay per step on a GPU
    (eager steps without one). Returns ``(tokens [B, new], logits [B, new, vocab], seconds)``."""
    B = tok.shape[0]
    for blk, cache in zip(model.blocks, caches, strict=True):
        if blk.kind == "gqla":
            cache.reserve(list(range(B)), new)
    static_tok = tok.clone()

    def step():
        logits = model(static_tok, caches)[:, -1]
        static_tok.copy_(logits.argmax(-1, keepdim=True))
        return logits

    toks, logits = [], []
    if CUDA:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_logits = step()
        sync()
        t0 = time.perf_counter()
        for _ in range(new):
            toks.append(static_tok.clone())  # the step's input token
            graph.replay()
            logits.append(static_logits.clone())
        sync()
    else:
        t0 = time.perf_counter()
        for _ in range(new):
            toks.append(static_tok.clone())
            logits.append(step())
    return torch.cat(toks, 1), torch.stack(logits, 1), time.perf_counter() - t0


@torch.no_grad()
def reference_logits(ref, prompts, toks, caches):
    """The reference model on the same prompts and decode inputs (teacher forced), eagerly."""
    for i, p in enumerate(prompts):
        ref(p[None], caches, slots=[i])
    return torch.stack([ref(toks[:, j:j + 1], caches)[:, -1] for j in range(toks.shape[1])], 1)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=2 if CUDA else 1, help="repeats of (3 x GatedDeltaNet, GQLA)")
    ap.add_argument("--batch", type=int, default=16 if CUDA else 2)
    ap.add_argument("--prompt", type=int, default=256 if CUDA else 8, help="longest prompt (others are shorter)")
    ap.add_argument("--new", type=int, default=64 if CUDA else 3)
    args = ap.parse_args(argv)
    cfg = BIG if CUDA else TINY
    dev = "cuda" if CUDA else "cpu"
    dtype = torch.bfloat16 if CUDA else torch.float32
    if not CUDA:
        print("no CUDA device: the Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1) at a tiny size")
    torch.manual_seed(0)
    model = HybridLM(cfg, args.blocks, device=dev, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.normal_(0, p.shape[1] ** -0.5)
    model = model.to(dtype).eval()
    ref = HybridLM(cfg, args.blocks, impl="reference", device=dev, dtype=dtype).eval()
    ref.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(1)
    lens = [max(2, args.prompt - (i * args.prompt) // (2 * args.batch)) for i in range(args.batch)]
    prompts = [torch.randint(0, cfg["vocab"], (n,), generator=g).to(dev) for n in lens]
    max_len = max(lens) + args.new + 1
    print(f"model: {args.blocks} x (3 GatedDeltaNet + 1 GQLA) blocks, hidden {cfg['hidden']}, "
          f"{str(dtype).replace('torch.', '')}, batch {args.batch}, prompts {min(lens)}..{max(lens)} tokens, "
          f"{args.new} new tokens")

    ok = True
    for path in ("absorb", "grouped"):
        # compile every kernel at these shapes on throwaway caches, outside the timed runs
        warm = model.make_caches(args.batch, max_len, path)
        first, _ = prefill(model, prompts, warm)
        decode(model, first, warm, 2)
        caches = model.make_caches(args.batch, max_len, path)
        first, t_pre = prefill(model, prompts, caches)
        toks, logits, t_dec = decode(model, first, caches, args.new)
        want = reference_logits(ref, prompts, toks, ref.make_caches(args.batch, max_len, path))
        err = ((logits - want).norm() / want.norm()).item()
        tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
        ok &= err < tol
        how = "one CUDA graph replay per step" if CUDA else "eager, interpreter: not a speed measurement"
        print(f"{path:>8}: prefill {sum(lens) / t_pre:12,.0f} tokens/s   decode {args.batch * args.new / t_dec:12,.0f} "
              f"tokens/s ({how})   logits vs reference: rel err {err:.2e} {'ok' if err < tol else 'MISMATCH'}")
    print("outputs agree" if ok else "OUTPUTS DIFFER")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
