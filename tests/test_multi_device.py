"""Tensors on a GPU other than the current one (a model spread over GPUs, e.g. by transformers' ``device_map``):
every op and layer runs its kernels on its tensors' GPU, ordered on that GPU's current stream (Triton launches on
the current device), so each result is bit for bit that of the same call with the tensors' GPU current, and the
current device is left as it was. ``test_launches.py::test_every_launch_runs_on_its_tensors_device`` holds the
same for every launch site on any machine."""

import pytest
import torch
from harness import randn

import gqla_triton as gq
from gqla_triton.layers import GatedDeltaNet, GQLAttention

pytestmark = pytest.mark.gpu_only
BF = torch.bfloat16
DEV = "cuda:1"  # the tensors' GPU; cuda:0 is current
I32 = dict(dtype=torch.int32)


@pytest.fixture(autouse=True)
def two_gpus():
    n = torch.cuda.device_count()
    if n < 2:
        pytest.skip(f"needs 2 GPUs, {n} visible")
    torch.cuda.set_device(0)


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for y in x for t in _tensors(y)]
    return []


def _same_on_gpu1(make):
    """``make()`` (a fresh computation on cuda:1) with cuda:1 current, then with cuda:0 current: the same tensors,
    all on cuda:1, bit for bit; the current device stays cuda:0."""
    with torch.cuda.device(1):
        want = _tensors(make())
    torch.cuda.synchronize(1)
    got = _tensors(make())
    assert torch.cuda.current_device() == 0
    torch.cuda.synchronize(1)
    assert len(got) == len(want) > 0
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.device == b.device == torch.device("cuda", 1), i
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=f"result {i}")


def _gdn(B, T, H, HV, D, seed, grad=False):
    xs = [randn((B, T, H, D), seed, dtype=BF), randn((B, T, H, D), seed + 1, dtype=BF),
          randn((B, T, HV, D), seed + 2, dtype=BF), -randn((B, T, HV), seed + 3).abs() / 8,
          randn((B, T, HV), seed + 4).sigmoid().to(BF), randn((B, HV, D, D), seed + 5) / 4]
    return [x.to(DEV).requires_grad_(grad) for x in xs]


@pytest.mark.parametrize("impl", ["auto", "triton"])
def test_chunked_gdn_forward_and_backward(impl):
    def infer():
        *x, h0 = _gdn(1, 2048, 2, 4, 128, 1)
        return gq.chunk_gated_delta_rule(*x, initial_state=h0, output_final_state=True,
                                         use_qk_l2norm_in_kernel=True, impl=impl)

    def train():
        xs = _gdn(2, 300, 2, 4, 64, 2, grad=True)
        o, ht = gq.chunk_gated_delta_rule(*xs[:5], initial_state=xs[5], output_final_state=True,
                                          use_qk_l2norm_in_kernel=True, impl=impl)
        torch.autograd.backward([o, ht], [torch.ones_like(o), torch.ones_like(ht)])
        return o, ht, [x.grad for x in xs]

    def varlen():
        *x, _ = _gdn(1, 700, 2, 4, 64, 3)
        cu = torch.tensor([0, 100, 450, 700], device=DEV, **I32)  # planned on the device
        return gq.chunk_gated_delta_rule(*x, cu_seqlens=cu, output_final_state=True, use_qk_l2norm_in_kernel=True,
                                         impl=impl)

    for make in (infer, train, varlen):
        _same_on_gpu1(make)


def test_gdn_decode_over_a_pool():
    def make():
        q, k, v, g, beta, _ = _gdn(6, 1, 2, 4, 128, 4)
        pool = randn((9, 4, 128, 128), 5).to(DEV) / 4
        idx = torch.tensor([3, 0, -1, 8, 5, 1], device=DEV, **I32)
        o = gq.gated_delta_rule_decode(q, k, v, g, beta, pool, idx, use_qk_l2norm_in_kernel=True)
        return o, pool
    _same_on_gpu1(make)


@pytest.mark.parametrize("impl", ["auto", "triton"])
def test_mla_and_gqa_decode(impl):
    dev = DEV
    table = torch.arange(32, device=dev, **I32).reshape(4, 8)
    lens = torch.tensor([500, 64, 1, 300], device=dev, **I32)

    def mla(**kw):
        q, cache = randn((4, 1, 64, 576), 6, dtype=BF).to(dev), randn((32, 64, 1, 576), 7, dtype=BF).to(dev)
        return gq.mla_decode(q, cache, table, lens, 512, impl=impl, **kw)

    sparse = torch.randint(-1, 500, (4, 1, 128), generator=torch.Generator().manual_seed(8), **I32).to(dev)
    for kw in (dict(num_splits=1), dict(num_splits=4), dict(), dict(indices=sparse)):
        _same_on_gpu1(lambda kw=kw: mla(**kw))

    def gqa(**kw):
        q = randn((4, 2, 32, 192), 9, dtype=BF).to(dev)
        kc, vc = randn((32, 64, 4, 128), 10, dtype=BF).to(dev), randn((32, 64, 4, 128), 11, dtype=BF).to(dev)
        rope = randn((32, 64, 64), 12, dtype=BF).to(dev)
        return gq.gqa_decode(q, kc, vc, table, lens, rope, impl=impl, **kw)

    for kw in (dict(num_splits=1), dict()):
        _same_on_gpu1(lambda kw=kw: gqa(**kw))


def _seeded(layer, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5 + (p.dim() == 1))
    return layer


@torch.no_grad()
def test_layers_prefill_and_decode_steps():
    dev = DEV

    def gdn():
        m = _seeded(GatedDeltaNet(256, 2, 4, 128, 128, device=dev, dtype=BF), 13)
        cache = m.init_cache(3)
        outs = [m(randn((1, 200, 256), 14, dtype=BF).to(dev), cache, slots=[1])]
        outs += [m(randn((3, 1, 256), 15 + i, dtype=BF).to(dev), cache) for i in range(3)]
        return outs, cache.recurrent_state

    _same_on_gpu1(gdn)
    for path in ("absorb", "grouped"):
        def gqla(path=path):
            a = _seeded(GQLAttention(512, 32, 4, 128, 64, 512, path=path, device=dev, dtype=BF), 16)
            cache = a.make_cache(3, 512, path=path)
            outs = [a(randn((1, 100 + 50 * s, 512), 17 + s, dtype=BF).to(dev), cache=cache, seq_ids=[s])
                    for s in range(3)]
            outs += [a(randn((3, 1, 512), 20 + i, dtype=BF).to(dev), cache=cache) for i in range(3)]
            return outs
        _same_on_gpu1(gqla)
