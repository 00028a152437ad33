"""Shared test machinery: profile facts, seeded input factories, data-derived tolerances, poisoning."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from conftest import PROFILE
from hypothesis import strategies as st


@dataclass(frozen=True)
class Profile:
    name: str
    device: str
    dtypes: tuple  # low-precision dtypes the kernels are tested in
    big: bool  # realistic (GPU) or tiny (interpreter) shapes


P = (
    Profile("gpu", "cuda", (torch.bfloat16, torch.float16), True)
    if PROFILE == "gpu"
    else Profile("ci", "cpu", (torch.float32, torch.float16), False)
)


def pick(tiny, big):
    """Profile-dependent value: ``tiny`` under the interpreter, ``big`` on the GPU."""
    return big if P.big else tiny


def examples(tiny, big):
    """Hypothesis example count: ``tiny`` under the interpreter; on the GPU ``big`` scaled by the profile's
    count over its default of 12 (``GQLA_TEST_EXAMPLES`` is the one knob for the whole GPU run)."""
    from hypothesis import settings

    if not P.big:
        return tiny
    return max(1, round(big * settings.default.max_examples / 12))


def dtypes():
    return st.sampled_from(P.dtypes)


def seeds():
    return st.integers(0, 2**31 - 1)


def gen(seed: int) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g


def randn(shape, seed_or_gen, *, dtype=torch.float32, device=None, scale=1.0) -> torch.Tensor:
    """Normal samples drawn on the CPU from a seed (same values on every device), then moved."""
    g = seed_or_gen if isinstance(seed_or_gen, torch.Generator) else gen(seed_or_gen)
    t = torch.randn(*shape, generator=g, dtype=torch.float64) * scale
    return t.to(device=device or P.device, dtype=dtype)


def rand(shape, seed_or_gen, *, lo=0.0, hi=1.0, dtype=torch.float32, device=None) -> torch.Tensor:
    g = seed_or_gen if isinstance(seed_or_gen, torch.Generator) else gen(seed_or_gen)
    t = torch.rand(*shape, generator=g, dtype=torch.float64) * (hi - lo) + lo
    return t.to(device=device or P.device, dtype=dtype)


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill an output buffer with NaN so that any element a kernel fails to write fails the test."""
    return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-(2**30))


def empty_poisoned(shape, *, dtype, device=None) -> torch.Tensor:
    return poison(torch.empty(shape, dtype=dtype, device=device or P.device))


def mapped_zeros(numel: int, dtype: torch.dtype, tmp_path) -> torch.Tensor:
    """A CPU tensor of ``numel`` zeros backed by a sparse file mapped shared: address space, not memory (only the
    pages written or read take any), for strides past 2**31 elements under the interpreter."""
    import os

    path = tmp_path / "mapped.bin"
    with open(path, "wb") as f:
        f.truncate(numel * torch.empty((), dtype=dtype).element_size())
    t = torch.from_file(str(path), shared=True, size=numel, dtype=dtype)
    os.unlink(path)  # the mapping keeps the file until the tensor goes
    return t


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """‖x − ref‖ / ‖ref‖ in float64; inf if x holds NaN/inf where ref is finite."""
    x = x.detach().to(torch.float64).cpu()
    ref = ref.detach().to(torch.float64).cpu()
    finite = torch.isfinite(ref)
    if not torch.equal(torch.isfinite(x), finite):
        return math.inf
    if not torch.equal(x[~finite], ref[~finite]):  # infinities must agree exactly (e.g. lse = -inf)
        return math.inf
    d = (x[finite] - ref[finite]).norm().item()
    n = ref[finite].norm().item()
    return d / n if n > 0 else d



def gdn_problem(seed: int, lens, varlen: bool, H: int, HV: int, K: int, V: int):
    """float64 CPU inputs of the chunked GDN op for sequences ``lens``: ([q, k (unit rows), v, g in [-1, 0),
    beta in (0.05, 0.95), h0 [N, HV, K, V]], cu_seqlens CPU int32 or None). varlen packs them (B = 1); dense gives
    B = len(lens) rows of the longest length."""
    g_ = gen(seed)
    if varlen:
        B, T = 1, sum(lens)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    else:
        B, T, cu = len(lens), max(lens), None
    f64 = dict(dtype=torch.float64, device="cpu")
    q = torch.nn.functional.normalize(randn((B, T, H, K), g_, **f64), dim=-1)
    k = torch.nn.functional.normalize(randn((B, T, H, K), g_, **f64), dim=-1)
    v = randn((B, T, HV, V), g_, **f64)
    g = rand((B, T, HV), g_, lo=-1.0, hi=0.0, **f64)
    beta = rand((B, T, HV), g_, lo=0.05, hi=0.95, **f64)
    h0 = randn((len(lens), HV, K, V), g_, scale=0.5, **f64)
    return [q, k, v, g, beta, h0], cu

EPS = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float64: 1e-12}


def assert_close(name: str, out: torch.Tensor, ref64: torch.Tensor, lowp: torch.Tensor | None = None, *,
                 dtype: torch.dtype | None = None, factor: float = 2.0, eps: float | None = None) -> None:
    """Data-derived tolerance: ``err(out, ref64) <= factor·err(lowp, ref64) + eps``; NaN/inf never pass.

    ``lowp`` is the same computation done by torch at the kernel's precision. ``eps`` defaults to a small
    floor per ``dtype`` (the kernel's input dtype) that covers outputs torch happens to round exactly.
    """
    if out.shape != ref64.shape:
        raise AssertionError(f"{name}: shape {tuple(out.shape)} != reference {tuple(ref64.shape)}")
    e_out = rel_err(out, ref64)
    e_low = rel_err(lowp, ref64) if lowp is not None else 0.0
    if not math.isfinite(e_low):
        e_low = 0.0
    tol = factor * e_low + (eps if eps is not None else EPS[dtype or out.dtype])
    assert math.isfinite(e_out), f"{name}: NaN/inf (or unwritten element) in output"
    assert e_out <= tol, f"{name}: rel err {e_out:.3e} > tol {tol:.3e} (torch low-precision err {e_low:.3e})"


def assert_matches(name, got, ref, lowp, *, dtype, eps=None):
    """NaN, +inf and -inf exactly where the reference has them; the finite rest within the data-derived bound."""
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    for what, f in (("NaN", torch.isnan), ("+inf", lambda t: t == math.inf), ("-inf", lambda t: t == -math.inf)):
        bad = f(got) != f(ref)
        assert not bad.any(), (f"{name}: {what} differs from the reference at {int(bad.sum())} element(s), e.g. "
                               f"{tuple(bad.nonzero()[0].tolist())}: got {got[bad][0].item()}, "
                               f"reference {ref[bad][0].item()}")
    fin = torch.isfinite(ref)
    zero = torch.zeros((), dtype=torch.float64)
    lowp = None if lowp is None else torch.where(fin, lowp.detach().double().cpu(), zero)
    assert_close(name, torch.where(fin, got, zero), torch.where(fin, ref, zero), lowp, dtype=dtype, eps=eps)


def address_checked(fn, *tensors):
    """``fn()``; under the interpreter its loads and stores must stay inside ``tensors`` and what the call creates
    (``addresscheck.AddressCheck``), on a GPU that check is compute-sanitizer's."""
    from gqla_triton.dispatch import is_interpreter

    if not is_interpreter():
        return fn()
    from addresscheck import AddressCheck

    with AddressCheck(*tensors) as ac:
        out = fn()
    ac.assert_clean()
    return out


def assert_refused(fn, base: dict, calls) -> None:
    """Each ``(label, overrides, exception type, message regex)`` of ``calls``: ``fn(**{**base, **overrides})``
    raises exactly that type with a message matching the regex (it names the argument)."""
    import re

    import pytest

    for label, over, exc, pattern in calls:
        try:
            fn(**{**base, **over})
        except Exception as e:  # noqa: BLE001 (the type is checked next)
            assert type(e) is exc and re.search(pattern, str(e)), f"{label}: {type(e).__name__}: {e}"
        else:
            pytest.fail(f"{label}: accepted")


def assert_close_token_sum(name: str, out: torch.Tensor, ref64: torch.Tensor, lowp: torch.Tensor, d: torch.Tensor,
                           d64: torch.Tensor, dlp: torch.Tensor, w: torch.Tensor, *, dtype: torch.dtype,
                           factor: float = 2.0) -> None:
    """A gradient that is a sum over tokens, ``out[h] = Σ_t d[t, h]·w[t, h]`` (e.g. a per-head decay parameter):
    ``d`` [..., HV] is what the kernel computes per token (``d64`` / ``dlp``: the float64 reference and torch at the
    kernel's precision), ``w`` [..., HV] (float64) is ∂(token term)/∂parameter.

    A sum with cancellation has a relative error far above its terms', and which of two low-precision
    implementations lands closer to the float64 sum on one example is chance, so ``out`` is not judged against
    ``lowp``'s error alone. ``d`` gets the data-derived check of ``assert_close``; the sum's error then gets that
    check's per-token error bound carried through the sum by Cauchy-Schwarz, |Σ Δd·w| <= ‖Δd‖·‖w‖ per head, plus
    ``factor`` times ``lowp``'s own error (roundings outside the kernel: parameters, inputs, the stored gradient).
    """
    assert_close(f"{name} per token", d, d64, dlp, dtype=dtype, factor=factor)
    f64 = torch.float64
    d, d64, dlp, w = (t.detach().to(f64).cpu().reshape(-1, t.shape[-1]) for t in (d, d64, dlp, w))
    out, ref64, lowp = (t.detach().to(f64).cpu() for t in (out, ref64, lowp))
    eps = EPS[dtype]
    per_head = (factor * (dlp - d64).norm(dim=0) + eps * d64.norm(dim=0)) * w.norm(dim=0)
    tol = per_head.norm().item() + factor * (lowp - ref64).norm().item() + eps * ref64.norm().item()
    err = (out - ref64).norm().item()
    assert math.isfinite(err), f"{name}: NaN/inf in output"
    assert err <= tol, (f"{name}: abs err {err:.3e} > tol {tol:.3e} (torch low-precision err "
                        f"{(lowp - ref64).norm().item():.3e}, |ref| {ref64.norm().item():.3e})")


def record_launches(monkeypatch, module, kernel: str) -> list:
    """Replace ``module.kernel`` with a launcher that records each grid it is given and runs nothing; returns the
    list of grids."""
    grids = []

    class Recorder:
        def __getitem__(self, grid):
            grids.append(grid)
            return lambda *args, **kwargs: None

    monkeypatch.setattr(module, kernel, Recorder())
    return grids


def capture_graph(fn):
    """Warm ``fn`` up on a side stream, capture one call in a CUDA graph; returns ``(graph, fn's outputs)``."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


SM90_SHARED = 232448  # an sm_90 block's shared memory (227 KB): a launch that asks for more fails


def compile_in_child(call: str, report: str) -> list[str]:
    """Run ``call`` (statements that leave a kernel compiled for sm_90 in ``k``) in a child process without
    TRITON_INTERPRET (under it Triton's own reductions are interpreter functions no compiler can take) and return
    the words it prints for ``report`` (an expression over ``k``)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", f"{call}; print(*({report},))"], capture_output=True, text=True,
                         env=env, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout.splitlines()[-1].split()


def static_shared(cubin: bytes) -> int:
    """The static shared memory of a cubin's kernels (its ``.nv.shared.*`` ELF sections; a warp-specialised Gluon
    kernel has 1 KB): a launch's dynamic shared memory may take the block's 227 KB less this."""
    import struct

    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    heads = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names_at = heads[shstrndx][4]

    def name(h):
        start = names_at + h[0]
        return cubin[start:cubin.index(b"\0", start)].decode()

    return sum(h[5] for h in heads if name(h).startswith(".nv.shared."))


def compile_sm90_in_child(call: str, *, tma: bool = False) -> int:
    """``compile_in_child`` for a Gluon kernel: assert it is warp-specialised (register reallocation) with wgmma
    products and cp.async copies, TMA tile copies exactly when ``tma``, and return its shared memory in bytes, the
    dynamic (what the launch asks for) and the static together."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/k.cubin"
        shared, *flags = compile_in_child(f"{call}; open({path!r}, 'wb').write(k.asm['cubin'])",
                                          "k.metadata.shared, 'setmaxnreg' in k.asm['ptx'], "
                                          "'wgmma.mma_async' in k.asm['ptx'], 'cp.async' in k.asm['ptx'], "
                                          "'cp.async.bulk.tensor' in k.asm['ptx']")
        with open(path, "rb") as f:
            static = static_shared(f.read())
    assert flags == ["True", "True", "True", str(tma)], flags
    return int(shared) + static
