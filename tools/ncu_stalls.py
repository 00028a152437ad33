"""Warp-stall samples of an Nsight Compute source page, per warp-specialised partition (no GPU needed).

    ncu --profile-from-start off --section WarpStateStats --section SourceCounters --import-source yes \\
        -k regex:mla_decode_gluon -o m1 python -m tools.ncu_launch --op mla --workload M1
    ncu -i m1.ncu-rep --page source --print-source sass --csv > m1.csv
    python -m tools.ncu_stalls m1.csv [--top 12] [--blocks 20] [--min-share 1]

A warp-specialised kernel's SASS holds each partition's code as one range of instructions, entered through a
``USETMAXREG`` (the register count the partition takes). The tool cuts each kernel's instruction list at those
instructions and prints, per range holding at least ``--min-share`` per cent of the kernel's samples: its samples
(all, and those where the warp issued), its share, and the ``--top`` instructions with the most samples with their
three leading stall reasons. ``--blocks N`` adds the samples of each N consecutive instructions of the range, to
read a loop's phases (products, softmax, waits) from the instructions they hold.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import re
import sys

ALL = "Warp Stall Sampling (All Samples)"
NOT_ISSUED = "Warp Stall Sampling (Not-issued Samples)"


@dataclasses.dataclass
class Region:
    """Instructions ``[start, end)`` of one kernel's SASS, entered at ``label`` (the ``USETMAXREG`` or ``entry``)."""

    label: str
    start: int
    end: int
    samples: int
    issued: int


@dataclasses.dataclass
class Kernel:
    name: str
    header: list[str]
    rows: list[list[str]]

    def column(self, name: str) -> int:
        try:
            return self.header.index(name)
        except ValueError:
            raise ValueError(f"the source page has no column {name!r}: export it with --page source "
                             "--print-source sass --csv from a report with the WarpStateStats and SourceCounters "
                             "sections") from None

    def samples(self, i: int, name: str = ALL) -> int:
        cell = self.rows[i][self.column(name)].replace(",", "").strip()
        return int(float(cell)) if cell not in ("", "-") else 0

    def source(self, i: int) -> str:
        return self.rows[i][self.column("Source")].strip()

    def stalls(self, i: int, top: int = 3, end: int | None = None) -> list[tuple[str, int]]:
        """The ``top`` stall reasons of instruction ``i`` (of instructions ``[i, end)`` together) with their samples
        (all samples, largest first)."""
        out = []
        for c, h in enumerate(self.header):
            if h.startswith("stall_") and "Not Issued" not in h:
                n = 0
                for row in self.rows[i:i + 1 if end is None else end]:
                    cell = row[c].replace(",", "").strip()
                    n += int(float(cell)) if cell not in ("", "-") else 0
                if n:
                    out.append((h[len("stall_"):], n))
        return sorted(out, key=lambda kv: -kv[1])[:top]

    def regions(self) -> list[Region]:
        """The instruction list cut at every ``USETMAXREG``, with each range's samples."""
        cuts = [0] + [i for i in range(len(self.rows)) if "USETMAXREG" in self.source(i)] + [len(self.rows)]
        out = []
        for a, b in zip(cuts[:-1], cuts[1:], strict=True):
            if a == b:
                continue
            label = _maxreg_label(self.source(a)) if "USETMAXREG" in self.source(a) else "entry"
            total = sum(self.samples(i) for i in range(a, b))
            idle = sum(self.samples(i, NOT_ISSUED) for i in range(a, b))
            out.append(Region(label, a, b, total, total - idle))
        return out


def _maxreg_label(src: str) -> str:
    """``USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xe8`` -> ``alloc 232 regs``; ``...DEALLOC.CTAPOOL 0x28`` ->
    ``dealloc 40 regs``."""
    m = re.search(r"0x([0-9a-fA-F]+)\s*$", src)
    regs = f" {int(m.group(1), 16)} regs" if m else ""
    return ("dealloc" if "DEALLOC" in src else "alloc") + regs


def read_kernels(path: str) -> list[Kernel]:
    """The kernels of a ``--page source --csv`` export: each a ``"Kernel Name",<name>`` line, the header line,
    then one line per instruction."""
    kernels: list[Kernel] = []
    with open(path, newline="") as f:
        lines = list(csv.reader(f))
    i = 0
    while i < len(lines):
        row = lines[i]
        if row and row[0] == "Kernel Name":
            name = row[1] if len(row) > 1 else "?"
            if i + 1 >= len(lines):
                raise ValueError(f"{path}: kernel {name!r} has no header line")
            header, body = lines[i + 1], []
            i += 2
            while i < len(lines) and not (lines[i] and lines[i][0] == "Kernel Name"):
                if len(lines[i]) >= len(header) - 1:
                    body.append(lines[i] + [""] * (len(header) - len(lines[i])))
                i += 1
            kernels.append(Kernel(name, header, body))
        else:
            i += 1
    if not kernels:
        raise ValueError(f"{path}: no \"Kernel Name\" line: not an ncu --page source --csv export")
    return kernels


def report(kernel: Kernel, top: int = 12, blocks: int = 0, min_share: float = 1.0) -> str:
    """The text the command prints for one kernel."""
    regions = kernel.regions()
    total = sum(r.samples for r in regions) or 1
    lines = [f"{kernel.name}: {len(kernel.rows)} instructions, {total} samples"]
    for r in regions:
        share = 100.0 * r.samples / total
        if share < min_share:
            continue
        lines.append(f"  [{r.start}, {r.end}) {r.label}: {r.samples} samples ({share:.1f} %), issued {r.issued}")
        why = kernel.stalls(r.start, top=5, end=r.end)
        lines.append("    stall reasons: " + ", ".join(f"{k} {100.0 * v / (r.samples or 1):.0f} %" for k, v in why))
        best = sorted(range(r.start, r.end), key=lambda i: -kernel.samples(i))[:top]
        for i in sorted(best):
            n = kernel.samples(i)
            if n == 0:
                continue
            why = ", ".join(f"{k} {v}" for k, v in kernel.stalls(i))
            lines.append(f"    {i:6d} {n:7d} {100.0 * n / r.samples:5.1f} %  {kernel.source(i)[:64]:64s} {why}")
        if blocks > 0:
            for a in range(r.start, r.end, blocks):
                b = min(a + blocks, r.end)
                n = sum(kernel.samples(i) for i in range(a, b))
                ops = sorted({_opcode(kernel.source(i)) for i in range(a, b)} - {""})
                lines.append(f"    block {a:6d} {n:7d} {100.0 * n / r.samples:5.1f} %  {' '.join(ops)[:100]}")
    return "\n".join(lines)


def _opcode(src: str) -> str:
    """The opcode of a SASS line, without its predicate."""
    parts = src.split()
    if parts and parts[0].startswith("@"):
        parts = parts[1:]
    return parts[0] if parts else ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.ncu_stalls", description=__doc__.splitlines()[0])
    ap.add_argument("csv", help="ncu -i REPORT --page source --print-source sass --csv output")
    ap.add_argument("--top", type=int, default=12, help="instructions listed per partition")
    ap.add_argument("--blocks", type=int, default=0, help="also the samples of each N consecutive instructions")
    ap.add_argument("--min-share", type=float, default=1.0, help="omit ranges below this per cent of the samples")
    a = ap.parse_args(argv)
    try:
        kernels = read_kernels(a.csv)
        for k in kernels:
            print(report(k, a.top, a.blocks, a.min_share))
    except (OSError, ValueError) as e:
        print(f"tools.ncu_stalls: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
