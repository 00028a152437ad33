"""Roofline pictures: per GPU, the attainable bf16 rate against arithmetic intensity, with the GQLA decode
workloads of both paths placed on it (``python -m gqla_triton.roofline --plot DIR``). Needs matplotlib
(``pip install matplotlib``); nothing here is imported by the ops.
"""

from __future__ import annotations

from pathlib import Path

from . import roofline
from .decode_path import choose_decode_path

__all__ = ["plot_roofline"]

# (label, batch, seqlen, s_q) of the decode points drawn for the paper's layer; a path's intensity hardly depends
# on batch and length (the cache dominates the bytes), so one batch stands for all
POINTS = (("s_q 1", 128, 4096, 1), ("s_q 2 (MTP)", 128, 4096, 2))
COLORS = {"absorb": "tab:blue", "grouped": "tab:orange"}


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # an optional dependency: say which
        raise ImportError("plots need matplotlib: pip install matplotlib") from e
    return plt


def plot_roofline(out_dir: str | Path, gpus: tuple[str, ...] = ("h100", "h200", "h20")) -> list[Path]:
    """One PNG per GPU key plus ``roofline-paths.png`` with the GPUs side by side; returns the paths written.

    Each point is one decode step of the paper's layer (h_q 128, g 8, d_h 128, r 512, d_R 64) for a batch / length
    / s_q: its intensity (FLOP per byte moved) and the rate the roofline allows at that intensity (filled), and,
    where the GPU's config table holds measured kernel efficiencies, that rate times the efficiency (hollow).
    The path the decode-path choice picks is ringed. The paper's argument as a picture: on the H100 / H200 the
    absorb path sits at the ridge (its 3.7x fewer cache bytes win), on the H20 far right of a low ridge (compute-bound),
    where the grouped path, memory-bound either way, is faster; MTP (s_q 2) doubles the grouped path's intensity
    for free."""
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    fig_all, axes = plt.subplots(1, len(gpus), figsize=(5.2 * len(gpus), 4.4), sharey=True, squeeze=False)
    for ax_all, gpu in zip(axes[0], gpus, strict=True):
        fig, ax = plt.subplots(figsize=(6.4, 4.8))
        for a in (ax, ax_all):
            _draw(a, gpu)
        ax.legend(fontsize=7, loc="lower right")
        fig.tight_layout()
        path = out / f"roofline-{gpu}.png"
        fig.savefig(path, dpi=130)
        plt.close(fig)
        written.append(path)
    axes[0][0].set_ylabel("attainable TFLOP/s (bf16)")
    richest = max(axes[0], key=lambda a: len(a.get_legend_handles_labels()[1]))
    richest.legend(fontsize=7, loc="lower right")
    fig_all.suptitle("GQLA decode on the roofline: absorb (MLA over the latent cache) vs grouped (GQA)")
    fig_all.tight_layout()
    path = out / "roofline-paths.png"
    fig_all.savefig(path, dpi=130)
    plt.close(fig_all)
    return [*written, path]


def _draw(ax, gpu: str) -> None:
    spec = roofline.gpu_spec(gpu, name="gpu")
    peak, bw = spec.bf16_flops / 1e12, spec.hbm_bytes_s / 1e12
    xs = sorted([2.0**e for e in range(0, 12)] + [spec.ridge])
    ax.plot(xs, [min(peak, bw * x) for x in xs], color="black", lw=1.2)
    ax.axvline(spec.ridge, color="gray", ls=":", lw=0.8)
    ax.text(spec.ridge * 1.05, peak * 0.05, f"ridge {spec.ridge:.0f}", fontsize=7, color="gray")
    layer = roofline.PAPER_LAYER
    for label, batch, seqlen, s_q in POINTS:
        choice = choose_decode_path(layer, s_q, gpu, batch=batch, seqlen=seqlen)
        for path, model in (("absorb", roofline.mla_decode_model(batch, seqlen, s_q)),
                            ("grouped", roofline.gqa_decode_model(batch, seqlen, s_q))):
            x = model.intensity
            y = model.flops / model.time(spec) / 1e12
            ax.scatter([x], [y], color=COLORS[path], s=22, zorder=3,
                       label=f"{path} (roofline)" if label == POINTS[0][0] else None)
            t_ours = choice.absorb_s if path == "absorb" else choice.grouped_s
            if t_ours > model.time(spec) * 1.0001:  # a measured efficiency for this GPU
                ax.scatter([x], [model.flops / t_ours / 1e12], facecolors="none", edgecolors=COLORS[path], s=22,
                           zorder=3, label=f"{path} (measured efficiency)" if label == POINTS[0][0] else None)
            if path == choice.path:
                ax.scatter([x], [y], facecolors="none", edgecolors="black", s=80, lw=0.8, zorder=2,
                           label="picked by choose_decode_path" if label == POINTS[0][0] else None)
            ax.annotate(label, (x, y), fontsize=6, xytext=(3, -9), textcoords="offset points")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("FLOP per byte")
    ax.set_title(f"{spec.name}: {peak:.0f} TFLOP/s, {bw:.2f} TB/s", fontsize=9)
    ax.grid(True, which="both", lw=0.3, alpha=0.5)
