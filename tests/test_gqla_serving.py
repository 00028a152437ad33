"""GQLAttention decode steps as a server runs them: compiled with torch.compile(fullgraph=True) (no recompile
across steps), captured in CUDA graphs (GPU), without host syncs (GPU); forked prefixes decode like unshared
copies; a rejected forward changes no cache state. Each step is compared with the eager step of an identical
layer and cache, and with the layer's float64 torch path (``impl="reference"``)."""

import copy

import pytest
import torch
from harness import P, assert_close, capture_graph, gen, pick, randn
from test_kv_cache import assert_unchanged, snapshot

from gqla_triton.layers.gqla import GQLAttention

PAGE = pick(16, 64)
DIMS = pick(dict(hidden=64, num_heads=16, head_dim=16, rope_dim=16, kv_rank=32, g=2),
            dict(hidden=1024, num_heads=32, head_dim=128, rope_dim=64, kv_rank=512, g=8))
DT = pick(torch.float32, torch.bfloat16)


def make_layer(seed, path, *, dtype=DT):
    d = DIMS
    layer = GQLAttention(d["hidden"], d["num_heads"], d["g"], d["head_dim"], d["rope_dim"], d["kv_rank"], path=path,
                         impl=pick("triton", "auto"), dtype=torch.float64, device="cpu")
    gg = gen(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            scale = 0.1 if "layernorm" in name else p.shape[1] ** -0.5
            p.copy_(randn(p.shape, gg, dtype=torch.float64, device="cpu", scale=scale) + ("layernorm" in name))
    return layer.to(device=P.device, dtype=dtype)


class Run:
    """One layer + cache, its eager twin and the float64 torch twin, prefilled with the same prompts (one per
    slot, of different lengths)."""

    def __init__(self, seed, path, slots, prompt_lens, max_seqlen, *, dtype=DT, max_batch=None):
        self.gg = gen(seed)
        self.layer = make_layer(seed, path, dtype=dtype)
        self.slots = slots
        self.ids = list(range(len(prompt_lens))) if slots is None else list(slots)
        n_slots = max_batch or max(self.ids) + 2
        self.cache = self.layer.make_cache(n_slots, max_seqlen, path=path, page_size=PAGE)
        self.ref = copy.deepcopy(self.layer).double()
        self.ref.impl = "reference"
        self.ref_cache = self.ref.make_cache(n_slots, max_seqlen, path=path, page_size=PAGE, dtype=torch.float64)
        with torch.no_grad():
            for s, L in zip(self.ids, prompt_lens, strict=True):
                x = randn((1, L, self.layer.hidden_size), self.gg, dtype=dtype)
                self.layer(x, None, self.cache, seq_ids=[s])
                self.ref(x.double(), None, self.ref_cache, seq_ids=[s])
        self.twin, self.twin_cache = copy.deepcopy(self.layer), copy.deepcopy(self.cache)

    def inputs(self, T, topk=None):
        B = len(self.ids)
        x = randn((B, T, self.layer.hidden_size), self.gg, dtype=self.layer.o_proj.weight.dtype)
        if topk is None:
            return x, None
        hi = max(self.cache.seqlens(self.ids)) + T + 3
        return x, torch.randint(-2, hi, (B, T, topk), generator=self.gg, dtype=torch.int32).to(P.device)

    def eager(self, x, idx):
        """The same step on the eager twin and the float64 twin: ``(eager out, float64 out)``."""
        with torch.no_grad():
            y = self.twin(x, None, self.twin_cache, seq_ids=self.slots, indices=idx)
            y64 = self.ref(x.double(), None, self.ref_cache, seq_ids=self.slots, indices=idx)
        return y, y64


def counting(backend):
    """A torch.compile backend that records every graph it compiles."""
    from torch._dynamo.backends.registry import lookup_backend

    graphs = []

    def fn(gm, example_inputs):
        graphs.append(gm)
        return lookup_backend(backend)(gm, example_inputs)

    return fn, graphs


def compiled_steps(run, backend, steps, T, topk):
    """``steps`` decode steps of ``run`` through torch.compile(fullgraph=True): each compared with the eager
    step and the float64 step; one graph, no recompilation."""
    torch._dynamo.reset()
    if run.slots is not None:
        run.cache.slot_index(run.slots)  # made once outside the compiled step
    fn, graphs = counting(backend)

    def step(x, idx):
        return run.layer(x, None, run.cache, seq_ids=run.slots, indices=idx)

    compiled = torch.compile(step, fullgraph=True, backend=fn)
    with torch._dynamo.config.patch(error_on_recompile=True), torch.no_grad():
        for i in range(steps):
            x, idx = run.inputs(T, topk)
            y = compiled(x, idx)
            y_eager, y64 = run.eager(x, idx)
            assert_close(f"compiled step {i}", y, y64, y_eager, dtype=DT)
    assert len(graphs) == 1
    # the step's kernels are custom ops in the one graph; no torch rope / einsum around them
    calls = {str(n.target) for n in graphs[0].graph.nodes if n.op in ("call_function", "call_method")}
    want = (["gqla_norm_rope", "gqla_absorb_q", "mla_decode", "gqla_absorb_o"] if run.layer.path == "absorb"
            else ["gqla_norm_rope", "gqla_grouped_q", "gqa_decode"])
    for op in want:
        assert any(op in c for c in calls), (op, sorted(calls))
    assert not any(w in c for c in calls for w in ("cos", "sin", "einsum")), sorted(calls)
    return compiled


@pytest.mark.parametrize("path,sparse,slots,T", [
    ("absorb", False, (3, 0), 1), ("grouped", False, None, 1), ("absorb", True, None, 2), ("grouped", True, (2, 1), 1)])
def test_compiled_decode_steps_equal_eager(path, sparse, slots, T):
    """torch.compile(fullgraph=True, backend="aot_eager") decode steps with growing lengths across a page
    boundary equal the eager steps; the caches end identical; one graph for all steps."""
    prompts = [PAGE - 3, 2 * PAGE - 2]  # the second crosses a page boundary, the first fills its page (T = 1)
    run = Run(11, path, slots, prompts, 3 * PAGE)
    steps = 3
    run.cache.reserve(run.ids, steps * T)
    run.twin_cache.reserve(run.ids, steps * T)
    if slots is not None and not sparse:  # a tuple of slots without its device index: a clear error, no change
        torch._dynamo.reset()
        f = torch.compile(lambda x: run.layer(x, None, run.cache, seq_ids=slots), fullgraph=True, backend="aot_eager")
        before = snapshot(run.cache)
        with pytest.raises(Exception, match="slot_index"), torch.no_grad():
            f(run.inputs(T)[0])
        assert_unchanged(before, run.cache)
    compiled = compiled_steps(run, "aot_eager", steps, T, 8 if sparse else None)
    for name in ("cache_seqlens", "block_table", "overflow"):
        assert torch.equal(getattr(run.cache, name), getattr(run.twin_cache, name)), name
    assert run.cache.seqlens(run.ids) == [L + steps * T for L in prompts]
    run.cache.check()
    if path == "absorb" and not sparse:
        # past the reservation a compiled step stays memory-safe: the first slot's token goes to the scratch
        # page, its length stops at its full page, check() raises; the other slot goes on
        assert run.cache.reserved(run.ids)[0] == PAGE == run.cache.seqlens(run.ids)[0]
        pages = [t[:-1].clone() for t in run.cache._storages()]
        with torch._dynamo.config.patch(error_on_recompile=True), torch.no_grad():
            compiled(*run.inputs(T))
        assert run.cache.seqlens(run.ids) == [PAGE, 2 * PAGE + 2]
        assert run.cache.overflow.nonzero().flatten().tolist() == [run.ids[0]]
        with pytest.raises(RuntimeError, match=rf"overflow: slots \[{run.ids[0]}\]"):
            run.cache.check()
        pos = 2 * PAGE + 1  # the one row the step wrote outside the scratch page
        page, off = run.cache._pages[run.ids[1]][pos // PAGE], pos % PAGE
        for t, old in zip(run.cache._storages(), pages, strict=True):
            keep = torch.ones(old.shape[:2], dtype=torch.bool, device=old.device)
            keep[page, off] = False
            assert torch.equal(t[:-1][keep], old[keep])


@pytest.mark.parametrize("path", ["absorb", "grouped"])
def test_forked_prefix_decodes_like_unshared_copies(path):
    """A prompt prefilled once and forked into two more slots (shared full pages, copied last page) decodes
    exactly as the prompt prefilled into each slot, with fewer pages."""
    gg = gen(21)
    layer = make_layer(21, path)
    L = PAGE + 5
    prompt = randn((1, L, layer.hidden_size), gg, dtype=DT)
    shared = layer.make_cache(4, L + 16, path=path, page_size=PAGE)
    plain = layer.make_cache(4, L + 16, path=path, page_size=PAGE)
    with torch.no_grad():
        layer(prompt, None, shared, seq_ids=[1])
        shared.fork(1, 3)
        shared.fork(1, 0)
        for s in (1, 3, 0):
            layer(prompt, None, plain, seq_ids=[s])
        assert shared.num_free_pages == plain.num_free_pages + 2 * 1
        for i in range(3):  # different tokens per slot: the copies diverge
            x = randn((3, 1 + i % 2, layer.hidden_size), gg, dtype=DT)
            a = layer(x, None, shared, seq_ids=[0, 1, 3])
            b = layer(x, None, plain, seq_ids=[0, 1, 3])
            assert torch.equal(a, b), f"step {i}"
    for s in (0, 1, 3):
        for u, v in zip(shared.gather(s), plain.gather(s), strict=True):
            assert torch.equal(u, v)
    shared.free([1, 3])
    with torch.no_grad():
        x = randn((1, 1, layer.hidden_size), gg, dtype=DT)
        assert torch.equal(layer(x, None, shared, seq_ids=[0]), layer(x, None, plain, seq_ids=[0]))


@pytest.mark.parametrize("path", ["absorb", "grouped"])
def test_rejected_forward_changes_no_cache_state(path):
    """Every check, the attention op's included, runs before the cache is written."""
    gg = gen(31)
    layer = make_layer(31, path)
    cache = layer.make_cache(4, 3 * PAGE, path=path, page_size=PAGE, num_pages=5)
    hs = layer.hidden_size
    with torch.no_grad():
        layer(randn((2, PAGE + 3, hs), gg, dtype=DT), None, cache, seq_ids=[2, 0])
        layer(randn((2, 1, hs), gg, dtype=DT), None, cache, seq_ids=[2, 0])
    x = randn((2, 1, hs), gg, dtype=DT)
    idx = torch.zeros(2, 1, 4, dtype=torch.int32, device=P.device)
    bad = [  # (the call's arguments, the start of its error)
        (dict(seq_ids=[2, 2]), "seq_ids"), (dict(seq_ids=[-1, 0]), "seq_ids"), (dict(seq_ids=[2, 4]), "seq_ids"),
        (dict(seq_ids=[2.0, 0]), "seq_ids"), (dict(seq_ids=[2]), "seq_ids"),
        (dict(seq_ids=torch.tensor([2, 0], device="meta")), "seq_ids"), (dict(indices=idx.long()), "indices"),
        (dict(indices=idx[:, :, :, None]), "indices"), (dict(indices=idx[:1]), "indices"),
        (dict(indices=idx.to("meta")), "indices"), (dict(topk_length=torch.ones(2, dtype=torch.int32)), "topk_length"),
        (dict(indices=idx, topk_length=torch.ones(2, dtype=torch.int64, device=P.device)), "topk_length"),
        (dict(indices=idx, topk_length=torch.ones(3, dtype=torch.int32, device=P.device)), "topk_length"),
        (dict(positions=torch.zeros(2, 2, dtype=torch.long)), "positions"),
        (dict(positions=torch.zeros(2, 1)), "positions"),
        (dict(x=x.to("meta")), "hidden_states"), (dict(x=x[..., :-1]), "hidden_states"),
        (dict(x=randn((2, 2 * PAGE, hs), gg, dtype=DT)), "num_tokens: .* > max_seqlen"),
        (dict(x=randn((2, PAGE - 3, hs), gg, dtype=DT)), "reserve: out of pages"),  # fits max_seqlen, not the pages
    ]
    for kw, err in bad:
        kw = dict(kw)
        xx = kw.pop("x", x)
        kw.setdefault("seq_ids", [2, 0])
        before = snapshot(cache)
        with pytest.raises((TypeError, ValueError), match=f"^{err}"):
            with torch.no_grad():
                layer(xx, kw.pop("positions", None), cache, **kw)
        assert_unchanged(before, cache)
    # what only the attention op rejects: a Gluon request on the grouped path / a CPU cache without Triton
    before = snapshot(cache)
    gl = copy.deepcopy(layer)
    gl.impl = "gluon"
    if path == "grouped" or not P.big:  # no Gluon GQA kernel; no Gluon kernel in the interpreter
        with pytest.raises(ValueError, match="gluon"), torch.no_grad():
            gl(x, None, cache, seq_ids=[2, 0])
        assert_unchanged(before, cache)
    if not P.big:  # the interpreter computes bf16 wrongly: the op refuses it
        bf = copy.deepcopy(layer).to(torch.bfloat16)
        bcache = bf.make_cache(4, 3 * PAGE, path=path, page_size=PAGE)
        with torch.no_grad():
            bf(x[:1].bfloat16(), None, bcache, seq_ids=[1])  # prefill: SDPA, no kernel
        before = snapshot(bcache)
        with pytest.raises(TypeError, match="bfloat16"), torch.no_grad():
            bf(x[:1].bfloat16(), None, bcache, seq_ids=[1])
        assert_unchanged(before, bcache)


# ---- GPU: CUDA graphs, inductor, host syncs ----------------------------------------------------------------
STEPS = 24
PROMPTS = [2 * 64 + 50, 45, 4 * 64 + 60, 64 + 41]  # each crosses a page boundary within STEPS steps


@pytest.mark.gpu_only
@pytest.mark.parametrize("path,sparse,slots", [("absorb", False, (3, 1, 0, 5)), ("grouped", False, None),
                                               ("absorb", True, None), ("grouped", True, (5, 0, 2, 1))])
def test_cuda_graph_decode_step_equals_eager(path, sparse, slots):
    """One decode step (projections, cache write, attention, o_proj) captured in a CUDA graph after ``reserve``,
    replayed STEPS times with growing lengths across page boundaries == eager steps of an identical layer."""
    run = Run(41, path, slots, PROMPTS, max(PROMPTS) + STEPS + 8, max_batch=90)
    for c in (run.cache, run.twin_cache):
        c.reserve(run.ids, STEPS + 1)
    x, idx = run.inputs(1, 64 if sparse else None)
    x_static, idx_static = x.clone(), None if idx is None else idx.clone()

    def step():
        return run.layer(x_static, None, run.cache, seq_ids=run.slots, indices=idx_static)

    with torch.no_grad():
        graph, y_static = capture_graph(step)  # the warm-up runs step 0 eagerly
        run.eager(x, idx)
        for i in range(STEPS):
            x, idx = run.inputs(1, 64 if sparse else None)
            x_static.copy_(x)
            if idx is not None:
                idx_static.copy_(idx)
            graph.replay()
            y_eager, y64 = run.eager(x, idx)
            assert_close(f"graph step {i}", y_static, y64, y_eager, dtype=DT)
        if slots is not None:  # the captured slot index outlives any number of other tuples
            for i in range(80):
                run.cache.slot_index([(i % 3) + 2, 1, i + 7])
            x, idx = run.inputs(1, 64 if sparse else None)
            x_static.copy_(x)
            if idx is not None:
                idx_static.copy_(idx)
            graph.replay()
            y_eager, y64 = run.eager(x, idx)
            assert_close("graph step after other slot tuples", y_static, y64, y_eager, dtype=DT)
    torch.cuda.synchronize()
    assert torch.equal(run.cache.cache_seqlens, run.twin_cache.cache_seqlens)
    assert run.cache.seqlens(run.ids) == [L + STEPS + 1 + (slots is not None) for L in PROMPTS]
    run.cache.check()


@pytest.mark.gpu_only
@pytest.mark.parametrize("path,sparse", [("absorb", False), ("grouped", True)])
def test_inductor_decode_steps_no_recompile(path, sparse):
    """torch.compile(fullgraph=True) with the default inductor backend: STEPS decode steps across page
    boundaries == eager, one graph, no recompilation."""
    run = Run(51, path, (2, 0, 4, 1), PROMPTS, max(PROMPTS) + STEPS + 8)
    for c in (run.cache, run.twin_cache):
        c.reserve(run.ids, STEPS)
    compiled_steps(run, "inductor", STEPS, 1, 64 if sparse else None)
    assert torch.equal(run.cache.cache_seqlens, run.twin_cache.cache_seqlens)
    run.cache.check()


@pytest.mark.gpu_only
@pytest.mark.parametrize("path", ["absorb", "grouped"])
def test_eager_decode_step_makes_no_host_sync(path):
    """Inside the reservation an eager decode step neither synchronizes nor copies from the host."""
    run = Run(61, path, (3, 1), PROMPTS[:2], max(PROMPTS) + 16)
    run.cache.reserve(run.ids, 8)
    xs = [run.inputs(1)[0] for _ in range(5)]
    with torch.no_grad():
        run.layer(xs[0], None, run.cache, seq_ids=[3, 1])  # kernels compiled, slot index cached
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for x in xs[1:]:
                run.layer(x, None, run.cache, seq_ids=[3, 1])
        finally:
            torch.cuda.set_sync_debug_mode("default")
    run.cache.check()


@pytest.mark.gpu_only
def test_cuda_and_cuda0_are_one_device():
    """A cache made on "cuda" serves a layer on "cuda:0" (devices compared with the index resolved)."""
    layer = make_layer(71, "absorb")
    for dev in ("cuda", torch.device("cuda"), f"cuda:{torch.cuda.current_device()}"):
        cache = layer.make_cache(2, 2 * PAGE, page_size=PAGE, device=dev)
        assert cache.device == torch.device("cuda", torch.cuda.current_device())
        with torch.no_grad():
            for T in (5, 1):
                layer(randn((2, T, layer.hidden_size), gen(T), dtype=DT, device="cuda:0"), None, cache)
        assert cache.seqlens() == [6, 6]
