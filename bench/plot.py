"""Pictures of the benchmark results: per op, our measured time beside every anchor of the same run and the
roofline floor of each workload (``python -m bench.run --plot DIR``; reads ``bench/results/<gpu>-<op>.json``,
needs no GPU). Decode rows are drawn at their CUDA-graph time where the run measured one."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["plot_results"]


def _rows(path: Path) -> list[dict]:
    return [r for r in json.loads(path.read_text()).get("rows", []) if r.get("ms")]


def plot_results(results: str | Path, out_dir: str | Path, gpu: str = "h200") -> list[Path]:
    """One PNG per result file of ``gpu`` (``<gpu>-<op>.png``): grouped bars (ms, log scale) per workload and
    implementation, the floor as a black tick per workload. Returns the paths written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("plots need matplotlib: pip install matplotlib") from e
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for path in sorted(Path(results).glob(f"{gpu}-*.json")):
        rows = _rows(path)
        if not rows:
            continue
        keys = list(dict.fromkeys((r["op"], r["workload"]) for r in rows))
        impls = list(dict.fromkeys(r["impl"] for r in rows))
        at = {(r["op"], r["workload"], r["impl"]): r.get("graph_ms") or r["ms"] for r in rows}
        floor = {(r["op"], r["workload"]): r.get("floor_ms") for r in rows}
        width = 0.8 / len(impls)
        fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(keys) + 2), 4.2))
        for i, impl in enumerate(impls):
            xs = [j + (i - (len(impls) - 1) / 2) * width for j, k in enumerate(keys) if (*k, impl) in at]
            ys = [at[(*k, impl)] for k in keys if (*k, impl) in at]
            ax.bar(xs, ys, width * 0.95, label=impl.replace("gqla_triton", "ours"))
        fl = [(j, floor[k]) for j, k in enumerate(keys) if floor.get(k)]
        if fl:
            ax.scatter([j for j, _ in fl], [f for _, f in fl], marker="_", s=400, color="black", zorder=3,
                       label="roofline floor")
        ax.set_xticks(range(len(keys)))
        ax.set_xticklabels([f"{w}\n{o}" for o, w in keys], fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("ms (CUDA graph where measured)")
        ax.set_title(f"{path.stem}: {json.loads(path.read_text()).get('command', '')}", fontsize=8)
        ax.legend(fontsize=7)
        ax.grid(True, axis="y", which="both", lw=0.3, alpha=0.5)
        fig.tight_layout()
        target = out / f"{path.stem}.png"
        fig.savefig(target, dpi=120)
        plt.close(fig)
        written.append(target)
    return written
