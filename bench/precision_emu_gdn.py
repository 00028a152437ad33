"""Precision of dg (and of sum(dg·g), the A_log / dt_bias gradients' shape) without a GPU: a float64 emulation of
the GDN chunk kernels' forward intermediates and hand-written backward (chunk_fwd.py / chunk_bwd.py, one head,
T a multiple of 64), rounding to bf16 exactly where the kernels round (dot operands, stored tensors; the names in
``POINTS``), against the float64 recurrence, next to torch's bf16 chunk reference (autograd).

``python -m bench.precision_emu_gdn --decay mild --seeds 30`` prints the distribution of sum(dg·g)'s relative
error for both; ``--leave-one-out`` also prints, for the worst seeds, the error with each rounding point left out.
With no rounding the emulation matches the recurrence to 1e-14 (a check of the backward formulas).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from gqla_triton.ops.gdn.reference import chunk_gated_delta_rule_ref, recurrent_gated_delta_rule_ref

BT = 64
# dq / dk's own roundings (dkp, the dPm operand) do not reach dg and are left out
POINTS = ("ainv", "wu_op", "w", "u", "h", "vnew", "st_op", "dvl_op", "dvl", "dhe", "sb_kdS", "dvn", "sb_ddq",
          "sb_dv", "dw", "wy_ks", "wy_vs", "wy_dT", "wy_AdT")


def make_R(on):
    def R(x, name):
        return x.to(torch.bfloat16).to(torch.float64) if name in on else x
    return R


def fwd_bwd(q, k, v, g, beta, do, scale, R):
    T, K = q.shape
    V = v.shape[1]
    NT = (T + BT - 1) // BT
    gc = torch.cat([torch.cumsum(g[c * BT:(c + 1) * BT], 0) for c in range(NT)])
    Ainv, w, u = [], [], []
    for c in range(NT):
        s = slice(c * BT, (c + 1) * BT)
        kk, gg, bb = k[s], gc[s], beta[s]
        A = torch.tril(bb[:, None] * (kk @ kk.T) * torch.exp(gg[:, None] - gg[None, :]), -1)
        Ai = R(torch.linalg.inv(torch.eye(BT) + A), "ainv")
        Ainv.append(Ai)
        w.append(R(Ai @ R(kk * (bb * torch.exp(gg))[:, None], "wu_op"), "w"))
        u.append(R(Ai @ R(v[s] * bb[:, None], "wu_op"), "u"))
    # state fwd
    S = torch.zeros(K, V)
    hs, vns = [], []
    for c in range(NT):
        s = slice(c * BT, (c + 1) * BT)
        hc = R(S, "h")
        hs.append(hc)
        vn = u[c] - w[c] @ R(S, "st_op")
        vns.append(R(vn, "vnew"))
        gl = gc[s][-1]
        S = S * torch.exp(gl) + R(k[s] * torch.exp(gl - gc[s])[:, None], "st_op").T @ R(vn, "st_op")
    # dv_local
    dvl = []
    for c in range(NT):
        s = slice(c * BT, (c + 1) * BT)
        kq = k[s] @ q[s].T  # rows j, cols i
        gg = gc[s]
        m = torch.triu(torch.ones(BT, BT, dtype=torch.bool))
        PT = torch.where(m, kq * torch.exp(gg[None, :] - gg[:, None]), 0.0)
        dvl.append(R(R(PT, "dvl_op") @ do[s] * scale, "dvl"))
    # state bwd
    dS = torch.zeros(K, V)
    dhe, dvn = [None] * NT, [None] * NT
    for c in reversed(range(NT)):
        s = slice(c * BT, (c + 1) * BT)
        dhe[c] = R(dS, "dhe")
        gg = gc[s]
        gl = gg[-1]
        dv = dvl[c] + (k[s] @ R(dS, "sb_kdS")) * torch.exp(gl - gg)[:, None]
        dvn[c] = R(dv, "dvn")
        ddq = do[s] * (torch.exp(gg) * scale)[:, None]
        dS = dS * torch.exp(gl) + q[s].T @ R(ddq, "sb_ddq") - w[c].T @ R(dv, "sb_dv")
    # grad + wy_bwd
    dg_all = []
    for c in range(NT):
        s = slice(c * BT, (c + 1) * BT)
        qq, kk, gg = q[s], k[s], gc[s]
        gl = gg[-1]
        h_, de, vn, dd, dv = hs[c], dhe[c], vns[c], do[s], dvn[c]  # h, dhe, v_new, dvn: stored (rounded) tiles
        dqi = dd @ h_.T
        dki = vn @ de.T
        dww = dv @ h_.T
        dP = dd @ vn.T
        dqq = dqi * (torch.exp(gg) * scale)[:, None]
        dg = (dqq * qq).sum(1)
        dkk = dki * torch.exp(gl - gg)[:, None]
        dkt = (dkk * kk).sum(1)
        dg = dg - dkt
        hsum = (h_ * de).sum()
        dgl = dkt.sum() + torch.exp(gl) * hsum
        m = torch.tril(torch.ones(BT, BT, dtype=torch.bool))
        dPm = torch.where(m, dP * scale * torch.exp(gg[:, None] - gg[None, :]), 0.0)
        dPP = dPm * (qq @ kk.T)
        dg = dg + dPP.sum(1) - dPP.sum(0)
        dg[-1] += dgl
        dw_ = R(-dww, "dw")
        dgc = dg
        # wy_bwd
        A = Ainv[c]
        b = beta[s]
        eg = torch.exp(gg)
        ks = R(kk * (b * eg)[:, None], "wy_ks")
        vs = R(v[s] * b[:, None], "wy_vs")
        dT = dw_ @ ks.T + dv @ vs.T
        KK = kk @ kk.T
        dA = -A.T @ R(R(dT, "wy_dT") @ A.T, "wy_AdT")
        ml = torch.tril(torch.ones(BT, BT, dtype=torch.bool), -1)
        KD = torch.where(ml, KK * torch.exp(gg[:, None] - gg[None, :]), 0.0)
        dA = torch.where(ml, dA, 0.0)
        dAK = dA * KD
        dAA = dAK * b[:, None]
        dgg = dAA.sum(1) - dAA.sum(0)
        dX = A.T @ dw_
        t1 = (dX * kk).sum(1) * eg
        dgg = dgg + t1 * b
        dgg = dgg + dgc
        dg_all.append(torch.flip(torch.cumsum(torch.flip(dgg, [0]), 0), [0]))
    return torch.cat(dg_all)


def inputs(seed, T, decay):
    gen = torch.Generator().manual_seed(seed)
    K = V = 128
    q = torch.nn.functional.normalize(torch.randn(T, K, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(T, K, generator=gen), dim=-1)
    v = torch.randn(T, V, generator=gen)
    a = torch.randn(T, generator=gen)
    if decay == "strong":
        A = torch.empty(1).uniform_(1, 16, generator=gen)
        g = -A * torch.nn.functional.softplus(a + 0.5)
    else:
        g = torch.nn.functional.logsigmoid(a) / 8
    beta = torch.sigmoid(torch.randn(T, generator=gen))
    do = torch.randn(T, V, generator=gen)
    rb = lambda x: x.to(torch.bfloat16).to(torch.float64)
    return rb(q), rb(k), rb(v), g.float().double(), beta.float().double(), rb(do)


def ref_dg(q, k, v, g, beta, do, scale):
    xs = [t.clone().requires_grad_() for t in (q, k, v, g, beta)]
    o, _ = recurrent_gated_delta_rule_ref(*(x[None, :, None] for x in xs), scale=scale)
    (o[0, :, 0] * do).sum().backward()
    return xs[3].grad


def torch_dg(q, k, v, g, beta, do, scale):
    xs = [t.float().clone().requires_grad_() for t in (q, k, v, g, beta)]
    o, _ = chunk_gated_delta_rule_ref(*(x[None, :, None] for x in xs), scale=scale, compute_dtype=torch.bfloat16)
    (o[0, :, 0].double() * do).sum().backward()
    return xs[3].grad.double()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--decay", default="mild", choices=("strong", "mild"))
    ap.add_argument("--seeds", type=int, default=30)
    ap.add_argument("--T", type=int, default=128, help="a multiple of 64")
    ap.add_argument("--leave-one-out", action="store_true")
    a = ap.parse_args()
    torch.set_default_dtype(torch.float64)
    scale = 128 ** -0.5
    ours, tor = [], []
    for seed in range(a.seeds):
        q, k, v, g, beta, do = inputs(seed, a.T, a.decay)
        dg64 = ref_dg(q, k, v, g, beta, do, scale)
        s_ref = float((dg64 * g).sum())

        def err(dg):
            return abs(float((dg * g).sum()) - s_ref) / abs(s_ref)

        if seed == 0:
            exact = fwd_bwd(q, k, v, g, beta, do, scale, make_R(set()))
            print(f"no rounding: dg rel err {float((exact - dg64).norm() / dg64.norm()):.1e}")
        ours.append(err(fwd_bwd(q, k, v, g, beta, do, scale, make_R(set(POINTS)))))
        tor.append(err(torch_dg(q, k, v, g, beta, do, scale)))
        if a.leave_one_out and ours[-1] > 1e-2:
            print(f"seed {seed}: {ours[-1]:.2e}; without " + " ".join(
                f"{p} {err(fwd_bwd(q, k, v, g, beta, do, scale, make_R(set(POINTS) - {p}))):.1e}" for p in POINTS))
    for name, e in (("ours (emulated)", ours), ("torch bf16 ref", tor)):
        s = sorted(e)
        print(f"{a.decay} T{a.T} {name:16s} sum(dg*g) rel err: median {statistics.median(s):.2e}  "
              f"p90 {s[int(0.9 * len(s))]:.2e}  max {s[-1]:.2e}")
    print("ours / torch per seed: " + " ".join(f"{x / y:.1f}" for x, y in zip(ours, tor, strict=True)))


if __name__ == "__main__":
    main()
