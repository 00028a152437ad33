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

from gqla_triton import GQLAttention, decode_path, dispatch, roofline
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
    assert roofline.gqa_decode_model(128, 4096, rope_dim=0, topk=64).bytes > 0  # 0 and None where they mean one


@pytest.mark.parametrize("call, name", [
    (lambda: roofline.mla_decode_model(0, 4096), "batch"),
    (lambda: roofline.mla_decode_model(1, 4096.0), "seqlen"),
    (lambda: roofline.mla_decode_model(1, 4096, topk=0), "topk"),
    (lambda: roofline.gqa_decode_model(1, 4096, num_groups=True), "num_groups"),
    (lambda: roofline.gqa_decode_model(1, 4096, rope_dim=-64), "rope_dim"),
    (lambda: roofline.gdn_chunk_fwd_model(1, -2048, 16, 32), "T"),
    (lambda: roofline.gdn_chunk_bwd_model(1, 2048, 16, "32"), "HV"),
    (lambda: roofline.gdn_decode_model(1, 32, 16, s=0), "s"),
    (lambda: roofline.mla_sparse_prefill_model(4, 4096, None), "topk"),
    (lambda: roofline.paper_tokens_per_s("h200", "absorb", L=0), "L"),
])
def test_roofline_models_refuse_sizes_that_are_not_counts(call, name):
    """A model's size is a count: negative, zero, float, bool or string sizes are refused by name, not turned
    into negative FLOPs or a division by zero."""
    with pytest.raises(ValueError, match=f"^{name}: expected an int"):
        call()


def test_roofline_cli_prints_aligned_tables_with_units_and_the_path_choice():
    out = subprocess.run([sys.executable, "-m", "gqla_triton.roofline"], capture_output=True, text=True,
                         check=True).stdout
    for name in ("G1", "M1", "Q4", "SQ1", "h20", "absorb", "grouped", "TFLOP/s", "TB/s", "h200 us", "roofline pick"):
        assert name in out
    blocks = [b for b in out.split("\n\n") if "\n---" in b or "\n-" in b]
    assert len(blocks) >= 4
    for block in blocks:  # every column starts at the same offset on each line of a table
        lines = block.splitlines()
        rule = next(i for i, line in enumerate(lines) if set(line) <= {"-", " "} and "-" in line)
        starts = [i for i, c in enumerate(lines[rule]) if c == "-" and (i == 0 or lines[rule][i - 1] == " ")]
        for line in lines[rule + 1:]:
            assert len(line) <= len(lines[rule]) + 1, line
            for s in starts[1:]:
                assert line[s - 2:s] == "  " or line[s - 1] == " ", (line, s)


def test_choose_decode_path_follows_the_roofline():
    shape = dict(num_heads=128, num_groups=8, head_dim=128, rope_dim=64, kv_rank=512)
    for gpu in ("h100", "h200"):
        c = decode_path.choose_decode_path(shape, 1, gpu, batch=128, seqlen=4096, kernel_efficiency=False)
        assert c.path == "absorb" and c.absorb_s < c.grouped_s
    c = decode_path.choose_decode_path(shape, 2, "h20", batch=128, seqlen=4096)
    assert c.path == "grouped" and c.grouped_s < c.absorb_s
    assert decode_path.choose_decode_path(shape, 1, "h20", override="absorb").path == "absorb"
    with pytest.raises(ValueError, match="override"):
        decode_path.choose_decode_path(shape, 1, "h20", override="fast")
    for bad in (3, True, ["absorb"]):
        with pytest.raises(TypeError, match="^override: expected None or one of"):
            decode_path.choose_decode_path(shape, 1, "h20", override=bad)
    with pytest.raises(ValueError, match="^device_info: unknown GPU 'b300'"):
        decode_path.choose_decode_path(shape, 1, "b300")
    # an unknown GPU is named as the argument that held it
    with pytest.raises(ValueError, match="^gpu: unknown GPU 'b300'"):
        GQLAttention(64, 8, 4, 16, 8, 32, device="meta").choose_path(gpu="b300")
    with pytest.raises(ValueError, match="^gpu: unknown GPU 'b300'"):
        roofline.paper_tokens_per_s("b300", "absorb")


def test_interpreter_tables_pin_exactly_one_config_per_op():
    interp = json.loads((CONFIGS / "interpreter.json").read_text())
    for op, entries in interp.items():
        assert len(entries) == 1 and entries[0]["match"] == {}, f"{op}: interpreter must see one config"
    for name in ("h200.json", "default.json"):
        table = json.loads((CONFIGS / name).read_text())
        assert set(interp) <= set(table), f"{name} lacks ops {set(interp) - set(table)}"
        for op, entries in table.items():  # every table ends with a catch-all entry
            assert entries[-1]["match"] == {}, f"{name}:{op} needs a default entry last"


def test_select_config_returns_the_typed_schema(config_override):
    from gqla_triton.ops.gdn.config import ChunkConfig

    cfg = dispatch.select_config("gdn_chunk", {"K": 128, "V": 128})
    assert isinstance(cfg, ChunkConfig)
    before = dispatch.select_config("combine", {"D": 64})
    with config_override({"combine": {"num_warps": 2 if before.num_warps != 2 else 1}}):
        assert dispatch.select_config("combine", {"D": 64}).num_warps != before.num_warps
    assert dispatch.select_config("combine", {"D": 64}) == before  # restored on exit
    with pytest.raises(ValueError, match="unknown config op 'no_such_op'"):
        dispatch.select_config("no_such_op")
    with pytest.raises(TypeError, match="^op: expected a config op name, one of .*got list \\['x'\\]"):
        dispatch.select_config(["x"])
    with pytest.raises(ValueError, match="match key 'G' expects int, got \\[1\\]"):
        dispatch.select_config("gqa_decode", {"G": [1]})


def test_first_matching_entry_wins():
    table = dispatch.parse_table({"combine": [{"match": {"D": 64}, "config": {"elems": 32}},
                                              {"match": {}, "config": {"elems": 64, "num_warps": 2}}]}, where="t")
    assert dispatch._match(table, "combine", {"D": 64}).elems == 32
    got = dispatch._match(table, "combine", {"D": 128}).as_dict()
    assert got == {**dispatch.schema("combine")().as_dict(), "elems": 64, "num_warps": 2}
    assert dispatch._match(table, "gdn_chunk", {}) is None


@pytest.mark.parametrize("raw, message", [
    ({"gdn_chunk": [{"match": {}, "config": {"grad_ealry": True}}]}, "unknown field.*'grad_ealry'"),
    ({"gdn_chunk": [{"match": {"k": 128}, "config": {}}]}, "unknown match key 'k'"),
    ({"gdn_chunk": [{"match": {"K": "128"}, "config": {}}]}, "match key 'K' expects int"),
    ({"gdn_chunk": [{"match": {}, "config": {"wy_bk": 48}}]}, "'wy_bk' must be one of"),
    ({"gdn_chunk": [{"match": {}, "config": {"grad_early": 1}}]}, "'grad_early' expects bool"),
    ({"mla_decode": [{"match": {}, "config": {"impl": "ws"}}]}, "'impl' expects 'triton' | 'gluon'"),
    ({"mla_decode": [{"match": {}, "config": {"BLOCK_N": 64}}]}, "unknown field.*'BLOCK_N'"),
    ({"gqa_decode": [{"config": {"num_warps": 3}}]}, "'num_warps' must be"),
    ({"decode_path": [{"match": {}, "config": {"absorb_efficiency": 1.5}}]}, "'absorb_efficiency' must lie"),
    ({"gdn_chunks": [{"match": {}, "config": {}}]}, "unknown op 'gdn_chunks'"),
    ({"combine": [{"match": {}, "conifg": {}}]}, "an entry is"),
    ({"mla_decode": [{"match": {}, "config": {"split_cost": float("nan")}}]}, "'split_cost' must lie"),
    ({"gdn_decode": [{"match": {}, "config": {"num_stages": 0}}]}, "'num_stages' must lie"),
    ({"combine": [{"match": 5, "config": {}}]}, "'match' must be a JSON object"),
    ({"combine": [{"match": [["D", 64]], "config": {}}]}, "'match' must be a JSON object"),
    ({"combine": [{"match": {"D": -5}, "config": {}}]}, "match key 'D' expects an int >= 0"),
    ({"mla_decode": [{"match": {"impl": "gluonn"}, "config": {}}]}, "match key 'impl' expects 'triton' | 'gluon'"),
    ({"combine": [{"match": {}, "config": {}}, {"match": {"D": 64}, "config": {}}]}, "entry 1.*never reached"),
    ({"combine": [{"match": {"D": 64}, "config": {}}, {"match": {"D": 64}, "config": {}}]}, "never reached"),
])
def test_a_misspelled_or_mistyped_table_entry_is_a_value_error_naming_it(raw, message):
    with pytest.raises(ValueError, match=message):
        dispatch.parse_table(raw, where="configs/test.json")


def test_select_config_without_an_entry_is_a_value_error():
    """An op the table has no entry for: decode_path on a GPU of no table of its own (default.json holds none)."""
    a100 = dispatch.DeviceInfo("NVIDIA A100-SXM4-80GB", (8, 0), sm_count=108, smem_per_block=166912,
                               l2_bytes=40 << 20)
    with pytest.raises(ValueError, match="select_config: no config for op 'decode_path'"):
        dispatch.select_config("decode_path", {"s_q": 1}, info=a100)


def test_repeated_json_keys_are_refused(monkeypatch, tmp_path):
    """A JSON object naming a key twice (JSON keeps the last silently) is refused, in the environment override and
    in a table file alike."""
    monkeypatch.setenv("GQLA_TRITON_CONFIG", '{"combine": {"num_warps": 2, "num_warps": 8}}')
    dispatch._env_override.cache_clear()
    with pytest.raises(ValueError, match="GQLA_TRITON_CONFIG.*'num_warps' appears twice"):
        dispatch.select_config("combine", {"D": 64})
    monkeypatch.delenv("GQLA_TRITON_CONFIG")
    dispatch._env_override.cache_clear()
    path = tmp_path / "t.json"
    path.write_text('{"combine": [{"match": {}, "config": {}}], "combine": []}')
    with pytest.raises(ValueError, match="'combine' appears twice"):
        dispatch._read_table(path)


def test_env_override_is_checked_like_a_table(monkeypatch):
    monkeypatch.setenv("GQLA_TRITON_CONFIG", '{"combine": {"num_warp": 2}}')
    dispatch._env_override.cache_clear()
    with pytest.raises(ValueError, match="GQLA_TRITON_CONFIG.*|unknown field.*'num_warp'"):
        dispatch.select_config("combine", {"D": 64})
    monkeypatch.setenv("GQLA_TRITON_CONFIG", '{"combine": {"num_warps": 2}}')
    dispatch._env_override.cache_clear()
    assert dispatch.select_config("combine", {"D": 64}).num_warps == 2
    monkeypatch.delenv("GQLA_TRITON_CONFIG")
    dispatch._env_override.cache_clear()
    with pytest.raises(ValueError, match="unknown field.*'elemz'"):
        with dispatch.config_override({"combine": {"elemz": 4}}):
            pass
    with pytest.raises(ValueError, match="unknown match key 'DD'"):
        dispatch.select_config("combine", {"DD": 64})
    for raw in ('{"combine": {"num_warps": 2', "[1, 2]", "/no/such/config.json"):  # not JSON, not a file
        monkeypatch.setenv("GQLA_TRITON_CONFIG", raw)
        dispatch._env_override.cache_clear()
        with pytest.raises(ValueError, match="^GQLA_TRITON_CONFIG"):
            dispatch.select_config("combine", {"D": 64})
    monkeypatch.delenv("GQLA_TRITON_CONFIG")
    dispatch._env_override.cache_clear()


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.json")))
def test_every_shipped_table_validates(name):
    table = dispatch.parse_table(json.loads((CONFIGS / name).read_text()), where=name)
    assert set(table) <= set(dispatch.OPS)


def test_gpu_key():
    assert dispatch.gpu_key("NVIDIA H200") == "h200"
    assert dispatch.gpu_key("NVIDIA H100 80GB HBM3") == "h100"
    assert dispatch.gpu_key("NVIDIA H20") == "h20"
    assert dispatch.gpu_key("Some Future GPU") == "default"


def test_a_gpu_without_a_key_has_tables_of_its_own_name(tmp_path, monkeypatch):
    """A GPU with no model token (which runs ``default.json``) names its tuned tables after itself; its measured
    ``decode_path`` entry is what the path choice reads, beside the roofline of ``default``."""
    assert dispatch.gpu_table("NVIDIA H200") == "h200"
    assert dispatch.gpu_table("NVIDIA RTX A1000") == "nvidia-rtx-a1000"
    names = ("Default", " interpreter ", "!")
    assert [dispatch.gpu_table(n) for n in names] == ["gpu-default", "gpu-interpreter", "gpu"]
    monkeypatch.setenv("GQLA_TRITON_CONFIG_DIR", str(tmp_path))
    dispatch.reload_tables()
    info = dispatch.DeviceInfo("NVIDIA RTX A1000", (8, 6), sm_count=16, smem_per_block=101376, l2_bytes=2 << 20)
    assert (info.key, info.table) == ("default", "nvidia-rtx-a1000")
    shape = dict(num_heads=32, num_groups=8, head_dim=128, rope_dim=64, kv_rank=512)
    eff = {"match": {}, "config": {"absorb_efficiency": 0.5, "grouped_efficiency": 0.25}}
    try:
        with dispatch.table_swap(info.table, {"decode_path": [eff]}):
            assert "absorb 0.50, grouped 0.25" in decode_path.choose_decode_path(shape, 1, info).reason
        assert "measured" not in decode_path.choose_decode_path(shape, 1, info).reason
    finally:
        dispatch.reload_tables()


def test_h100_runs_the_h200_kernel_configs_but_not_its_measurements(tmp_path, monkeypatch):
    """A GPU of the H200's SM with no table of its own (H100, H800) gets the H200's kernel configs for every shape
    key, but not the H200's own measurements (``decode_path``); a GPU of another SM (H20) gets ``default.json``;
    a tuned table of the H100's own comes first (its rows before the shipped ones)."""
    monkeypatch.setenv("GQLA_TRITON_CONFIG_DIR", str(tmp_path))
    dispatch.reload_tables()
    try:
        h100, h200, default = (dispatch._load_table(k) for k in ("h100", "h200", "default"))
        assert dispatch.gpu_key("NVIDIA H800") == "h100"
        assert "decode_path" in h200 and "decode_path" not in h100
        assert {op: rows for op, rows in h200.items() if op != "decode_path"} == h100
        assert h100["gdn_chunk"] != default["gdn_chunk"]
        assert dispatch._load_table("h20") == default
        for key in ({}, {"K": 256}):
            assert dispatch.table_config("h100", "gdn_chunk", key) == dispatch.table_config("h200", "gdn_chunk", key)
        assert dispatch.table_config("h100", "decode_path", {"s_q": 1}) is None
        (tmp_path / "h100.json").write_text(json.dumps({"combine": [{"match": {}, "config": {"elems": 1024}}]}))
        dispatch.reload_tables()
        tuned = dispatch._load_table("h100")
        assert tuned["combine"][0][1].elems == 1024 and tuned["combine"][1:] == h100["combine"]
        assert {op: rows for op, rows in tuned.items() if op != "combine"} == {
            op: rows for op, rows in h100.items() if op != "combine"}  # the ops it leaves out: the H200's configs
    finally:
        dispatch.reload_tables()


def test_a_lookup_that_read_a_table_before_a_reload_keeps_no_stale_answer(tmp_path, monkeypatch):
    """A lookup that read the tuned table while another thread wrote a new one and called ``reload_tables`` (the
    tuner's write) leaves nothing of the old table cached: the next lookup reads the new one."""
    monkeypatch.setenv("GQLA_TRITON_CONFIG_DIR", str(tmp_path))
    user = tmp_path / "h100.json"

    def tuned(elems):
        user.write_text(json.dumps({"combine": [{"match": {}, "config": {"elems": elems}}]}))

    tuned(512)
    dispatch.reload_tables()
    read = dispatch._read_table
    raced = []

    def read_then_reload(path):
        table = read(path)
        if path == user and not raced:  # this lookup holds the old table when the other thread writes and reloads
            raced.append(path)
            tuned(2048)
            dispatch.reload_tables()
        return table

    try:
        with monkeypatch.context() as m:
            m.setattr(dispatch, "_read_table", read_then_reload)
            assert dispatch.table_config("h100", "combine", {}).elems == 512  # the answer of the table it read
        assert raced
        assert dispatch.table_config("h100", "combine", {}).elems == 2048
        assert dispatch._load_table("h100")["combine"][0][1].elems == 2048
    finally:
        dispatch.reload_tables()


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


def test_env_override_file_is_read_again_when_it_changes(monkeypatch, tmp_path):
    path = tmp_path / "cfg.json"
    path.write_text('{"combine": {"num_warps": 2}}')
    monkeypatch.setenv("GQLA_TRITON_CONFIG", str(path))
    assert dispatch.select_config("combine", {"D": 64}).num_warps == 2
    path.write_text('{"combine": {"num_warps": 8}}  ')  # another size: seen even within one mtime tick
    assert dispatch.select_config("combine", {"D": 64}).num_warps == 8
    path.write_text('{"combine": {"num_warp": 8}}   ')
    with pytest.raises(ValueError, match="GQLA_TRITON_CONFIG file .*num_warp"):
        dispatch.select_config("combine", {"D": 64})
    path.unlink()
    with pytest.raises(ValueError, match="^GQLA_TRITON_CONFIG file"):
        dispatch.select_config("combine", {"D": 64})


def test_choose_decode_path_scales_by_measured_kernel_efficiency(monkeypatch):
    shape = dict(num_heads=128, num_groups=8, head_dim=128, rope_dim=64, kv_rank=512)
    hw = decode_path.choose_decode_path(shape, 1, "h100", batch=128, seqlen=4096, kernel_efficiency=False)
    # no table for the H100: the pure roofline
    assert decode_path.choose_decode_path(shape, 1, "h100", batch=128, seqlen=4096) == hw
    monkeypatch.setenv("GQLA_TRITON_CONFIG", '{"decode_path": {"absorb_efficiency": 0.25, "grouped_efficiency": 0.8}}')
    dispatch._env_override.cache_clear()
    c = decode_path.choose_decode_path(shape, 1, "h100", batch=128, seqlen=4096)
    assert c.absorb_s == pytest.approx(hw.absorb_s / 0.25) and c.grouped_s == pytest.approx(hw.grouped_s / 0.8)
    assert c.path == ("absorb" if c.absorb_s <= c.grouped_s else "grouped") and "efficiency" in c.reason
    monkeypatch.setenv("GQLA_TRITON_CONFIG", '{"decode_path": {"absorb_efficiency": 0}}')
    dispatch._env_override.cache_clear()
    with pytest.raises(ValueError, match="efficienc"):
        decode_path.choose_decode_path(shape, 1, "h100")
    monkeypatch.delenv("GQLA_TRITON_CONFIG")
    dispatch._env_override.cache_clear()
    # the H200 table holds what our kernels reach there: both paths' steps measured at decode_path.POINTS for s_q 1
    # and 2 (bench/results/h200-gqla.json: absorb wins M1, grouped P1), one efficiency per path for other s_q
    h200 = decode_path.choose_decode_path(shape, 1, "h200", batch=128, seqlen=4096)
    assert h200.path == "absorb" and "measured point" in h200.reason
    assert decode_path.choose_decode_path(shape, 1, "h200", batch=1, seqlen=4096).path == "grouped"
    assert "efficienc" in decode_path.choose_decode_path(shape, 3, "h200", batch=128, seqlen=4096).reason


@given(a=st.integers(0, 1 << 40), b=st.integers(1, 1 << 20), n=st.integers(0, 1 << 40))
def test_host_integer_helpers_match_triton(a, b, n):
    """The launchers' plain-Python cdiv / next_pow2 agree with triton.cdiv / triton.next_power_of_2."""
    assert cdiv(a, b) == triton.cdiv(a, b)
    assert next_pow2(n) == triton.next_power_of_2(n)


def test_bf16_is_refused_under_the_interpreter():
    from gqla_triton.ops._common.validation import check_kernel_device

    if not dispatch.is_interpreter():
        return  # the GPU profile computes bf16 on the device
    import torch

    with pytest.raises(TypeError, match="bfloat16.*interpreter"):
        check_kernel_device(torch.device("cpu"), "the reference", torch.bfloat16)
    check_kernel_device(torch.device("cpu"), "the reference", torch.float16)


HISTORY = r"session [0-9]|\brun [0-9]+\b|device (call|time|budget)|budget"


def test_the_repository_speaks_of_the_product_only():
    """No tracked text narrates how the package was made (sessions, runs, device budgets)."""
    import re
    import subprocess

    root = Path(__file__).resolve().parent.parent
    pattern = re.compile(HISTORY, re.IGNORECASE)
    hits = []
    # git's files (tracked, and untracked ones it does not ignore); every file where there is no git checkout
    try:
        listed = subprocess.run(["git", "-C", str(root), "ls-files", "-co", "--exclude-standard"], capture_output=True,
                                text=True, check=True).stdout.splitlines()
        paths = [root / f for f in listed]
    except (OSError, subprocess.CalledProcessError):
        paths = list(root.rglob("*"))
    for path in paths:
        rel = path.relative_to(root)
        if not path.is_file() or any(p.startswith(".") or p == "__pycache__" or p.endswith(".egg-info")
                                     for p in rel.parts) or path == Path(__file__).resolve():
            continue
        if path.suffix not in (".py", ".md", ".json", ".toml", ".txt", ".sh", ""):
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        # the tuner's time limit (--budget-minutes) is a product option, not history
        hits += [f"{rel}:{i + 1}: {line.strip()[:100]}" for i, line in enumerate(text.splitlines())
                 if pattern.search(re.sub(r"budget[-_]minutes", "", line))]
    assert not hits, "\n".join(hits[:20])


def test_roofline_plots_are_drawn(tmp_path):
    """``python -m gqla_triton.roofline --plot DIR``: one PNG per GPU and the side-by-side figure, non-trivial."""
    out = subprocess.run([sys.executable, "-m", "gqla_triton.roofline", "--plot", str(tmp_path)], capture_output=True,
                         text=True, check=True).stdout
    names = sorted(p.name for p in tmp_path.glob("*.png"))
    assert names == ["roofline-h100.png", "roofline-h20.png", "roofline-h200.png", "roofline-paths.png"], names
    for p in tmp_path.glob("*.png"):
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 20_000, p
        assert f"wrote {p}" in out


def test_bench_results_plot_without_a_gpu(tmp_path):
    """``python -m bench.run --plot DIR`` draws every committed result file (no GPU needed)."""
    root = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-m", "bench.run", "--plot", str(tmp_path)], cwd=root, env=env, check=True,
                   capture_output=True, text=True)
    want = sorted(p.stem for p in (root / "bench" / "results").glob("h200-*.json"))
    assert sorted(p.stem for p in tmp_path.glob("*.png")) == want


def test_bench_run_refuses_a_workload_no_chosen_op_has(monkeypatch):
    """``python -m bench.run --workload``: a name that none of the chosen ops has (a typo, or a workload of another
    op) is refused by name before any GPU work, instead of a run that times nothing; each op takes its own names."""
    from bench.run import main

    for argv, bad in ((["--op", "gdn", "--workload", "G1,G6"], "G6"), (["--op", "mla", "--workload", "Q1"], "Q1"),
                      (["--op", "gdn,mla", "--workload", "G1,M1,SQ1"], "SQ1")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert "unknown workload" in str(e.value) and repr(bad) in str(e.value), (argv, e.value)
    # names every chosen op lacks are the only ones refused: one op's names may sit beside another's (the run then
    # stops at its GPU check, made to fail here so that no benchmark starts on a GPU machine)
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        main(["--op", "gdn,mla", "--workload", "G1,M1,B1-S4096"])
    assert "needs a CUDA GPU" in str(e.value), e.value


def test_bench_tp_refuses_unknown_workloads(monkeypatch):
    """``python -m bench.tp`` (spawning its ranks or under torchrun): a workload name it lacks, or an argument past
    the one comma list, is refused by name before any GPU or process-group work, instead of a run that times
    nothing."""
    import torch
    import torch.distributed as dist

    from bench import tp

    def no_gpu_work(*args, **kwargs):
        raise AssertionError("GPU or process-group work before the workload names were checked")

    monkeypatch.setattr(torch.cuda, "set_device", no_gpu_work)
    monkeypatch.setattr(dist, "init_process_group", no_gpu_work)
    for torchrun in (False, True):
        if torchrun:
            monkeypatch.setenv("RANK", "0")
            monkeypatch.setenv("WORLD_SIZE", "2")
        for argv, bad in ((["T4"], "'T4'"), (["T1,t2"], "'t2'"), (["T1", "T2"], "'T2'")):
            with pytest.raises(SystemExit) as e:
                tp.main(argv)
            assert "bench.tp: unknown" in str(e.value) and bad in str(e.value), (torchrun, argv, e.value)


def test_split_planner_follows_its_cost():
    """plan_splits: the count stays in [1, cap]; a dearer partial tile (split_cost) never gives more splits, and an
    even number of waves gives none; the waves rule fills its programs per SM; mla_decode's config carries the
    cost into its plan."""
    from gqla_triton.ops._common.split import MIN_TILES_PER_SPLIT, plan_splits
    from gqla_triton.ops.mla.config import MLADecodeConfig

    for programs, keys in ((2, 4096), (8, 32768), (64, 8192), (264, 4096)):
        counts = [plan_splits(programs, keys, 132, block_n=64, split_cost=c) for c in (0.0, 0.02, 0.1, 0.5, 5.0)]
        cap = max(1, min(64, keys // (MIN_TILES_PER_SPLIT * 64)))
        assert all(1 <= n <= cap for n in counts) and counts == sorted(counts, reverse=True), counts
    assert plan_splits(264, 4096, 132, block_n=64) == 1
    # the waves rule: the most splits that keep programs within waves per SM, from 1 to the cap
    for programs, keys, w in ((8, 32768, 2), (8, 4096, 2), (64, 8192, 2), (128, 2048, 2), (256, 4096, 2),
                              (1024, 4096, 6), (8, 32768, 6)):
        n = plan_splits(programs, keys, 132, block_n=64, waves=w)
        cap = max(1, min(64, keys // (MIN_TILES_PER_SPLIT * 64)))
        assert 1 <= n <= cap and (n == 1 or programs * n <= w * 132), (programs, keys, w, n)
        assert n == cap or programs * (n + 1) > w * 132, (programs, keys, w, n)
    assert plan_splits(2, 4096, 132, block_n=64, split_cost=5.0) < plan_splits(2, 4096, 132, block_n=64)
    with pytest.raises(ValueError, match="split_cost"):
        MLADecodeConfig(split_cost=-1.0)


def test_choose_decode_path_prices_each_path_by_the_nearest_measured_point(monkeypatch):
    """With measured points the choice follows the measured step of the nearest point (log batch, log length),
    whatever the roofline says; at a measured point it is that point's faster path."""
    shape = decode_path.REF_SHAPE
    pts = [[1, 4096, 0.05, 0.03], [128, 4096, 0.40, 0.50]]  # grouped wins at B1, absorb at B128
    monkeypatch.setenv("GQLA_TRITON_CONFIG", json.dumps({"decode_path": {"points": pts}}))
    dispatch._env_override.cache_clear()
    try:
        for gpu in ("h100", "h200", "h20"):
            small = decode_path.choose_decode_path(shape, 1, gpu, batch=1, seqlen=4096)
            big = decode_path.choose_decode_path(shape, 1, gpu, batch=128, seqlen=4096)
            assert small.path == "grouped" and big.path == "absorb", gpu
            assert small.absorb_s == pytest.approx(0.05e-3) and small.grouped_s == pytest.approx(0.03e-3)
            assert "nearest measured point (batch 1, seqlen 4096" in small.reason
            near = decode_path.choose_decode_path(shape, 1, gpu, batch=2, seqlen=5000)  # prices from B1 S4096
            assert near.path == "grouped" and "batch 1," in near.reason
        monkeypatch.setenv("GQLA_TRITON_CONFIG", json.dumps({"decode_path": {"points": [[1, 4096, 0.05]]}}))
        dispatch._env_override.cache_clear()
        with pytest.raises(ValueError, match="points"):
            decode_path.choose_decode_path(shape, 1, "h100")
        monkeypatch.setenv("GQLA_TRITON_CONFIG", json.dumps({"decode_path": {"points": [[0, 4096, 0.05, 0.1]]}}))
        dispatch._env_override.cache_clear()
        with pytest.raises(ValueError, match="points"):
            decode_path.choose_decode_path(shape, 1, "h100")
    finally:
        monkeypatch.delenv("GQLA_TRITON_CONFIG")
        dispatch._env_override.cache_clear()


@pytest.mark.parametrize("kw, err, msg", [
    (dict(batch=0), ValueError, "batch: expected a positive int"), (dict(batch=True), TypeError, "batch"),
    (dict(batch=2.5), TypeError, "batch"), (dict(seqlen=-1), ValueError, "seqlen"),
    (dict(seqlen=float("inf")), TypeError, "seqlen"), (dict(s_q=0), ValueError, "s_q"),
    (dict(s_q=2.0), TypeError, "s_q"), (dict(kernel_efficiency="yes"), TypeError, "kernel_efficiency"),
    (dict(override=3), TypeError, "override"), (dict(override=False), TypeError, "override"),
    (dict(override=""), ValueError, "override"), (dict(layer_shape=None), TypeError, "layer_shape"),
    (dict(layer_shape={}), ValueError, "layer_shape: missing"),
    (dict(layer_shape=dict(decode_path.REF_SHAPE, num_groups=3)), ValueError, "must divide"),
    (dict(layer_shape=dict(decode_path.REF_SHAPE, kv_rank=0)), ValueError, "kv_rank"),
    (dict(layer_shape=dict(decode_path.REF_SHAPE, head_dim="128")), TypeError, "head_dim"),
    (dict(layer_shape=dict(decode_path.REF_SHAPE, v_head_dims=512)), ValueError, "unknown keys"),
    (dict(layer_shape=dict(decode_path.REF_SHAPE, rope_dim=0.0)), TypeError, "rope_dim"),
    (dict(device_info=5), TypeError, "device_info"),
])
def test_choose_decode_path_refuses_bad_arguments(kw, err, msg):
    """Every argument is checked (a batch of 0 or a negative length has no decode step to price)."""
    args = dict(layer_shape=decode_path.REF_SHAPE, s_q=1, device_info="h200", batch=4, seqlen=1024)
    args.update(kw)
    with pytest.raises(err, match=msg):
        decode_path.choose_decode_path(args.pop("layer_shape"), args.pop("s_q"), args.pop("device_info"), **args)
    assert decode_path.choose_decode_path(dict(decode_path.REF_SHAPE, rope_dim=0), 1, "h200").path in decode_path.PATHS


def test_an_unreadable_user_table_is_a_value_error_naming_it(tmp_path, monkeypatch):
    (tmp_path / "h100.json").write_text('{"combine": [')
    monkeypatch.setenv("GQLA_TRITON_CONFIG_DIR", str(tmp_path))
    dispatch.reload_tables()
    try:
        with pytest.raises(ValueError, match="h100.json: not a readable JSON config table"):
            dispatch._load_table("h100")
    finally:
        monkeypatch.delenv("GQLA_TRITON_CONFIG_DIR")
        dispatch.reload_tables()


def test_decode_path_measurement_helpers_refuse_bad_arguments():
    """``measure_points`` names its unknown points before timing anything; ``step_inputs`` checks its sizes
    before allocating."""
    never = lambda fn: pytest.fail("timed before the names were checked")  # noqa: E731
    for names, err in ((["X"], ValueError), ("M1", TypeError), (["M1", 3], TypeError)):
        with pytest.raises(err, match="names: expected a list of the points"):
            decode_path.measure_points(never, names)
    for kw, name, err in (({"batch": -1}, "batch", ValueError), ({"seqlen": 0}, "seqlen", ValueError),
                          ({"s_q": 1.0}, "s_q", TypeError)):
        args = {"batch": 1, "seqlen": 64, "s_q": 1, **kw}
        with pytest.raises(err, match=f"^{name}: expected a positive int"):
            decode_path.step_inputs(**args, device="cpu")
    with pytest.raises(TypeError, match="seed"):
        decode_path.step_inputs(1, 64, 1, seed=True, device="cpu")


def test_the_interpreter_shortcut_changes_no_result():
    """The ci profile's interpreter skips repatching Triton's builtins on each helper call (``tests/interp.py``):
    a GDN forward + backward and an MLA decode, whose kernels call helpers from several modules, give the same
    bits with the interpreter's own patching, and the shortcut did skip work."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the CPU interpreter's patching: the ci profile only")
    import interp
    import torch

    import gqla_triton as gq

    g = torch.Generator().manual_seed(3)
    q, k = (torch.nn.functional.normalize(torch.randn(1, 80, 1, 16, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(1, 80, 2, 16, generator=g)
    gate = torch.nn.functional.logsigmoid(torch.randn(1, 80, 2, generator=g)) / 8
    beta = torch.sigmoid(torch.randn(1, 80, 2, generator=g))
    mq = torch.randn(2, 1, 4, 48, generator=g)
    kv = torch.randn(4, 16, 1, 48, generator=g)
    table = torch.arange(4, dtype=torch.int32).reshape(2, 2)
    lens = torch.tensor([20, 32], dtype=torch.int32)

    def run():
        xs = [t.clone().requires_grad_() for t in (q, k, v, gate, beta)]
        o, ht = gq.chunk_gated_delta_rule(*xs, output_final_state=True)
        torch.autograd.backward([o, ht], [torch.ones_like(o), torch.ones_like(ht)])
        return [o, ht, *(x.grad for x in xs), *gq.mla_decode(mq, kv, table, lens, head_dim_v=32, num_splits=2)]

    before = interp.skipped
    fast = run()
    assert interp.skipped > before
    with interp.original_patching():
        slow = run()
    assert all(torch.equal(a, b) for a, b in zip(fast, slow, strict=True))



def test_test_shards_cover_the_suite_once(monkeypatch):
    """``GQLA_TEST_SHARD=i/n`` (tests/conftest.py) splits the collected tests into n disjoint parts of sizes within
    one of each other, whatever the collection order, whose union is the whole; a malformed value is a usage
    error."""
    import types

    import conftest

    names = [f"tests/test_{k % 7}.py::test_{k}[{k % 3}]" for k in range(50)]

    def part(spec, order):
        monkeypatch.setenv("GQLA_TEST_SHARD", spec)
        items = [types.SimpleNamespace(nodeid=names[k]) for k in order]
        dropped = []
        hook = types.SimpleNamespace(pytest_deselected=lambda items: dropped.extend(items))
        config = types.SimpleNamespace(hook=hook)
        conftest.pytest_collection_modifyitems(config, items)
        assert len(items) + len(dropped) == len(order)
        return [it.nodeid for it in items]

    forward, backward = list(range(50)), list(range(49, -1, -1))
    parts = [part(f"{i}/3", forward) for i in range(3)]
    assert sorted(sum(parts, [])) == sorted(names) and all(len(p) in (16, 17) for p in parts)
    assert [set(part(f"{i}/3", backward)) for i in range(3)] == [set(p) for p in parts]  # the same on every worker
    for bad in ("3/3", "1", "a/b", "-1/2", "0/0"):
        with pytest.raises(pytest.UsageError, match="GQLA_TEST_SHARD"):
            part(bad, forward)


def test_a_config_past_shared_memory_is_a_value_error_naming_it():
    """Triton's OutOfResources (a launch config past the GPU's shared memory; raised before the kernel runs) from a
    launcher of a config without a shared-memory model of its own is a ValueError naming that config."""
    from triton.runtime.errors import OutOfResources

    from gqla_triton.ops._common.config import names_config

    @names_config("gdn_chunk")
    def launch():
        raise OutOfResources(417044, 232448, "shared memory")

    with pytest.raises(ValueError, match="gdn_chunk config: a kernel needs 417044 of shared memory, more than"):
        launch()



def test_override_blocks_that_end_out_of_order_remove_their_own_entry():
    """A ``config_override`` or ``table_swap`` block removes its own entry when it ends, also when another block
    opened after it is still open (two generators or tasks each holding one); nested blocks restore as they
    open."""
    base = dispatch.select_config("gdn_decode").bv
    a, b = dispatch.config_override({"gdn_decode": {"bv": 16}}), dispatch.config_override({"gdn_decode": {"bv": 128}})
    a.__enter__()
    b.__enter__()
    a.__exit__(None, None, None)
    assert dispatch.select_config("gdn_decode").bv == 128
    b.__exit__(None, None, None)
    assert dispatch.select_config("gdn_decode").bv == base

    def holder(bv):
        with dispatch.config_override({"gdn_decode": {"bv": bv}}):
            yield

    g1, g2 = holder(16), holder(128)
    next(g1)
    next(g2)
    g1.close()
    assert dispatch.select_config("gdn_decode").bv == 128
    g2.close()
    assert dispatch.select_config("gdn_decode").bv == base
    with dispatch.config_override({"gdn_decode": {"bv": 16}}):
        with dispatch.config_override({"gdn_decode": {"bv": 128}}):
            assert dispatch.select_config("gdn_decode").bv == 128
        assert dispatch.select_config("gdn_decode").bv == 16
    assert dispatch.select_config("gdn_decode").bv == base

    key = dispatch.device_info().key
    combine = lambda elems: {"combine": [{"match": {}, "config": {"elems": elems}}]}  # noqa: E731
    before = dispatch.select_config("combine", {"D": 32})
    s1, s2 = dispatch.table_swap(key, combine(64)), dispatch.table_swap(key, combine(1024))
    s1.__enter__()
    s2.__enter__()
    s1.__exit__(None, None, None)
    assert dispatch.select_config("combine", {"D": 32}).elems == 1024
    s2.__exit__(None, None, None)
    assert dispatch.select_config("combine", {"D": 32}) == before
    with dispatch.table_swap(key, combine(64)):
        with dispatch.table_swap(key, combine(1024)):
            assert dispatch.select_config("combine", {"D": 32}).elems == 1024
        assert dispatch.select_config("combine", {"D": 32}).elems == 64
    assert dispatch.select_config("combine", {"D": 32}) == before


@pytest.mark.parametrize("name, key", [
    ("NVIDIA H200", "h200"), ("NVIDIA H200 NVL", "h200"), ("NVIDIA H100 80GB HBM3", "h100"),
    ("NVIDIA H100 PCIe", "h100"), ("NVIDIA H100 NVL", "h100"), ("NVIDIA H800", "h100"), ("NVIDIA H800 PCIe", "h100"),
    ("NVIDIA GH200 480GB", "h100"), ("NVIDIA GH200 144G HBM3e", "h100"), ("NVIDIA H20", "h20"),
    ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA A100-SXM4-40GB", "a100"), ("NVIDIA A100-PCIE-40GB", "a100"),
    ("NVIDIA A100 80GB PCIe", "a100"), ("NVIDIA A800-SXM4-80GB", "a100"), ("NVIDIA A800 80GB PCIe", "a100"),
    ("NVIDIA L40S", "l40s"), ("NVIDIA L40", "default"), ("NVIDIA RTX A1000", "default"),
    ("NVIDIA RTX A1000 6GB Laptop GPU", "default"), ("NVIDIA A10", "default"), ("NVIDIA RTX A2000 12GB", "default"),
    ("NVIDIA GeForce RTX 4090", "default"), ("NVIDIA B200", "default"), ("NVIDIA GB200", "default")])
def test_gpu_key_matches_driver_names_by_model_token(name, key):
    """A driver name's model is a whole token: an RTX A1000 is no A100, a GH200 (an H100-class die) no H200."""
    assert dispatch.gpu_key(name) == key


def test_roofline_plot_folder_that_cannot_be_made_is_refused_before_any_output(tmp_path):
    """``--plot DIR`` whose folder cannot be made or written is an argparse error (rc 2, no traceback) before any
    table is printed."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for bad in (blocker / "sub", "/proc/gqla-triton-nope"):
        res = subprocess.run([sys.executable, "-m", "gqla_triton.roofline", "--plot", str(bad)], capture_output=True,
                             text=True)
        assert res.returncode == 2 and res.stdout == "", (bad, res.stdout[-300:], res.stderr[-300:])
        assert "--plot: " in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert not (blocker / "sub").exists()


def test_env_override_json_that_is_not_an_object_is_named_as_such(monkeypatch, tmp_path):
    """``GQLA_TRITON_CONFIG`` text that parses as JSON but is not an object is refused as such (not as a missing
    file); a file named by any path (one starting with ``{`` too) is read."""
    try:
        for raw in ("[]", "null", "1", '"x"', " [1, 2] "):
            monkeypatch.setenv("GQLA_TRITON_CONFIG", raw)
            with pytest.raises(ValueError, match="^GQLA_TRITON_CONFIG: expected a JSON object") as e:
                dispatch.select_config("combine", {"D": 64})
            assert "FileNotFoundError" not in str(e.value)
        monkeypatch.setenv("GQLA_TRITON_CONFIG", '{"combine": {"num_warps": 2')
        with pytest.raises(ValueError, match="^GQLA_TRITON_CONFIG: expected a JSON object.*JSONDecodeError"):
            dispatch.select_config("combine", {"D": 64})
        odd = tmp_path / "{cfg}.json"
        odd.write_text('{"combine": {"num_warps": 2}}')
        monkeypatch.setenv("GQLA_TRITON_CONFIG", str(odd))
        assert dispatch.select_config("combine", {"D": 64}).num_warps == 2
        monkeypatch.chdir(tmp_path)
        (tmp_path / "{c}").write_text('{"combine": {"num_warps": 8}}')
        monkeypatch.setenv("GQLA_TRITON_CONFIG", "{c}")
        assert dispatch.select_config("combine", {"D": 64}).num_warps == 8
    finally:
        monkeypatch.delenv("GQLA_TRITON_CONFIG")
        dispatch._env_override.cache_clear()


def test_unknown_config_fields_of_mixed_name_types_are_named():
    """Unknown field names that are not all strings (an in-process override or table) are a ``ValueError`` naming
    them, not a ``TypeError`` from sorting them."""
    with pytest.raises(ValueError, match=r"unknown field\(s\) \[1, 'zz'\]"):
        with dispatch.config_override({"gqa_decode": {1: 2, "zz": 3}}):
            pass
    with pytest.raises(ValueError, match=r"unknown field\(s\) \[1, 'zz'\]"):
        with dispatch.table_swap("interpreter", {"gqa_decode": [{"match": {}, "config": {"zz": 1, 1: 2}}]}):
            pass


def test_decode_path_points_take_whole_sizes_the_roofline_models():
    """A measured point's batch and seqlen are whole numbers in the roofline's range ``[1, 2**40]``: a point past it
    or between integers is refused as the config's ``points`` when the config is read, not met later as the
    caller's ``batch`` or silently truncated."""
    for row in ([1.5, 4096, 0.05, 0.1], [1, 4096.5, 0.05, 0.1], [2**41, 4096, 0.05, 0.1], [1, 1e300, 0.05, 0.1]):
        with pytest.raises(ValueError, match="decode_path config: 'points'"):
            with dispatch.config_override({"decode_path": {"points": [row]}}):
                pass
    with dispatch.config_override({"decode_path": {"points": [[2.0, 2**40, 0.05, 0.1]]}}):
        choice = decode_path.choose_decode_path(decode_path.REF_SHAPE, 1, "h200")
        assert "batch 2, seqlen 1099511627776" in choice.reason


def test_a_user_table_that_cannot_be_read_is_named_never_skipped(tmp_path, monkeypatch):
    """A user table that is a link to nothing, a link loop or a folder, and a ``GQLA_TRITON_CONFIG_DIR`` that names
    a file, are each a ValueError naming the path at the first lookup, not a silent run on the shipped configs."""
    monkeypatch.setenv("GQLA_TRITON_CONFIG_DIR", str(tmp_path))
    user = tmp_path / "h100.json"
    cases = [(lambda: user.symlink_to(tmp_path / "gone.json"), "h100.json: not a readable JSON config table"),
             (lambda: user.symlink_to(user), "h100.json: not a readable JSON config table"),
             (lambda: user.mkdir(), "h100.json: not a readable JSON config table")]
    try:
        for make, msg in cases:
            make()
            dispatch.reload_tables()
            with pytest.raises(ValueError, match=msg):
                dispatch.table_config("h100", "combine", {"D": 64})
            user.rmdir() if user.is_dir() and not user.is_symlink() else user.unlink()
        user.write_text(json.dumps({"combine": [{"match": {}, "config": {"elems": 64}}]}))
        monkeypatch.setenv("GQLA_TRITON_CONFIG_DIR", str(user))  # the table itself, not its folder
        dispatch.reload_tables()
        with pytest.raises(ValueError, match="GQLA_TRITON_CONFIG_DIR .*h100.json is not a directory"):
            dispatch.table_config("h100", "combine", {"D": 64})
        monkeypatch.setenv("GQLA_TRITON_CONFIG_DIR", str(tmp_path))
        dispatch.reload_tables()
        assert dispatch.table_config("h100", "combine", {"D": 64}).elems == 64
    finally:
        monkeypatch.delenv("GQLA_TRITON_CONFIG_DIR")
        dispatch.reload_tables()


def test_env_override_file_renamed_over_within_one_time_tick_is_read_again(monkeypatch, tmp_path):
    """A file renamed over the ``GQLA_TRITON_CONFIG`` file (an editor's save, an atomic writer) with the same size
    and modification time (a coarse file-system clock) is read again at the next lookup."""
    path = tmp_path / "cfg.json"
    path.write_text('{"combine": {"num_warps": 2}}')
    monkeypatch.setenv("GQLA_TRITON_CONFIG", str(path))
    assert dispatch.select_config("combine", {"D": 64}).num_warps == 2
    st = path.stat()
    new = tmp_path / "cfg.json.new"
    new.write_text('{"combine": {"num_warps": 8}}')
    os.utime(new, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(new, path)
    assert dispatch.select_config("combine", {"D": 64}).num_warps == 8
