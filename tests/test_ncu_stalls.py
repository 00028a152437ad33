"""``tools.ncu_stalls``: partitions, sums and stall reasons of an Nsight Compute source-page export (no GPU)."""

from __future__ import annotations

import csv

import pytest

from tools import ncu_stalls

HEADER = ["Address", "Source", ncu_stalls.ALL, ncu_stalls.NOT_ISSUED, "stall_barrier", "stall_long_sb",
          "stall_barrier (Not Issued)", "stall_long_sb (Not Issued)"]
# (source, all samples, not issued, barrier, long_sb)
BODY = [
    ("LDC R1, c[0x0][0x28]", 3, 3, 3, 0),
    ("USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xe8", 0, 0, 0, 0),
    ("HGMMA.64x64x16.F32.BF16 R24, gdesc[UR24], R24", 10, 4, 0, 0),
    ("WARPGROUP.DEPBAR.LE gsb0, 0x0", 40, 38, 38, 0),
    ("@!P1  BRA 0x7f41", 7, 6, 0, 6),
    ("USETMAXREG.DEALLOC.CTAPOOL 0x28", 1, 1, 0, 1),
    ("SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR44+0x38630], R10", 2, 1, 1, 0),
    ("@!P1  BRA 0x7f42", "1,000", 990, 0, 990),
]


def _write(path, kernels=("k0",)):
    with open(path, "w", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        for name in kernels:
            w.writerow(["Kernel Name", name])
            w.writerow(HEADER)
            for i, (src, n, ni, bar, lsb) in enumerate(BODY):
                w.writerow([hex(i), src, n, ni, bar, lsb, ni if bar else 0, ni if lsb else 0])


def test_regions_and_sums(tmp_path):
    path = tmp_path / "k.csv"
    _write(path, ("k0", "k1"))
    kernels = ncu_stalls.read_kernels(str(path))
    assert [k.name for k in kernels] == ["k0", "k1"]
    regions = kernels[1].regions()
    assert [(r.label, r.start, r.end) for r in regions] == [
        ("entry", 0, 1), ("alloc 232 regs", 1, 5), ("dealloc 40 regs", 5, 8)]
    assert [r.samples for r in regions] == [3, 57, 1003]
    assert [r.issued for r in regions] == [0, 9, 11]
    assert kernels[0].stalls(3) == [("barrier", 38)]
    assert kernels[0].stalls(1, end=5) == [("barrier", 38), ("long_sb", 6)]
    text = ncu_stalls.report(kernels[0], top=2, blocks=2, min_share=1.0)
    assert "alloc 232 regs: 57 samples (5.4 %), issued 9" in text
    assert "dealloc 40 regs: 1003 samples (94.4 %)" in text
    assert "entry" not in text  # 3 samples: below --min-share
    assert "long_sb 990" in text and "block" in text
    assert "stall reasons: long_sb 99 %, barrier 0 %" in text  # the dealloc range: 990 + 1 of 1003 samples


def test_not_an_export(tmp_path, capsys):
    path = tmp_path / "x.csv"
    path.write_text("a,b\n1,2\n")
    assert ncu_stalls.main([str(path)]) == 1
    assert "not an ncu --page source --csv export" in capsys.readouterr().err
    _write(path)
    assert ncu_stalls.main([str(path), "--top", "1"]) == 0
    with pytest.raises(ValueError, match="no column"):
        ncu_stalls.Kernel("k", ["Address"], [["0x0"]]).samples(0)
