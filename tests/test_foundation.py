"""Dispatch, roofline and import hygiene."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton
from hypothesis import given
from hypothesis import strategies as st

from gqla_triton import dispatch, roofline
from gqla_triton.ops._common.host import cdiv, next_pow2

CONFIGS = Path(dispatch.__file__).parent / "configs"


def test_paper_figures():
    # GQLA paper, h_q 128, g 8, d_h 128, r 512, d_R 64, L 8192
    h100_abs = roofline.paper_tokens_per_s("h100", "absorb", 1)
    h20_abs = roofline.paper_tokens_per_s("h20", "absorb", 1)
    h20_grp2 = roofline.paper_tokens_per_s("h20", "grouped", 2)
    assert h100_abs == pytest.approx(354e3, rel=0.01)
    assert h20_abs == pytest.approx(65e3, rel=0.01)
    assert h20_grp2 == pytest.approx(221e3, rel=0.01)
    assert h20_grp2 / h20_abs == pytest.approx(3.4, abs=0.05)


def test_roofline_models_count_what_design_says():
    m1 = roofline.mla_decode_model(128, 4096, 1)
    assert m1.flops == pytest.approx(146e9, rel=0.01)  # NUMBERS.md: M1 needs 146 GFLOP
    q1 = roofline.gqa_decode_model(128, 4096, 1)
    cache = 128 * 4096 * (2 * 8 * 128 + 64) * 2
    assert q1.bytes == pytest.approx(cache, rel=0.01)
    assert q1.time(roofline.gpu_spec("h200-measured")) * 1e3 == pytest.approx(0.518, rel=0.02)
    assert m1.bound(roofline.gpu_spec("h200")) == "compute" and q1.bound(roofline.gpu_spec("h200")) == "memory"


def test_roofline_cli_prints_table():
    out = subprocess.run([sys.executable, "-m", "gqla_triton.roofline"], capture_output=True, text=True,
                         check=True).stdout
    for name in ("G1", "M1", "Q4", "SQ1", "h20", "absorb", "grouped"):
        assert name in out


def test_choose_decode_path_follows_the_roofline():
    shape = dict(num_heads=128, num_groups=8, head_dim=128, rope_dim=64, kv_rank=512)
    for gpu in ("h100", "h200"):
        c = dispatch.choose_decode_path(shape, 1, gpu, batch=128, seqlen=4096, kernel_efficiency=False)
        assert c.path == "absorb" and c.absorb_s < c.grouped_s
    c = dispatch.choose_decode_path(shape, 2, "h20", batch=128, seqlen=4096)
    assert c.path == "grouped" and c.grouped_s < c.absorb_s
    assert dispatch.choose_decode_path(shape, 1, "h20", override="absorb").path == "absorb"
    with pytest.raises(ValueError, match="override"):
        dispatch.choose_decode_path(shape, 1, "h20", override="fast")
    with pytest.raises(ValueError, match="unknown GPU"):
        dispatch.choose_decode_path(shape, 1, "b300")


def test_interpreter_tables_pin_exactly_one_config_per_op():
    interp = json.loads((CONFIGS / "interpreter.json").read_text())
    for op, entries in interp.items():
        assert len(entries) == 1 and entries[0]["match"] == {}, f"{op}: interpreter must see one config"
    for name in ("h200.json", "default.json"):
        table = json.loads((CONFIGS / name).read_text())
        assert set(interp) <= set(table), f"{name} lacks ops {set(interp) - set(table)}"
        for op, entries in table.items():  # every table ends with a catch-all entry
            assert entries[-1]["match"] == {}, f"{name}:{op} needs a default entry last"


def test_select_config_matching_and_override(monkeypatch):
    table = {"op": [{"match": {"K": 64}, "config": {"BT": 32}}, {"match": {}, "config": {"BT": 64, "w": 4}}]}
    assert dispatch._match(table, "op", {"K": 64, "V": 3}) == {"BT": 32}
    assert dispatch._match(table, "op", {"K": 128}) == {"BT": 64, "w": 4}
    assert dispatch._match(table, "other", {}) is None
    monkeypatch.setenv("GQLA_TRITON_CONFIG", '{"combine": {"num_warps": 2}}')
    dispatch._env_override.cache_clear()
    assert dispatch.select_config("combine", {"D": 64})["num_warps"] == 2
    with pytest.raises(KeyError, match="no config"):
        dispatch.select_config("no_such_op")


def test_gpu_key():
    assert dispatch.gpu_key("NVIDIA H200") == "h200"
    assert dispatch.gpu_key("NVIDIA H100 80GB HBM3") == "h100"
    assert dispatch.gpu_key("NVIDIA H20") == "h20"
    assert dispatch.gpu_key("Some Future GPU") == "default"


def test_import_does_no_device_work():
    code = (
        "import torch, gqla_triton\n"
        "from gqla_triton import dispatch, roofline, ops, layers\n"
        "names = [n for n in gqla_triton.__all__]\n"
        "[getattr(gqla_triton, n) for n in names]\n"
        "assert not torch.cuda.is_initialized(), 'import initialised CUDA'\n"
        "assert dispatch._cuda_info.cache_info().currsize == 0\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_choose_decode_path_scales_by_measured_kernel_efficiency(monkeypatch):
    shape = dict(num_heads=128, num_groups=8, head_dim=128, rope_dim=64, kv_rank=512)
    hw = dispatch.choose_decode_path(shape, 1, "h100", batch=128, seqlen=4096, kernel_efficiency=False)
    # no table for the H100: the pure roofline
    assert dispatch.choose_decode_path(shape, 1, "h100", batch=128, seqlen=4096) == hw
    monkeypatch.setenv("GQLA_TRITON_CONFIG", '{"decode_path": {"absorb_efficiency": 0.25, "grouped_efficiency": 0.8}}')
    dispatch._env_override.cache_clear()
    c = dispatch.choose_decode_path(shape, 1, "h100", batch=128, seqlen=4096)
    assert c.absorb_s == pytest.approx(hw.absorb_s / 0.25) and c.grouped_s == pytest.approx(hw.grouped_s / 0.8)
    assert c.path == ("absorb" if c.absorb_s <= c.grouped_s else "grouped") and "efficiency" in c.reason
    monkeypatch.setenv("GQLA_TRITON_CONFIG", '{"decode_path": {"absorb_efficiency": 0}}')
    dispatch._env_override.cache_clear()
    with pytest.raises(ValueError, match="efficienc"):
        dispatch.choose_decode_path(shape, 1, "h100")
    monkeypatch.delenv("GQLA_TRITON_CONFIG")
    dispatch._env_override.cache_clear()
    # the H200 table holds what our kernels reached there: the measured winner is picked (session 12: mla_decode
    # M1 0.409 ms against gqa_decode Q1 0.517 ms, so absorb)
    h200 = dispatch.choose_decode_path(shape, 1, "h200", batch=128, seqlen=4096)
    assert h200.path == "absorb" and "efficiency" in h200.reason


@given(a=st.integers(0, 1 << 40), b=st.integers(1, 1 << 20), n=st.integers(0, 1 << 40))
def test_host_integer_helpers_match_triton(a, b, n):
    """The launchers' plain-Python cdiv / next_pow2 agree with triton.cdiv / triton.next_power_of_2."""
    assert cdiv(a, b) == triton.cdiv(a, b)
    assert next_pow2(n) == triton.next_power_of_2(n)
