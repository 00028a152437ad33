"""What each op launches: its Triton kernels, in order, and no other device work (no casts, copies, fills or
reductions by torch between them) on the paths whose host cost paces serving: a chunked-prefill forward is two
launches (``wy``, ``sout``), a training step four forward and four backward, a decode step one, an MLA decode one
(two with split-KV: the combine; sparse: the index translation first). Launches are recorded, not run (outputs are
not looked at); torch's ops are recorded by a dispatch mode, allocations and views excepted. Inputs are
contiguous, as a serving engine passes them."""

import ast
import importlib
import pathlib

import pytest
import torch
from harness import P, randn
from torch.utils._python_dispatch import TorchDispatchMode
from triton.runtime.jit import KernelInterface

import gqla_triton as gq
import gqla_triton.ops.gdn.plan as plan_mod
from gqla_triton.dispatch import config_override

# torch ops that launch nothing: allocations, views, metadata
_NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "view", "_unsafe_view",
              "select", "slice", "as_strided", "detach", "alias", "unsqueeze", "squeeze", "expand", "t", "transpose",
              "permute", "_reshape_alias", "unbind", "split", "lift_fresh"}


class _Record(TorchDispatchMode):
    """Inside: Triton launches are recorded by kernel name and not run; torch's ops that launch a kernel are
    recorded by name."""

    def __init__(self, monkeypatch):
        super().__init__()
        self.kernels, self.torch_ops = [], []
        monkeypatch.setattr(KernelInterface, "__getitem__",
                            lambda kern, grid: lambda *a, **k: self.kernels.append(kern.fn.__name__))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in _NO_KERNEL:
            self.torch_ops.append(name)
        return func(*args, **(kwargs or {}))


def _gdn_inputs(B, T, H, HV, D, N, grad=False):
    dt = P.dtypes[0]
    xs = [randn((B, T, H, D), 1, dtype=dt), randn((B, T, H, D), 2, dtype=dt), randn((B, T, HV, D), 3, dtype=dt),
          -randn((B, T, HV), 4).abs(), randn((B, T, HV), 5).sigmoid().to(dt), randn((N, HV, D, D), 6)]
    return [x.requires_grad_(grad) for x in xs]


# the fused forward's fields of the H200 table (default.json keeps the separate kernels: ``sout_chunks`` 0)
FUSED = {"sout_chunks": 32, "sout_waves": 8}


def test_chunked_prefill_forward_is_two_launches(monkeypatch):
    """A forward without gradient from initial states (a chunked-prefill chunk), with the table's fused forward on:
    ``wy`` then ``sout``, nothing else (off: ``wy``, ``wu``, ``state``, ``output``); varlen over a device-built plan
    adds the plan kernel before them (``wy`` zeroes the output rows of tokens outside every sequence, which a device
    plan cannot rule out)."""
    with config_override({"gdn_chunk": FUSED}):
        xs = _gdn_inputs(1, 200, 2, 4, 32, 1)
        with _Record(monkeypatch) as rec:
            gq.chunk_gated_delta_rule(*xs[:5], initial_state=xs[5], output_final_state=True)
        assert rec.kernels == ["gdn_wy_fwd_kernel", "gdn_state_out_kernel"] and rec.torch_ops == []
        with config_override({"gdn_chunk": {"sout_chunks": 0}}), _Record(monkeypatch) as rec:
            gq.chunk_gated_delta_rule(*xs[:5], initial_state=xs[5], output_final_state=True)
        assert rec.kernels == ["gdn_wy_fwd_kernel", "gdn_wu_fwd_kernel", "gdn_state_fwd_kernel",
                               "gdn_output_fwd_kernel"] and rec.torch_ops == []
        xs = _gdn_inputs(1, 200, 2, 4, 32, 3)
        # planned from host values: wy zeroes the padding rows where its chunk programs are at least T's 64-token
        # blocks (5 chunks, 4 blocks), a launch of its own does where they are fewer (3 chunks; 1 chunk)
        for bounds, pad_launch in (([5, 70, 75, 200], False), ([0, 64, 64, 190], True), ([0, 1, 1, 1], True)):
            cu = torch.tensor(bounds, dtype=torch.int32, device=P.device)
            with _Record(monkeypatch) as rec:
                gq.chunk_gated_delta_rule(*xs[:5], initial_state=xs[5], output_final_state=True, cu_seqlens=cu,
                                          cu_seqlens_cpu=bounds)
            assert rec.kernels == ["gdn_wy_fwd_kernel", *(["gdn_pad_zero_kernel"] if pad_launch else []),
                                   "gdn_state_out_kernel"], bounds
        monkeypatch.setattr(plan_mod, "plans_on_device", lambda cu: True)
        for bounds in ([0, 64, 64, 200], [3, 64, 70, 190]):
            cu = torch.tensor(bounds, dtype=torch.int32, device=P.device)
            with _Record(monkeypatch) as rec:
                gq.chunk_gated_delta_rule(*xs[:5], initial_state=xs[5], output_final_state=True, cu_seqlens=cu)
            assert rec.kernels == ["gdn_plan_kernel", "gdn_wy_fwd_kernel", "gdn_state_out_kernel"], bounds
            assert rec.torch_ops == [], bounds


def test_split_sequence_forward_forms_no_w_or_u(monkeypatch):
    """A forward without gradient whose sequence is split into segments: ``wy``, the segment maps (formed from
    Ainv), their chain, then ``sout`` per segment (the portable kernel here; the Hopper Gluon one takes the same
    place); no ``wu`` (w and u are the training path's). The segment bounds are copied to the device once, when
    the plan is built (the first call of these shapes)."""
    xs = _gdn_inputs(1, 64 * 8, 1, 2, 32, 1)
    split = {"seg_units": 1 << 20, "seg_below": 1 << 20, "seg_min": 2, "sout_impl": "triton"}
    with config_override({"gdn_chunk": {**FUSED, **split}}):
        gq.chunk_gated_delta_rule(*xs[:5], initial_state=xs[5], output_final_state=True)  # warm: the plan's segments
        with _Record(monkeypatch) as rec:
            gq.chunk_gated_delta_rule(*xs[:5], initial_state=xs[5], output_final_state=True)
    assert rec.kernels == ["gdn_wy_fwd_kernel", "gdn_state_seg_kernel", "gdn_state_prefix_kernel",
                           "gdn_state_out_kernel"] and rec.torch_ops == []


@pytest.mark.parametrize("HV", [2, 4])
def test_training_step_is_four_and_four_launches(HV, monkeypatch):
    """Forward with gradient: ``wy``, ``wu``, ``state``, ``output``; backward: ``dv_local``, ``state_bwd``,
    ``grad``, ``wy_bwd``, and with GVA (HV > H) one fill of the dq / dk hand-over counters before them."""
    xs = _gdn_inputs(1, 130, 2, HV, 32, 1, grad=True)
    o, ht = gq.chunk_gated_delta_rule(*xs[:5], initial_state=xs[5], output_final_state=True)  # warm: plan caches
    do, dht = torch.ones_like(o), torch.ones_like(ht)
    with _Record(monkeypatch) as rec:
        o, ht = gq.chunk_gated_delta_rule(*xs[:5], initial_state=xs[5], output_final_state=True)
    assert rec.kernels == ["gdn_wy_fwd_kernel", "gdn_wu_fwd_kernel", "gdn_state_fwd_kernel", "gdn_output_fwd_kernel"]
    assert rec.torch_ops == []
    with _Record(monkeypatch) as rec:
        torch.autograd.backward([o, ht], [do, dht])
    assert rec.kernels == ["gdn_dv_local_kernel", "gdn_state_bwd_kernel", "gdn_grad_chunk_kernel",
                           "gdn_wy_bwd_kernel"]
    assert rec.torch_ops == (["zero_"] if HV > 2 else [])


def test_decode_steps_are_one_launch(monkeypatch):
    """A GDN decode step over a state pool is one kernel; an MLA decode is one (with split-KV the combine after it,
    sparse the index translation before it)."""
    dt = P.dtypes[0]
    q, k, v = randn((4, 1, 2, 32), 1, dtype=dt), randn((4, 1, 2, 32), 2, dtype=dt), randn((4, 1, 4, 32), 3, dtype=dt)
    g, beta = -randn((4, 1, 4), 4).abs(), randn((4, 1, 4), 5).sigmoid().to(dt)
    pool, idx = torch.zeros(5, 4, 32, 32, device=P.device), torch.arange(4, dtype=torch.int32, device=P.device)
    with _Record(monkeypatch) as rec:
        gq.gated_delta_rule_decode(q, k, v, g, beta, pool, idx)
    assert rec.kernels == ["gated_delta_rule_decode_fwd_kernel"]  # (a CPU index tensor is also checked on the host)

    qm, cache = randn((2, 1, 16, 576), 6, dtype=dt), randn((8, 16, 1, 576), 7, dtype=dt)
    table = torch.arange(8, dtype=torch.int32, device=P.device).reshape(2, 4)
    lengths = torch.tensor([50, 64], dtype=torch.int32, device=P.device)
    sparse = torch.randint(0, 64, (2, 1, 8), dtype=torch.int32).to(P.device)
    for kw, want in ((dict(num_splits=1), ["mla_decode_fwd_kernel"]),
                     (dict(num_splits=3), ["mla_decode_fwd_kernel", "combine_splits_kernel"]),
                     (dict(indices=sparse, num_splits=1), ["sparse_rows_kernel", "mla_decode_fwd_kernel"])):
        with _Record(monkeypatch) as rec:
            gq.mla_decode(qm, cache, table, lengths, 512, impl="triton", **kw)
        assert rec.kernels == want and rec.torch_ops == [], kw


def test_grids_stay_within_cuda_limits(monkeypatch):
    """Every launch's grid fits CUDA's limits (2^31 - 1 programs along the first axis, 65535 along the others) at
    more (sequence x value head) units than 65535: the decode step over 2100 sequences of 32 value heads, and the
    chunked forward and backward over 2100 varlen sequences, whose state passes take every unit on the first axis;
    a dense batch that would put more than 65535 programs on another axis is refused by name before any launch."""
    grids = []
    monkeypatch.setattr(KernelInterface, "__getitem__",
                        lambda kern, grid: lambda *a, **k: grids.append((kern.fn.__name__, grid)))
    N, HV, D = 2100, 32, 16
    dt = P.dtypes[-1]
    q, k = randn((N, 1, 1, D), 1, dtype=dt), randn((N, 1, 1, D), 2, dtype=dt)
    v, g, beta = randn((N, 1, HV, D), 3, dtype=dt), -randn((N, 1, HV), 4).abs(), randn((N, 1, HV), 5).sigmoid()
    gq.gated_delta_rule_decode(q, k, v, g, beta.to(dt), torch.zeros(N, HV, D, D, device=P.device))
    cu = torch.arange(N + 1, dtype=torch.int32, device=P.device)
    xs = [x.reshape(1, N, *x.shape[2:]).detach().requires_grad_() for x in (q, k, v, g, beta.to(dt))]
    o, ht = gq.chunk_gated_delta_rule(*xs, cu_seqlens=cu, cu_seqlens_cpu=cu.tolist(), output_final_state=True)
    torch.autograd.backward([o, ht], [torch.ones_like(o), torch.ones_like(ht)])
    names = {name for name, _ in grids}
    assert {"gated_delta_rule_decode_fwd_kernel", "gdn_state_fwd_kernel", "gdn_state_bwd_kernel"} <= names
    for name, grid in grids:
        grid = tuple(grid) + (1,) * (3 - len(grid))
        assert grid[0] < 2**31 and max(grid[1:]) <= 65535, (name, grid)
    with pytest.raises(ValueError, match="q / v: batch 2100 x 32 value heads.*cu_seqlens"):
        gq.chunk_gated_delta_rule(q, k, v, g, beta.to(dt))


def _launches(tree: ast.AST, module) -> list[ast.Call]:
    """The kernel launches ``kernel[grid](...)`` in ``tree``: a subscripted module global that is a Triton or Gluon
    kernel."""
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Subscript)
            and isinstance(n.func.value, ast.Name)
            and isinstance(getattr(module, n.func.value.id, None), KernelInterface)]


def test_every_launch_runs_on_its_tensors_device():
    """Triton and Gluon launch on the current CUDA device and its current stream, not on their tensors' device:
    every kernel launch of the package stands inside ``on_device(x.device)`` for a tensor ``x`` the launch passes
    the kernel (in an argument, or through a local ``dev = x.device``), so a model spread over GPUs runs each kernel on
    its own tensors' GPU. ``test_multi_device.py`` runs the ops so on two GPUs."""
    root = pathlib.Path(gq.__file__).parent
    found = 0
    for path in sorted(root.rglob("*.py")):
        name = ".".join(path.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")
        tree = ast.parse(path.read_text())
        parent = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for call in _launches(tree, importlib.import_module(name)):
            found += 1
            where = f"{path.relative_to(root.parent)}:{call.lineno}"
            passed = {ast.unparse(n) for a in [*call.args, *(kw.value for kw in call.keywords)] for n in ast.walk(a)
                      if isinstance(n, (ast.Name, ast.Attribute))}
            node, guard, func = call, None, None
            while node in parent and func is None:
                node = parent[node]
                if isinstance(node, ast.With) and guard is None:
                    guard = next((item.context_expr for item in node.items if isinstance(item.context_expr, ast.Call)
                                  and ast.unparse(item.context_expr.func) == "on_device"), None)
                if isinstance(node, ast.FunctionDef):
                    func = node
            assert guard is not None, f"{where}: a launch outside on_device(...)"
            dev = ast.unparse(guard.args[0])
            local = {ast.unparse(a.targets[0]): ast.unparse(a.value) for a in ast.walk(func)
                     if isinstance(a, ast.Assign) and len(a.targets) == 1}
            dev = local.get(dev, dev)
            assert dev.endswith(".device") and dev.removesuffix(".device") in passed, \
                f"{where}: on_device({dev}) names no tensor the launch passes"
    assert found >= 30  # every op's launches were seen
