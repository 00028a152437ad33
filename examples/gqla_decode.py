"""A small random-weight GQLA stack generating tokens on both decode paths.

Prefills a batch of random prompts, then decodes greedily with the absorb path (LatentCache + mla_decode)
and replays the same tokens through the grouped path (GroupedCache + gqa_decode), printing how closely the
logits agree, each path's decode tokens/s, and the auto path choice for this GPU and (roofline model) for
H100 / H200 / H20. Without CUDA it runs under the Triton CPU interpreter at a tiny size.

    python examples/gqla_decode.py [--layers 4 --batch 32 --prompt 512 --new 32]
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

from torch import nn  # noqa: E402

from gqla_triton.layers import GQLAttention, RMSNorm  # noqa: E402

CUDA = torch.cuda.is_available()
BIG = dict(vocab=32000, hidden=2048, num_heads=32, num_groups=4, head_dim=128, rope_dim=64, kv_rank=512, page=64)
TINY = dict(vocab=128, hidden=64, num_heads=16, num_groups=2, head_dim=16, rope_dim=16, kv_rank=32, page=16)


class Block(nn.Module):
    def __init__(self, cfg, **fk):
        super().__init__()
        self.norm1 = RMSNorm(cfg["hidden"], **fk)
        self.attn = GQLAttention(cfg["hidden"], cfg["num_heads"], cfg["num_groups"], cfg["head_dim"],
                                 cfg["rope_dim"], cfg["kv_rank"], **fk)
        self.norm2 = RMSNorm(cfg["hidden"], **fk)
        self.up = nn.Linear(cfg["hidden"], 2 * cfg["hidden"], bias=False, **fk)
        self.down = nn.Linear(2 * cfg["hidden"], cfg["hidden"], bias=False, **fk)

    def forward(self, x, cache, positions=None):
        x = x + self.attn(self.norm1(x), positions, cache)
        return x + self.down(torch.nn.functional.silu(self.up(self.norm2(x))))


class TinyLM(nn.Module):
    def __init__(self, cfg, layers, **fk):
        super().__init__()
        self.embed = nn.Embedding(cfg["vocab"], cfg["hidden"], **fk)
        self.blocks = nn.ModuleList(Block(cfg, **fk) for _ in range(layers))
        self.norm = RMSNorm(cfg["hidden"], **fk)
        self.head = nn.Linear(cfg["hidden"], cfg["vocab"], bias=False, **fk)

    def forward(self, tokens, caches):
        x = self.embed(tokens)
        for blk, cache in zip(self.blocks, caches, strict=True):
            x = blk(x, cache)
        return self.head(self.norm(x)).float()


@torch.no_grad()
def generate(model, prompt, new, path, cfg, forced=None):
    """Greedy decode; ``forced`` replays given tokens (teacher forcing) so logits are comparable across paths."""
    B, T0 = prompt.shape
    caches = [blk.attn.make_cache(B, T0 + new, path=path, page_size=cfg["page"]) for blk in model.blocks]
    logits = [model(prompt, caches)[:, -1]]
    tok = forced[:, :1] if forced is not None else logits[-1].argmax(-1, keepdim=True)
    toks = [tok]
    if CUDA:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(new - 1):
        logits.append(model(tok, caches)[:, -1])
        tok = forced[:, i + 1:i + 2] if forced is not None else logits[-1].argmax(-1, keepdim=True)
        toks.append(tok)
    if CUDA:
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    return torch.cat(toks, 1), torch.stack(logits, 1), B * (new - 1) / dt


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4 if CUDA else 2)
    ap.add_argument("--batch", type=int, default=32 if CUDA else 2)
    ap.add_argument("--prompt", type=int, default=512 if CUDA else 12)
    ap.add_argument("--new", type=int, default=32 if CUDA else 4)
    args = ap.parse_args(argv)
    cfg = BIG if CUDA else TINY
    dev = "cuda" if CUDA else "cpu"
    dtype = torch.bfloat16 if CUDA else torch.float32
    if not CUDA:
        print("no CUDA device: running the Triton kernels in the CPU interpreter (TRITON_INTERPRET=1) at a tiny size")
    torch.manual_seed(0)
    model = TinyLM(cfg, args.layers, device=dev, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.normal_(0, p.shape[1] ** -0.5)
    model = model.to(dtype)
    prompt = torch.randint(0, cfg["vocab"], (args.batch, args.prompt), device=dev)

    for path in ("absorb", "grouped"):  # compile every kernel at these shapes outside the timed loops
        generate(model, prompt, 3, path, cfg)
    toks_a, log_a, tps_a = generate(model, prompt, args.new, "absorb", cfg)
    toks_g, log_g, tps_g = generate(model, prompt, args.new, "grouped", cfg, forced=toks_a)
    greedy_g = log_g.argmax(-1)
    diff = ((log_a - log_g).norm() / log_a.norm()).item()
    agree = (greedy_g == toks_a).float().mean().item()
    print(f"model: {args.layers} GQLA layers, hidden {cfg['hidden']}, h_q {cfg['num_heads']}, g {cfg['num_groups']}, "
          f"d_h {cfg['head_dim']}, d_R {cfg['rope_dim']}, r {cfg['kv_rank']}, {str(dtype).replace('torch.', '')}, "
          f"batch {args.batch}, prompt {args.prompt}, {args.new} new tokens")
    print(f"absorb vs grouped logits: rel diff {diff:.2e}; grouped greedy picks == absorb tokens: {agree:.1%}")
    ok = diff < (3e-2 if dtype == torch.bfloat16 else 1e-4)
    print("outputs agree" if ok else "OUTPUTS DIFFER")
    print(f"decode tokens/s: absorb {tps_a:,.1f}   grouped {tps_g:,.1f}"
          + ("   (interpreter: not a speed measurement)" if not CUDA else ""))
    attn = model.blocks[0].attn
    seqlen = args.prompt + args.new
    here = attn.choose_path(batch=args.batch, seqlen=seqlen) if CUDA else None
    if here is not None:
        print(f"auto choice on this GPU ({here.gpu}): {here.path}  (model: absorb {here.absorb_s * 1e6:.1f} us, "
              f"grouped {here.grouped_s * 1e6:.1f} us per layer step)")
    paper = GQLAttention(7168, 128, 8, 128, 64, 512, device="meta")  # the paper's layer shape, for contrast
    for label, layer, B, L in (("this model", attn, args.batch, seqlen), ("paper layer B128 S8192", paper, 128, 8192)):
        for gpu in ("h100", "h200", "h20"):
            for s_q in (1, 2):
                c = layer.choose_path(batch=B, seqlen=L, s_q=s_q, gpu=gpu)
                print(f"auto choice (model) {label:>22} {c.gpu:>9} s_q={s_q}: {c.path:8s} "
                      f"absorb {c.absorb_s * 1e6:9.3f} us   grouped {c.grouped_s * 1e6:9.3f} us")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
