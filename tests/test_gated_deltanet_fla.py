"""GatedDeltaNet from fla's layer (``from_fla``, ``load_fla_state_dict``, ``fla_state_dict``, ``load_state_dict`` of fla
keys) against a module with fla's parameter names whose forward follows ``fla/layers/gated_deltanet.py`` in plain
torch (fla needs a GPU and is not installed here): projections, three short convolutions with SiLU, q / k
L2-normalised (eps 1e-6), ``g = -exp(A_log)·softplus(a + dt_bias)``, ``beta = sigmoid(b)``, the delta rule, the gated
RMSNorm (norm, weight, then ``x·sigmoid(x)`` of the gate), ``o_proj``.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from harness import P, assert_close, dtypes, examples, gen, pick, randn, seeds
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn

from gqla_triton.layers import GatedDeltaNet


class _Act(nn.Module):
    def __init__(self, activation: str, eps: float | None = None, dim: int | None = None):
        super().__init__()
        self.activation, self.eps = activation, eps
        if dim is not None:
            self.weight = nn.Parameter(torch.empty(dim))


class FlaLayer(nn.Module):
    """fla's ``GatedDeltaNet`` parameters and attributes, forward in float64 torch over packed sequences."""

    def __init__(self, hidden, H, HV, K, V, W=4, eps=1e-5, **opts):
        super().__init__()
        self.hidden_size, self.num_heads, self.num_v_heads = hidden, H, HV
        self.head_k_dim, self.head_v_dim, self.conv_size, self.layer_idx = K, V, W, 3
        self.use_gate, self.use_short_conv, self.conv_bias, self.allow_neg_eigval = True, True, False, False
        self.__dict__.update(opts)
        kd, vd = H * K, HV * V
        for n, rows in (("q", kd), ("k", kd), ("v", vd), ("a", HV), ("b", HV), ("g", vd)):
            setattr(self, f"{n}_proj", nn.Linear(hidden, rows, bias=False))
        for n, c in (("q", kd), ("k", kd), ("v", vd)):
            conv = nn.Conv1d(c, c, W, groups=c, bias=self.conv_bias)
            conv.activation = "silu"
            setattr(self, f"{n}_conv1d", conv)
        self.A_log = nn.Parameter(torch.empty(HV))
        self.dt_bias = nn.Parameter(torch.empty(HV))
        self.o_norm = _Act("swish", eps, V)
        self.o_proj = nn.Linear(vd, hidden, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.normal_(0, 0.3)
            self.A_log.uniform_(-1, 1)

    def forward(self, x, cu):
        """x ``[1, T, hidden]`` float64, cu the sequences' bounds (list): ``[1, T, hidden]``."""
        H, HV, K, V, W = self.num_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim, self.conv_size
        outs = []
        for a, b in zip(cu[:-1], cu[1:], strict=True):
            h = x[0, a:b]
            T = b - a
            if T == 0:
                continue

            def conv(name, y):
                w = getattr(self, f"{name}_conv1d").weight[:, 0]  # [C, W]
                y = F.pad(y.t(), (W - 1, 0))
                return F.silu(torch.stack([(y[:, t:t + W] * w).sum(-1) for t in range(T)], 0))

            q = conv("q", self.q_proj(h)).reshape(T, H, K)
            k = conv("k", self.k_proj(h)).reshape(T, H, K)
            v = conv("v", self.v_proj(h)).reshape(T, HV, V)
            q, k = (u * torch.rsqrt((u * u).sum(-1, keepdim=True) + 1e-6) for u in (q, k))
            g = -self.A_log.exp() * F.softplus(self.a_proj(h) + self.dt_bias)
            beta = torch.sigmoid(self.b_proj(h))
            r = HV // H
            S = torch.zeros(HV, K, V, dtype=x.dtype)
            o = torch.empty(T, HV, V, dtype=x.dtype)
            for t in range(T):
                for j in range(HV):
                    kt, qt = k[t, j // r], q[t, j // r]
                    S[j] = S[j] * g[t, j].exp()
                    S[j] = S[j] + beta[t, j] * torch.outer(kt, v[t, j] - S[j].t() @ kt)
                    o[t, j] = K ** -0.5 * (S[j].t() @ qt)
            o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.o_norm.eps) * self.o_norm.weight
            z = self.g_proj(h).reshape(T, HV, V)
            outs.append(self.o_proj((o * F.silu(z)).reshape(T, HV * V)))
        return torch.cat(outs, 0)[None] if outs else x[:, :0]


FEW = settings(max_examples=examples(3, 12), deadline=None)


@FEW
@given(lens=st.lists(st.integers(0, pick(9, 40)), min_size=1, max_size=3).filter(any), H=st.sampled_from([1, 2]),
       G=st.sampled_from([1, 2]), dtype=dtypes(), seed=seeds())
@example(lens=[5, 0, 7], H=2, G=2, dtype=P.dtypes[-1], seed=1)
def test_from_fla_computes_the_fla_layer(lens, H, G, dtype, seed):
    """``from_fla`` of an fla layer: the float64 reference layer equals it; the kernels in ``dtype`` are as close
    to it as the same layer in torch at ``dtype``. At least one token in every batch; an empty sequence inside
    one."""
    torch.manual_seed(seed)
    K, V = pick(16, 64), pick(16, 128)
    fla = FlaLayer(pick(32, 256), H, H * G, K, V).double()
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    T = cu[-1]
    x = randn((1, T, fla.hidden_size), gen(seed), dtype=torch.float64, device="cpu")
    ref = fla(x, cu).to(P.device)
    cu_t = torch.tensor(cu, dtype=torch.int32, device=P.device)
    m64 = GatedDeltaNet.from_fla(fla, impl="reference", device=P.device)
    assert m64.in_proj.weight.dtype == torch.float64 and m64.layer_idx == 3 and m64.norm_eps == 1e-5
    x = x.to(P.device)
    out64 = m64(x, cu_seqlens=cu_t)
    assert torch.allclose(out64[:, :cu[-1]], ref[:, :cu[-1]], rtol=1e-9, atol=1e-10)
    low = GatedDeltaNet.from_fla(fla, impl="reference", device=P.device, dtype=dtype)(x.to(dtype), cu_seqlens=cu_t)
    out = GatedDeltaNet.from_fla(fla, impl="triton", device=P.device, dtype=dtype)(x.to(dtype), cu_seqlens=cu_t)
    assert_close("out", out[:, :cu[-1]], out64[:, :cu[-1]], low[:, :cu[-1]], dtype=dtype)


def test_fla_state_dicts():
    """``load_state_dict`` takes fla's keys as they are (strict), ``fla_state_dict`` gives them back, and
    ``load_fla_state_dict`` refuses a wrong shape, a missing or an extra key (a conv bias) before any parameter
    changes."""
    fla = FlaLayer(32, 2, 4, 16, 8).double()
    sd = fla.state_dict()
    m = GatedDeltaNet(32, 2, 4, 16, 8, impl="reference", dtype=torch.float64)
    m.load_state_dict(sd)
    back = m.fla_state_dict()
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)
    m2 = GatedDeltaNet.from_fla(fla, impl="reference")
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), m2.state_dict().values(), strict=True))
    before = {k: v.clone() for k, v in m.state_dict().items()}
    bad = {**sd, "v_conv1d.weight": sd["v_conv1d.weight"][:, :, :3]}
    with pytest.raises(ValueError, match=r"^state_dict: v_conv1d.weight has shape \[32, 1, 3\], the layer's sizes "
                                         r"give \[32, 1, 4\]"):
        m.load_fla_state_dict(bad)
    with pytest.raises(ValueError, match=r"^state_dict: v_conv1d.weight: expected shape \[32, 1, 4\], got "
                                         r"\[32, 1, 3\]"):
        m.load_state_dict(bad)
    with pytest.raises(ValueError, match="missing 'o_norm.weight'"):
        m.load_fla_state_dict({k: v for k, v in sd.items() if k != "o_norm.weight"})
    with pytest.raises(ValueError, match=r"^state_dict: unexpected keys \['q_conv1d.bias'\]"):
        m.load_fla_state_dict({**sd, "q_conv1d.bias": torch.zeros(32)})
    with pytest.raises(TypeError, match="^prefix: expected a str, got int"):
        m.load_fla_state_dict(sd, prefix=1)
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
    pre = {f"layers.0.attn.{k}": v for k, v in sd.items()}
    m.load_fla_state_dict(pre, prefix="layers.0.attn.")
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), m2.state_dict().values(), strict=True))


@pytest.mark.parametrize("opt", [dict(use_gate=False), dict(use_short_conv=False), dict(conv_bias=True),
                                 dict(allow_neg_eigval=True)])
def test_from_fla_refuses_what_has_no_counterpart(opt):
    """An fla layer option without a counterpart here: a ValueError naming the option and its value."""
    (name, value), = opt.items()
    with pytest.raises(ValueError, match=f"^layer: fla's {name}={value} .*has no counterpart here"):
        GatedDeltaNet.from_fla(FlaLayer(32, 1, 1, 16, 16, **opt), impl="reference")


def test_from_fla_refuses_other_activations_and_modules():
    fla = FlaLayer(32, 1, 1, 16, 16)
    fla.o_norm.activation = "sigmoid"
    with pytest.raises(ValueError, match="o_norm's activation"):
        GatedDeltaNet.from_fla(fla, impl="reference")
    fla = FlaLayer(32, 1, 1, 16, 16)
    fla.k_conv1d.activation = None
    with pytest.raises(ValueError, match="k_conv1d's activation"):
        GatedDeltaNet.from_fla(fla, impl="reference")
    with pytest.raises(TypeError, match="fla GatedDeltaNet"):
        GatedDeltaNet.from_fla(nn.Linear(2, 2))
    fla = FlaLayer(32, 1, 1, 16, 16)
    del fla.q_conv1d
    with pytest.raises(TypeError, match="has no q_conv1d"):
        GatedDeltaNet.from_fla(fla, impl="reference")
    partial = nn.Module()
    partial.in_proj_qkvz = nn.Linear(2, 2)  # one attribute of a transformers Qwen3-Next layer, not its sizes
    with pytest.raises(TypeError, match="has no hidden_size"):
        GatedDeltaNet.from_hf(partial)


def test_fla_weights_must_be_finite_and_wider_than_float8_and_old_fla_layers_load():
    """``load_fla_state_dict`` (and so ``from_fla``) refuses a non-finite or float8 weight by name before any
    parameter changes (a ``dt_bias`` of -inf would silently remove the decay); an fla layer without
    ``num_v_heads`` (fla before value-head groups) loads with one value head per head."""
    fla = FlaLayer(32, 2, 2, 16, 8).double()
    sd = fla.state_dict()
    m = GatedDeltaNet(32, 2, 2, 16, 8, impl="reference", dtype=torch.float64)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    for key, bad in (("dt_bias", -math.inf), ("A_log", math.nan)):
        with pytest.raises(ValueError, match=f"{key} has non-finite values"):
            m.load_fla_state_dict({**sd, key: torch.full_like(sd[key], bad)})
    with pytest.raises(TypeError, match="float8 weights need their scales"):
        m.load_fla_state_dict({**sd, "o_proj.weight": sd["o_proj.weight"].to(torch.float8_e4m3fn)})
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())
    want = GatedDeltaNet.from_fla(fla, impl="reference")
    del fla.num_v_heads
    got = GatedDeltaNet.from_fla(fla, impl="reference")
    assert got.num_v_heads == 2 and all(torch.equal(a, b) for a, b in zip(
        got.state_dict().values(), want.state_dict().values(), strict=True))


def test_weights_of_the_wrong_kind_or_past_the_layers_range_are_refused():
    """fla's layout through ``load_state_dict`` checks each part it joins as the slice it fills (an integer, bool,
    float8, meta, sparse or nested part: a ValueError naming it), nested weights are refused by the fla loader, and a
    finite weight past the layer's dtype (it would load as inf) is refused by name; nothing changes."""
    fla = FlaLayer(32, 2, 2, 16, 8).double()
    sd = fla.state_dict()
    m = GatedDeltaNet(32, 2, 2, 16, 8, impl="reference", dtype=torch.float64)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    k, c = sd["k_proj.weight"], sd["k_conv1d.weight"]
    for key, bad in (("k_proj.weight", (3 * k).round().long()), ("k_proj.weight", k > 0),
                     ("k_proj.weight", k.to(torch.float8_e4m3fn)), ("k_proj.weight", k.to("meta")),
                     ("k_proj.weight", k.to_sparse()), ("k_conv1d.weight", c.long()),
                     ("k_conv1d.weight", torch.nested.nested_tensor(list(c)))):
        with pytest.raises(ValueError, match=f"state_dict: {key}: "):
            m.load_state_dict({**sd, key: bad})
        assert all(torch.equal(v, before[k2]) for k2, v in m.state_dict().items())
    with pytest.raises(ValueError, match="A_log must be a dense tensor"):
        m.load_fla_state_dict({**sd, "A_log": torch.nested.nested_tensor([sd["A_log"]])})
    m16 = GatedDeltaNet(32, 2, 2, 16, 8, impl="reference", dtype=torch.float16)
    keep = {k2: v.clone() for k2, v in m16.state_dict().items()}
    big = {**sd, "o_proj.weight": sd["o_proj.weight"].clone()}
    big["o_proj.weight"][0, 0] = 1e6  # finite, past float16's 65504
    with pytest.raises(ValueError, match="o_proj.weight pass torch.float16's range"):
        m16.load_fla_state_dict(big)
    assert all(torch.equal(v, keep[k2]) for k2, v in m16.state_dict().items())


def test_refused_load_state_dict_changes_no_parameter():
    """A refused ``load_state_dict`` of fla's keys leaves every parameter as it was: an extra conv bias (refused
    even with ``strict=False``: dropping it would change the function), a wrong shape, an unexpected key under
    ``strict``."""
    fla = FlaLayer(32, 2, 2, 16, 8).double()
    sd = fla.state_dict()
    m = GatedDeltaNet(32, 2, 2, 16, 8, impl="reference", dtype=torch.float64)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    bias = {**sd, "q_conv1d.bias": torch.zeros(32)}
    conv_bias = (ValueError, "^state_dict: q_conv1d.bias: a conv bias .*has no counterpart here")
    for bad, strict, (exc, match) in (
            (bias, True, conv_bias), (bias, False, conv_bias),
            ({**sd, "A_log": torch.zeros(3)}, True,
             (ValueError, r"^state_dict: A_log: expected shape \[2\], got \[3\]")),
            ({**sd, "extra.weight": torch.zeros(2)}, True,
             (RuntimeError, r'Unexpected key\(s\) in state_dict: "extra.weight"'))):
        with pytest.raises(exc, match=match):
            m.load_state_dict(bad, strict=strict)
        assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())
    m.load_state_dict({**sd, "extra.weight": torch.zeros(2)}, strict=False)


def test_fla_weights_into_a_meta_layer_are_refused_by_name():
    """``from_fla(..., device="meta")`` names ``device``; ``load_fla_state_dict`` into a layer on meta says so."""
    fla = FlaLayer(32, 1, 1, 16, 16)
    with pytest.raises(ValueError, match="^device: expected a device with storage, got meta"):
        GatedDeltaNet.from_fla(fla, impl="reference", device="meta")
    m = GatedDeltaNet(32, 1, 1, 16, 16, impl="reference", device="meta")
    with pytest.raises(ValueError, match="on the meta device"):
        m.load_fla_state_dict(fla.state_dict())
