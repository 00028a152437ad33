"""Paged KV caches (LatentCache / GroupedCache): paging invariants under random reserve / append / free / fork
against a host model; rejected calls change nothing; scratch-page overflow flagged by check(); the append
write-plan kernel against its torch twin (and inside the tensors it is given)."""

import copy
import math
import pickle

import pytest
import torch
from harness import P, gen, randn, seeds
from hypothesis import given
from hypothesis import strategies as st

from gqla_triton.layers.cache import GroupedCache, LatentCache
from gqla_triton.layers.paged_append import append_rows, append_rows_torch

PS = 16
R, DR, G, DH, DV = 16, 16, 2, 16, 16  # latent / rope / grouped widths (tiny: bookkeeping, not math)


def make_cache(kind, max_batch=4, max_seqlen=40, num_pages=7, **kw):
    if kind == "latent":
        return LatentCache(max_batch, max_seqlen, R, DR, page_size=PS, num_pages=num_pages, dtype=torch.float32,
                           device=P.device, **kw)
    return GroupedCache(max_batch, max_seqlen, G, DH, DR, DV, page_size=PS, num_pages=num_pages,
                        dtype=torch.float32, device=P.device, **kw)


def new_tokens(kind, B, T, gg):
    """Random new tokens for ``append`` and their flat host form [B, T, width] (what ``gather`` returns)."""
    if kind == "latent":
        parts = [randn((B, T, R), gg), randn((B, T, DR), gg)]
    else:
        parts = [randn((B, T, G, DH), gg), randn((B, T, G, DV), gg), randn((B, T, DR), gg)]
    return parts, torch.cat([p.reshape(B, T, -1).cpu() for p in parts], -1)


def gathered(cache, s):
    return torch.cat([t.reshape(t.shape[0], -1).cpu() for t in cache.gather(s)], -1)


def snapshot(cache) -> dict:
    """Every attribute of the cache: tensors cloned, host structures deep-copied."""
    out = {}
    for k, v in vars(cache).items():
        if isinstance(v, torch.Tensor):
            out[k] = v.clone()
        elif isinstance(v, dict):
            out[k] = {kk: None if t is None else t.clone() for kk, t in v.items()}
        else:
            out[k] = copy.deepcopy(v)
    return out


def assert_unchanged(before: dict, cache) -> None:
    after = snapshot(cache)
    assert before.keys() == after.keys()
    for k, v in before.items():
        w = after[k]
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, w), f"{k} changed"
        elif isinstance(v, dict):
            assert v.keys() == w.keys(), f"{k} changed"
            assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(v.values(), w.values(),
                                                                                        strict=True)), k
        else:
            assert v == w, f"{k} changed: {v!r} -> {w!r}"


def rejected(cache, exc, match, fn, *args, **kw):
    """``fn(*args, **kw)`` raises ``exc`` with a message matching ``match`` and leaves the cache as it was."""
    before = snapshot(cache)
    with pytest.raises(exc, match=match):
        fn(*args, **kw)
    assert_unchanged(before, cache)


class Model:
    """Host model of a cache: tokens per slot and, per slot, the identities of its pages (shared ids after
    a fork), independent of the cache's own bookkeeping."""

    def __init__(self, max_batch, max_seqlen, num_pages):
        self.tokens = [torch.zeros(0, 0) for _ in range(max_batch)]
        self.pages = [[] for _ in range(max_batch)]
        self.holds = [False] * max_batch
        self.max_seqlen, self.num_pages, self.next_id = max_seqlen, num_pages, 0

    def length(self, s):
        return self.tokens[s].shape[0]

    def used(self):
        return len({p for ps in self.pages for p in ps})

    def need(self, ids, counts):
        """Pages to take, or None when the reservation must fail."""
        need = []
        for s, n in zip(ids, counts, strict=True):
            if self.length(s) + n > self.max_seqlen:
                return None
            need.append(max(0, math.ceil((self.length(s) + n) / PS) - len(self.pages[s])))
        return need if sum(need) <= self.num_pages - self.used() else None

    def take(self, ids, need):
        for s, k in zip(ids, need, strict=True):
            for _ in range(k):
                self.pages[s].append(self.next_id)
                self.next_id += 1


def check_invariants(cache, model):
    mb = cache.max_batch
    lens = [model.length(s) for s in range(mb)]
    assert cache.seqlens() == lens and cache.cache_seqlens.tolist() == lens
    assert cache.holds_tokens() == model.holds
    assert not bool(cache.overflow.any())
    # the cache's pages mirror the model's page identities: a bijection (sharing exactly where the model shares)
    ident = {}
    for s in range(mb):
        assert len(cache._pages[s]) == len(model.pages[s])
        for mid, p in zip(model.pages[s], cache._pages[s], strict=True):
            assert ident.setdefault(mid, p) == p
    assert len(set(ident.values())) == len(ident)
    used = set(ident.values())
    assert all(0 <= p < cache.num_pages for p in used)
    assert sorted(cache._free + sorted(used)) == list(range(cache.num_pages)) and not used & set(cache._free)
    assert cache.num_free_pages == cache.num_pages - model.used()
    counts = {}
    for s in range(mb):
        for p in cache._pages[s]:
            counts[p] = counts.get(p, 0) + 1
    assert all(cache._refs[p] == counts.get(p, 0) for p in range(cache.num_pages))
    bt = cache.block_table.cpu()
    for s in range(mb):
        n = len(cache._pages[s])
        assert bt[s, :n].tolist() == cache._pages[s]
        assert bool((bt[s, n:] == cache.scratch_page).all())
        # copy-on-write: a shared page is full in every slot that uses it (appends never write it again)
        for k, p in enumerate(cache._pages[s]):
            if counts[p] > 1:
                assert (k + 1) * PS <= lens[s]
        assert cache.reserved([s]) == [min(n * PS, cache.max_seqlen)]
        if lens[s]:
            assert torch.equal(gathered(cache, s), model.tokens[s])


NO_ROOM = r"^(reserve: out of pages|num_tokens: slot \d+ would hold \d+ tokens > max_seqlen)"


@given(kind=st.sampled_from(["latent", "grouped"]), seed=seeds())
def test_random_operations_keep_paging_invariants(kind, seed):
    gg = gen(seed)
    mb, ms, npg = 4, 40, 7
    cache = make_cache(kind, mb, ms, npg)
    model = Model(mb, ms, npg)

    def rint(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=gg))

    for _ in range(14):
        op = ["append", "append", "reserve", "free", "fork"][rint(0, 4)]
        ids = torch.randperm(mb, generator=gg)[: rint(1, 3)].tolist()
        if op == "append":
            T = rint(1, 20)
            parts, flat = new_tokens(kind, len(ids), T, gg)
            need = model.need(ids, [T] * len(ids))
            if need is None:
                rejected(cache, ValueError, NO_ROOM, cache.append, ids, *parts)
            else:
                cache.append(ids, *parts)
                model.take(ids, need)
                for b, s in enumerate(ids):
                    model.tokens[s] = torch.cat([model.tokens[s].reshape(-1, flat.shape[-1]), flat[b]])
                    model.holds[s] = True
        elif op == "reserve":
            counts = [rint(0, 30) for _ in ids]
            need = model.need(ids, counts)
            if need is None:
                rejected(cache, ValueError, NO_ROOM, cache.reserve, ids, counts)
            else:
                cache.reserve(ids, counts)
                model.take(ids, need)
        elif op == "free":
            cache.free(ids)
            for s in ids:
                model.tokens[s], model.pages[s], model.holds[s] = torch.zeros(0, 0), [], False
        else:
            src, dst = ids[0], rint(0, mb - 1)
            full, part = divmod(model.length(src), PS)
            if src == dst or model.pages[dst] or model.holds[dst] or (part and model.used() == npg):
                rejected(cache, ValueError, r"^(dst: |fork: out of pages)", cache.fork, src, dst)
            else:
                cache.fork(src, dst)
                model.pages[dst] = model.pages[src][:full]
                if part:
                    model.take([dst], [1])
                model.tokens[dst], model.holds[dst] = model.tokens[src].clone(), model.holds[src]
        check_invariants(cache, model)
    cache.free(range(mb))
    assert cache.num_free_pages == npg and all(r == 0 for r in cache._refs)


@pytest.mark.parametrize("kind", ["latent", "grouped"])
def test_rejected_calls_change_nothing(kind):
    gg = gen(0)
    cache = make_cache(kind, 4, 40, 7)
    parts, _ = new_tokens(kind, 2, 5, gg)
    cache.append([1, 3], *parts)
    cache.reserve([0], 3)
    good, _ = new_tokens(kind, 2, 3, gg)
    first = "c_kv" if kind == "latent" else "k"  # the first new-token tensor: its batch is checked against the ids
    for bad_ids, exc, match in (([-1, 0], ValueError, r"^seq_ids: slot -1 outside"),
                                ([0, 4], ValueError, r"^seq_ids: slot 4 outside"),
                                ([2, 2], ValueError, r"^seq_ids: duplicate slots"),
                                ([0.0, 1], TypeError, r"^seq_ids: expected int slot ids, got float"),
                                ([True, 0], TypeError, r"^seq_ids: expected int slot ids, got bool"),
                                (["0", 1], TypeError, r"^seq_ids: expected int slot ids, got str"),
                                ([0], ValueError, rf"^{first}: expected shape \[1, "),
                                ([0, 1, 2], ValueError, rf"^{first}: expected shape \[3, "),
                                (torch.tensor([0.0, 1.0]), TypeError, r"^seq_ids: expected an integer tensor"),
                                ("01", TypeError, r"^seq_ids: expected None, .* got str"),
                                (3.0, TypeError, r"^seq_ids: expected None, .* got float")):
        rejected(cache, exc, match, cache.append, bad_ids, *good)
    rejected(cache, ValueError, r"^seq_ids: 5 sequences need 5 slots", cache.append, None,
             *new_tokens(kind, 5, 1, gg)[0])  # more sequences than slots
    names = ["c_kv", "k_rope"] if kind == "latent" else ["k", "v", "k_rope"]
    for name, t in zip(names, good, strict=True):  # wrong shape, dtype and device of each new-token tensor
        for bad, exc, match in ((t[:, :, None], ValueError, "expected shape"), (t[:1], ValueError, "expected shape"),
                                (t[..., :-1], ValueError, "expected shape"),
                                (t.to(torch.int32), TypeError, "expected a floating tensor"),
                                (t.to("meta"), ValueError, "expected a tensor on the cache's device"),
                                (t.tolist(), TypeError, "expected a torch.Tensor")):
            args = list(good)
            args[names.index(name)] = bad
            rejected(cache, exc, f"^{name}: {match}", cache.append, [0, 2], *args)
    # past max_seqlen (slot 1 holds 5 of 40 tokens; the 3 pages it would need are free)
    rejected(cache, ValueError, r"^num_tokens: slot 1 would hold 41 tokens > max_seqlen 40", cache.append, [1],
             *new_tokens(kind, 1, 36, gg)[0])
    rejected(cache, ValueError, r"^reserve: out of pages", cache.append, [0, 2],
             *new_tokens(kind, 2, 33, gg)[0])  # out of pages (7)
    for args, exc, match in ((([0], 41), ValueError, r"^num_tokens: slot 0 would hold 41 tokens > max_seqlen"),
                             (([0, 2], [40, 40]), ValueError, r"^reserve: out of pages"),
                             (([0], -1), ValueError, r"^num_tokens: expected counts in"),
                             (([0], [1, 2]), ValueError, r"^num_tokens: expected 1 counts"),
                             (([0], 1.5), TypeError, r"^num_tokens: expected an int or a sequence of ints"),
                             (([0], [True]), TypeError, r"^num_tokens: expected ints, got bool"),
                             (([-1], 1), ValueError, r"^seq_ids: slot -1 outside"),
                             ((None, 1), ValueError, r"^seq_ids: required")):
        rejected(cache, exc, match, cache.reserve, *args)
    for args, exc, match in (((1, 1), ValueError, r"^dst: expected a slot other than src"),
                             ((0, 3), ValueError, r"^dst: slot 3 holds pages or tokens"),
                             ((1, 0), ValueError, r"^dst: slot 0 holds pages or tokens"),
                             ((-1, 2), ValueError, r"^src: slot -1 outside"),
                             ((1, 4), ValueError, r"^dst: slot 4 outside"),
                             ((1.0, 2), TypeError, r"^src: expected an int slot id")):  # dst holds, bad slots
        rejected(cache, exc, match, cache.fork, *args)
    for bad_ids, exc, match in (([-1], ValueError, r"^seq_ids: slot -1 outside"),
                                ([1, 1], ValueError, r"^seq_ids: duplicate slots"),
                                ([4], ValueError, r"^seq_ids: slot 4 outside"),
                                (["a"], TypeError, r"^seq_ids: expected int slot ids, got str")):
        rejected(cache, exc, match, cache.free, bad_ids)
        rejected(cache, exc, match, cache.tables, bad_ids)
        rejected(cache, exc, match, cache.seqlens, bad_ids)
    for s, exc, match in ((-1, ValueError, r"^seq_id: slot -1 outside"), (4, ValueError, r"^seq_id: slot 4 outside"),
                          (1.0, TypeError, r"^seq_id: expected an int slot id"),
                          (True, TypeError, r"^seq_id: expected an int slot id")):
        rejected(cache, exc, match, cache.gather, s)
    cache.free([0, 1, 3])
    cache.reserve([0, 1, 2, 3], 16)  # 4 of 7 pages
    cache.append([1, 3], *new_tokens(kind, 2, 5, gg)[0])
    cache.reserve([0], 40)
    cache.reserve([2], 16)
    cache.free([1])
    cache.reserve([2], 40)  # every page taken
    assert cache.num_free_pages == 0
    rejected(cache, ValueError, r"^fork: out of pages", cache.fork, 3, 1)  # the partly filled page needs a copy


def test_cache_constructor_checks():
    for kw, exc in ((dict(max_batch=0), ValueError), (dict(max_seqlen=0), ValueError),
                    (dict(page_size=8), ValueError), (dict(page_size=24), ValueError), (dict(num_pages=0), ValueError),
                    (dict(max_batch=2.0), TypeError), (dict(auto_reserve=1), TypeError),
                    (dict(dtype=torch.int32), TypeError)):
        args = dict(max_batch=2, max_seqlen=32, page_size=16) | kw
        with pytest.raises(exc, match=f"^{next(iter(kw))}: "):
            LatentCache(args.pop("max_batch"), args.pop("max_seqlen"), 16, 16, device=P.device, **args)


@pytest.mark.parametrize("kind", ["latent", "grouped"])
def test_overflow_goes_to_the_scratch_page_and_check_raises(kind):
    """With ``auto_reserve=False`` every append runs as inside a captured step: past the reservation (or
    max_seqlen) tokens land on the scratch page only, the length stops at the reservation, ``check`` raises."""
    gg = gen(1)
    cache = make_cache(kind, 3, 40, 7, auto_reserve=False)
    cache.reserve([0, 1, 2], [16, 40, 5])  # 1, 3 and 1 pages
    assert cache.reserved() == [16, 40, 16]
    first, flat0 = new_tokens(kind, 3, 10, gg)
    cache.append(None, *first)
    cache.check()
    pages = [list(p) for p in cache._pages]
    storage = [t.clone() for t in cache._storages()]
    more, flat1 = new_tokens(kind, 3, 35, gg)  # slot 0: 6 fit; slot 1: max_seqlen 40 stops it at 40; slot 2: 6 fit
    cache.append([0, 1, 2], *more)
    assert cache.seqlens() == [16, 40, 16] == cache.cache_seqlens.tolist()
    assert cache.overflow.tolist() == [True, True, True]
    with pytest.raises(RuntimeError, match=r"slots \[0, 1, 2\]"):
        cache.check()
    assert [list(p) for p in cache._pages] == pages  # nothing reserved by the append
    for s, n in enumerate([6, 30, 6]):
        assert torch.equal(gathered(cache, s), torch.cat([flat0[s], flat1[s, :n]]))
    # every row outside the written positions is untouched, except on the scratch page
    for t, old in zip(cache._storages(), storage, strict=True):
        written = torch.zeros(t.shape[:2], dtype=torch.bool)
        for s in range(3):
            for pos in range(10, cache.seqlens([s])[0]):
                written[cache._pages[s][pos // PS], pos % PS] = True
        written[cache.scratch_page] = True
        keep = ~written.to(t.device)
        assert torch.equal(t[keep], old[keep])
    cache.free([0, 1])
    with pytest.raises(RuntimeError, match=r"slots \[2\]"):
        cache.check()
    cache.free([2])
    cache.check()


def test_no_auto_reserve_copies_a_shared_page_it_would_write():
    """``auto_reserve=False``: an eager append into a page shared by ``fork`` (the forked slot's length moved back
    from outside, within its reservation) copies that page first, so the source slot keeps its tokens; it takes no
    page for its tokens."""
    gg = gen(5)
    cache = make_cache("latent", 2, 40, 7, auto_reserve=False)
    cache.reserve([0], 20)
    parts, flat = new_tokens("latent", 1, 20, gg)
    cache.append([0], *parts)
    cache.fork(0, 1)  # page 0 shared, the partly filled page 1 copied
    cache.cache_seqlens[1] = 10
    new, nflat = new_tokens("latent", 1, 3, gg)
    free = cache.num_free_pages
    cache.append([1], *new)
    assert torch.equal(gathered(cache, 0), flat[0])
    assert torch.equal(gathered(cache, 1), torch.cat([flat[0, :10], nflat[0]]))
    assert cache.num_free_pages == free - 1 and cache.reserved([1]) == [32]
    cache.check()


def test_eager_calls_follow_outside_writes_of_the_lengths():
    """Eager appends take lengths from a host mirror; a write to ``cache_seqlens`` from outside the cache (a
    benchmark restoring lengths) is seen through the tensor's version counter."""
    gg = gen(2)
    cache = make_cache("latent", 2, 64, 8)
    parts, flat = new_tokens("latent", 2, 20, gg)
    cache.append(None, *parts)
    saved = cache.cache_seqlens.clone()
    cache.append(None, *new_tokens("latent", 2, 30, gg)[0])
    cache.cache_seqlens.copy_(saved)  # back to 20 tokens each
    assert cache.seqlens() == [20, 20]
    more, flat2 = new_tokens("latent", 2, 44, gg)  # 64 in all: fits only if the lengths are read as 20
    cache.append(None, *more)
    for s in range(2):
        assert torch.equal(gathered(cache, s), torch.cat([flat[s], flat2[s]]))
    cache.check()


@pytest.mark.parametrize("copier", [copy.deepcopy, lambda c: pickle.loads(pickle.dumps(c))])
def test_a_copied_cache_follows_outside_writes_of_its_lengths(copier):
    """A copy's ``cache_seqlens`` is a new tensor whose version counter restarts: outside writes to it, as many as
    the source's counter had seen, are still seen (the host mirror never outlives the lengths it mirrors)."""
    gg = gen(3)
    cache = make_cache("latent", 2, 64, 8)
    cache.append(None, *new_tokens("latent", 2, 12, gg)[0])
    for _ in range(6):  # outside writes (of the same length) move the source's counter on
        cache.cache_seqlens[1] = 12
    assert cache.seqlens() == [12, 12]
    dup = copier(cache)
    while dup.cache_seqlens._version < cache.cache_seqlens._version:  # the copy's counter meets the source's
        dup.cache_seqlens[0] = 5
    assert dup.seqlens() == [5, 12] and cache.seqlens() == [12, 12]


@pytest.mark.parametrize("kind", ["latent", "grouped"])
def test_fork_shares_full_pages_and_copies_the_last(kind):
    gg = gen(3)
    cache = make_cache(kind, 4, 64, 12)
    parts, flat = new_tokens(kind, 1, 37, gg)  # 2 full pages + 5 tokens
    cache.append([0], *parts)
    cache.fork(0, 2)
    assert cache._pages[2][:2] == cache._pages[0][:2] and cache._pages[2][2] != cache._pages[0][2]
    assert cache.num_free_pages == 12 - 4 and cache.seqlens([0, 2]) == [37, 37]
    a, fa = new_tokens(kind, 2, 20, gg)
    cache.append([2, 0], *a)  # both grow past their copied / own partial page
    assert torch.equal(gathered(cache, 0), torch.cat([flat[0], fa[1]]))
    assert torch.equal(gathered(cache, 2), torch.cat([flat[0], fa[0]]))
    cache.free([0])
    assert torch.equal(gathered(cache, 2), torch.cat([flat[0], fa[0]]))  # shared pages survive src's free
    cache.fork(2, 1)  # a fork of a fork
    cache.free([2])
    assert torch.equal(gathered(cache, 1), torch.cat([flat[0], fa[0]]))
    cache.free([1])
    assert cache.num_free_pages == 12 and all(r == 0 for r in cache._refs)
    empty = make_cache(kind, 2, 32, 2)
    empty.fork(0, 1)  # an empty source: nothing shared, nothing copied
    assert empty.seqlens() == [0, 0] and empty.holds_tokens() == [False, False] and empty.num_free_pages == 2


def test_from_latent_keeps_the_slot_structure():
    from gqla_triton.layers.gqla import GQLAttention

    layer = GQLAttention(32, 4, 2, 16, 16, 16, device=P.device, dtype=torch.float32)
    lat = LatentCache(3, 48, 16, 16, page_size=PS, num_pages=8, dtype=torch.float32, device=P.device)
    gg = gen(4)
    lat.append([0], randn((1, 21, 16), gg), randn((1, 21, 16), gg))
    lat.fork(0, 2)
    lat.reserve([1], 3)
    grp = GroupedCache.from_latent(lat, layer)
    for name in ("_free", "_refs", "_pages", "_holds"):
        assert getattr(grp, name) == getattr(lat, name)
    for name in ("block_table", "cache_seqlens", "overflow"):
        assert torch.equal(getattr(grp, name), getattr(lat, name))
    assert grp.seqlens() == [21, 0, 21] and grp.k.shape[0] == lat.kv.shape[0] == 9


def test_slot_id_forms():
    cache = make_cache("latent", 5, 32, 10)
    for ids, want in ((3, (3,)), ([4, 1], (4, 1)), ((2,), (2,)), (range(1, 3), (1, 2)),
                      (torch.tensor([0, 4]), (0, 4)), (torch.tensor(2), (2,)), (None, tuple(range(5)))):
        assert cache._slots(ids) == want if ids is not None else cache._slots(None, 5) == want
    assert cache.slot_index([0, 1, 2]) is None  # a prefix: rows are a slice
    idx = cache.slot_index([3, 1])
    assert idx.tolist() == [3, 1] and idx.dtype == torch.long and idx.device == cache.device
    assert cache.slot_index((3, 1)) is idx  # cached per tuple
    bt, sl = cache.tables([3, 1])
    assert torch.equal(bt, cache.block_table[[3, 1]]) and torch.equal(sl, cache.cache_seqlens[[3, 1]])
    with pytest.raises(TypeError, match=r"^seq_ids: expected host slot ids .* on meta"):
        cache.tables(torch.tensor([0], device="meta"))
    from gqla_triton.layers.cache import _INDEX_CACHE_SIZE as N

    big = make_cache("latent", N + 8, 32, 8)
    for i in range(N + 4):  # more tuples than are kept: the oldest go first, prefixes stay
        big.slot_index([i + 1, 0])
        big.slot_index(list(range(i % 5 + 1)))
    kept = [k for k, v in big._index.items() if v is not None]
    assert len(kept) == N and kept[0] == (5, 0) and (N + 4, 0) in big._index
    assert all(tuple(range(n)) in big._index for n in range(1, 6))


# ---- the append write plan ------------------------------------------------------------------------------
@given(B=st.integers(1, 5), T=st.integers(1, 40), slots=st.booleans(), seed=seeds())
def test_append_rows_kernel_equals_torch_twin(B, T, slots, seed):
    """Random (also corrupt) tables, lengths and flags: the kernel and the torch plan agree on every row and
    update lengths and flags alike; rows always lie inside the storage."""
    gg = gen(seed)
    mb, mp, npg = 5, 4, 9
    bt = torch.randint(-2, npg + 3, (mb, mp), generator=gg, dtype=torch.int32)
    sl = torch.randint(-3, mp * PS + 5, (mb,), generator=gg, dtype=torch.int32)
    ov = torch.rand(mb, generator=gg) < 0.3
    ms = int(torch.randint(1, mp * PS + 1, (1,), generator=gg))
    idx = torch.randperm(mb, generator=gg)[:B].to(P.device) if slots else None
    a = [t.to(P.device, copy=True) for t in (bt, sl, ov)]
    b = [t.clone() for t in a]
    ra = append_rows(*a, idx, B, T, max_seqlen=ms, num_pages=npg, page_size=PS)
    rb = append_rows_torch(*b, idx, B, T, max_seqlen=ms, num_pages=npg, page_size=PS)
    assert torch.equal(ra, rb)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)
    assert int(ra.min()) >= 0 and int(ra.max()) < (npg + 1) * PS
    # a scalar oracle of the plan (module docstring of paged_append)
    want_sl, want_ov = sl.tolist(), ov.tolist()
    for b in range(B):
        s = int(idx[b]) if slots else b
        n = 0
        for t in range(T):
            pos = sl[s].item() + t
            blk = bt[s, pos // PS].item() if 0 <= pos < ms and pos // PS < mp else -1
            landed = 0 <= blk < npg
            n += landed
            assert ra[b * T + t].item() == (blk * PS + pos % PS if landed else npg * PS + t % PS)
        want_sl[s] += n
        want_ov[s] |= n < T
    assert a[1].tolist() == want_sl and a[2].tolist() == want_ov


@pytest.mark.skipif(P.big, reason="checks every address the interpreter dereferences")
def test_append_rows_kernel_stays_inside_its_tensors(monkeypatch):
    """Every address the kernel forms where unmasked lies inside the tensors it is given (corrupt tables)."""
    import numpy as np
    from triton.runtime import interpreter as ti

    ranges, bad = [], []

    def check(ptrs, mask, what):
        a = ptrs.data[np.broadcast_to(mask.data, ptrs.data.shape)].astype(np.uint64)
        if a.size:
            r = np.array(ranges, dtype=np.uint64)
            if not ((a[:, None] >= r[None, :, 0]) & (a[:, None] < r[None, :, 1])).any(1).all():
                bad.append(what)

    load, store = ti.InterpreterBuilder.create_masked_load, ti.InterpreterBuilder.create_masked_store
    monkeypatch.setattr(ti.InterpreterBuilder, "create_masked_load",
                        lambda self, p, m, o, c, v: (check(p, m, "load"), load(self, p, m, o, c, v))[1])
    monkeypatch.setattr(ti.InterpreterBuilder, "create_masked_store",
                        lambda self, p, x, m, c: (check(p, m, "store"), store(self, p, x, m, c))[1])
    from gqla_triton.layers import paged_append as pa

    alloc = pa.empty

    def reg(*a, **kw):
        t = alloc(*a, **kw)
        ranges.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))
        return t

    monkeypatch.setattr(pa, "empty", reg)
    gg = gen(5)
    for T in (1, 3, 37):
        bt = torch.tensor([[-(2**31), 2**31 - 1, 3], [9, -1, 0], [1, 2, 8]], dtype=torch.int32)
        sl = torch.tensor([2**31 - 1, -(2**31), 40], dtype=torch.int32)
        ov = torch.zeros(3, dtype=torch.bool)
        idx = torch.randperm(3, generator=gg)[:2]
        ranges[:] = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in (bt, sl, ov, idx)]
        for slots in (idx, None):
            rows = append_rows(bt, sl, ov, slots, 2, T, max_seqlen=48, num_pages=9, page_size=PS)
            assert int(rows.min()) >= 0 and int(rows.max()) < 10 * PS
    assert not bad, f"out-of-bounds {sorted(set(bad))}"


def test_gather_without_a_rope_key():
    """rope_dim 0 (allowed by both caches): gather returns [L, 0] rope keys beside the written rows."""
    d = dict(page_size=16, dtype=torch.float32, device=P.device)
    for cache, rows in ((LatentCache(2, 40, 32, 0, **d), (torch.randn(1, 19, 32),)),
                        (GroupedCache(2, 40, 2, 16, 0, **d), (torch.randn(1, 19, 2, 16), torch.randn(1, 19, 2, 16)))):
        rows = tuple(r.to(P.device) for r in rows)
        cache.append([1], *rows, torch.zeros(1, 19, 0, device=P.device))
        got = cache.gather(1)
        assert got[-1].shape == (19, 0)
        for a, b in zip(got[:-1], rows, strict=True):
            assert torch.equal(a, b[0])


@pytest.mark.parametrize("kind", ["latent", "grouped"])
def test_append_of_the_caches_own_rows(kind):
    """New tokens that are views of the cache's own storage (a slot's tokens appended to another slot) append as
    copies of those values would."""
    got, want = make_cache(kind), make_cache(kind)
    first, _ = new_tokens(kind, 1, 3, gen(1))
    if kind == "latent":
        views = lambda c: (c.kv[int(c.block_table[0, 0]), None, :3, 0, :R],  # noqa: E731
                           c.kv[int(c.block_table[0, 0]), None, :3, 0, R:])
    else:
        views = lambda c: tuple(t[int(c.block_table[0, 0]), None, :3] for t in (c.k, c.v, c.k_rope))  # noqa: E731
    for c in (got, want):
        c.append([0], *first)
    got.append([1], *views(got))
    want.append([1], *(t.clone() for t in views(want)))
    assert got.seqlens() == want.seqlens() == [3, 3, 0, 0]
    assert all(torch.equal(a, b) for a, b in zip(got.gather(1), want.gather(1), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(got.gather(1), got.gather(0), strict=True))


@pytest.mark.parametrize("kind", ["latent", "grouped"])
@pytest.mark.parametrize("length", [-5, 17])
def test_outside_length_past_the_reservation_is_refused(kind, length):
    """A length written into ``cache_seqlens`` from outside the cache that leaves the slot's reservation (one page
    here) makes the next eager call a ValueError naming cache_seqlens, with the pages and tables unchanged."""
    c = make_cache(kind)
    parts, _ = new_tokens(kind, 1, 3, gen(2))
    c.append([0], *parts)
    c.cache_seqlens[0] = length
    snap = (list(c._free), list(c._refs), [list(p) for p in c._pages], c.block_table.clone())
    for call in (lambda: c.append([0], *parts), lambda: c.fork(0, 1), lambda: c.reserve([0], 4)):
        with pytest.raises(ValueError, match="cache_seqlens: slot 0 holds"):
            call()
        assert snap[:3] == (list(c._free), list(c._refs), [list(p) for p in c._pages])
        assert torch.equal(snap[3], c.block_table)


def test_append_of_rows_of_another_storage_of_the_cache():
    """A grouped append whose v is a view of the cache's k storage (another storage than v's) appends the values
    the view held before the call, not the k rows the same call writes first."""
    got, want = make_cache("grouped"), make_cache("grouped")
    assert DV == DH
    first, _ = new_tokens("grouped", 1, 5, gen(3))
    new, _ = new_tokens("grouped", 1, 5, gen(4))
    for c in (got, want):
        c.append([0], *first)
        c.reserve([1], 5)
    page = int(got.block_table[1, 0])  # slot 1's page, written by the append below, holds old rows now
    got.k[page, :5] = randn((5, G, DH), gen(5))
    want.k[page, :5] = got.k[page, :5]
    got.append([1], new[0], got.k[page, None, :5], new[2])
    want.append([1], new[0], want.k[page, None, :5].clone(), new[2])
    assert all(torch.equal(a, b) for a, b in zip(got.gather(1), want.gather(1), strict=True))


@pytest.mark.parametrize("kind", ["latent", "grouped"])
def test_length_moved_back_into_forked_pages_copies_them_before_writing(kind):
    """After ``fork`` the slots share their full pages; a length moved back from outside into a shared page (within
    the reservation) makes the next append copy that page first: the sibling's tokens stay, and the slot reads
    what a slot that never shared would."""
    c, alone = make_cache(kind, num_pages=8), make_cache(kind, num_pages=8)
    parts, _ = new_tokens(kind, 1, 20, gen(6))
    more, _ = new_tokens(kind, 1, 3, gen(7))
    c.append([0], *parts)
    c.fork(0, 1)
    alone.append([1], *parts)
    before = gathered(c, 0)
    free = c.num_free_pages
    for x in (c, alone):
        x.cache_seqlens[1] = 10
        x.append([1], *more)
    assert torch.equal(gathered(c, 0), before)
    assert torch.equal(gathered(c, 1), gathered(alone, 1))
    assert c.seqlens([0, 1]) == [20, 13] and c.num_free_pages == free - 1
    assert c._refs[int(c.block_table[0, 0])] == 1 and not c._shared
    c.free([0, 1])
    assert c.num_free_pages == 8  # every page back, none lost or freed twice


def test_an_append_that_cannot_copy_a_shared_page_changes_nothing():
    c = make_cache("latent", num_pages=3)
    parts, _ = new_tokens("latent", 1, 20, gen(8))
    more, _ = new_tokens("latent", 1, 3, gen(9))
    c.append([0], *parts)
    c.fork(0, 1)  # page 0 shared, page 1 copied: no page left
    c.cache_seqlens[1] = 10
    assert c.seqlens([1]) == [10]  # the host mirror follows the outside write
    before = snapshot(c)
    with pytest.raises(ValueError, match="shared with a forked slot"):
        c.append([1], *more)
    assert_unchanged(before, c)


def test_a_cache_made_in_inference_mode_refuses_updates_outside_it():
    """Inference tensors are updated in place only inside inference mode: a host call or an append outside it is
    refused before any change (torch would raise half-way, after pages were taken); inside it works."""
    with torch.inference_mode():
        c = make_cache("latent")
    parts, _ = new_tokens("latent", 1, 3, gen(10))
    before = snapshot(c)
    for call in (lambda: c.reserve([0], 20), lambda: c.append([0], *parts), lambda: c.free([0]),
                 lambda: c.fork(0, 1)):
        with pytest.raises(RuntimeError, match="made under torch.inference_mode"):
            call()
    assert_unchanged(before, c)
    with torch.inference_mode():
        c.append([0], *parts)
        c.fork(0, 1)
    assert c.seqlens([0, 1]) == [3, 3]


def test_constructor_and_query_refusals_name_the_argument():
    with pytest.raises(ValueError, match="device: expected a torch.device"):
        LatentCache(1, 32, R, DR, page_size=PS, device="gpu")
    with pytest.raises(ValueError, match="device: expected a device with storage, got meta"):
        GroupedCache(1, 32, G, DH, DR, DV, page_size=PS, device="meta")
    for bad in (1e39, 3.5e38, 1e-45):
        with pytest.raises(ValueError, match="k_scale"):
            LatentCache(1, 32, R, DR, page_size=PS, dtype=torch.float8_e4m3fn, k_scale=bad, device=P.device)
    c = make_cache("grouped")
    with pytest.raises(ValueError, match="slot 1099511627776 outside"):
        c.seqlens([2**40])
    parts, _ = new_tokens("grouped", 1, 3, gen(11))
    c.append([0], *parts)
    for length in (1000, -5):  # an outside length is checked by gather as by every eager call
        c.cache_seqlens[0] = length
        with pytest.raises(ValueError, match="cache_seqlens: slot 0 holds"):
            c.gather(0)


def test_new_tokens_that_view_the_caches_own_lengths_or_table_are_read_before_the_append_moves_them():
    """Keys that are a view of ``cache_seqlens`` or ``block_table`` are stored as they were when the call was made
    (the append advances the lengths and reserves pages before it copies the rows)."""
    c = GroupedCache(4, 64, 1, 4, 0, page_size=16, dtype=torch.float32, device=P.device)
    c.append([0], torch.ones(1, 5, 1, 4, device=P.device), torch.ones(1, 5, 1, 4, device=P.device),
             torch.zeros(1, 5, 0, device=P.device))
    for own, slot in ((c.cache_seqlens, 1), (c.block_table[2], 2)):
        k = own.view(torch.float32).view(1, 1, 1, 4)
        want = k.clone()
        c.append([slot], k, torch.zeros(1, 1, 1, 4, device=P.device), torch.zeros(1, 1, 0, device=P.device))
        assert torch.equal(c.gather(slot)[0].view(torch.int32), want[0].view(torch.int32))


def test_lengths_written_from_outside_under_inference_mode_are_seen():
    """Under ``torch.inference_mode()`` too, a length moved back from outside (within the slot's reservation) is
    seen by the next append: the page shared with a forked slot is copied before it is written, and an eager
    append that needs a page takes one (no overflow)."""
    with torch.inference_mode():
        c = LatentCache(2, 64, 16, 16, page_size=16, num_pages=8, dtype=torch.float32, device=P.device)
        c.append([0], torch.randn(1, 20, 16, device=P.device), torch.randn(1, 20, 16, device=P.device))
        c.fork(0, 1)
        before = c.gather(0)[0].clone()
        c.cache_seqlens[1] = 10
        c.append([1], torch.full((1, 3, 16), 7.0, device=P.device), torch.full((1, 3, 16), 7.0, device=P.device))
        assert torch.equal(c.gather(0)[0], before)
        assert c.seqlens() == c.cache_seqlens.tolist() == [20, 13]
        c.cache_seqlens[0] = 15
        c.append([0], torch.ones(1, 4, 16, device=P.device), torch.ones(1, 4, 16, device=P.device))
        assert c.seqlens([0]) == [19] and not bool(c.overflow[0])
        c.check()


def test_new_tokens_must_be_dense_and_float8_values_reach_every_cache_kind():
    """Sparse or nested new tokens are refused by name (``TypeError``) before any change, with or without
    ``seq_ids``; float8 values are taken by every cache kind, the FP8 latent layout included (widened exactly, so
    the stored rows are those of the same values in float32)."""
    kinds = [LatentCache(2, 64, 512, 64, page_size=16, dtype=dt, device=P.device, **kw)
             for dt, kw in ((torch.float32, {}), (torch.float8_e4m3fn, {}), (torch.float8_e4m3fn, {"k_scale": 1.0}))]
    c, r = torch.randn(1, 3, 512, device=P.device), torch.randn(1, 3, 64, device=P.device)
    for cache in kinds:
        for bad in (c.to_sparse(), torch.nested.nested_tensor([c[0]])):
            for ids in ([0], None):
                with pytest.raises(TypeError, match="c_kv: expected a dense"):
                    cache.append(ids, bad, r)
        assert cache.seqlens() == [0, 0] and cache.num_free_pages == cache.num_pages
        c8, r8 = c.to(torch.float8_e4m3fn), r.to(torch.float8_e4m3fn)
        cache.append([0], c8, r8)
        cache.append([1], c8.float(), r8.float())
        a, b = cache.gather(0), cache.gather(1)
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_a_block_table_past_the_decode_kernels_positions_is_refused_at_construction():
    """``max_pages · page_size`` above 2**30 (the decode ops' bound on a block table's positions) is refused when
    the cache is made (``ValueError`` naming ``max_seqlen``), not by every decode step after the prefill."""
    for cls, widths in ((LatentCache, (R, DR)), (GroupedCache, (G, DH, DR, DV))):
        for max_seqlen, page in ((2**30 + 1, 2**15), (2**31 - 1, 2**24)):
            with pytest.raises(ValueError, match="max_seqlen"):
                cls(1, max_seqlen, *widths, page_size=page, num_pages=1, dtype=torch.float32, device=P.device)
    c = LatentCache(1, 2**30, R, DR, page_size=2**15, num_pages=1, dtype=torch.float32, device=P.device)
    assert c.max_pages * c.page_size == 2**30


def test_k_scale_past_any_float_is_refused_by_name():
    """An int too large for a float is a ``ValueError`` naming ``k_scale`` (not an ``OverflowError``)."""
    for bad in (10**400, -(10**400)):
        with pytest.raises(ValueError, match="k_scale"):
            LatentCache(1, 32, R, DR, page_size=PS, dtype=torch.float8_e4m3fn, k_scale=bad, device=P.device)


@pytest.mark.parametrize("kind", ["latent", "grouped"])
def test_unhashable_slot_ids_are_refused_by_name(kind):
    """Slot ids that are not ints (a nested list, a list holding a dict) are a ``TypeError`` naming ``seq_ids``
    before any change, in every call that takes them."""
    c = make_cache(kind)
    parts, _ = new_tokens(kind, 1, 3, gen(12))
    c.append([1], *parts)
    for bad in ([[1]], ([0],), [{}], [1, [2]]):
        for call in (lambda: c.append(bad, *parts), lambda: c.reserve(bad, 1), lambda: c.free(bad),
                     lambda: c.seqlens(bad), lambda: c.slot_index(bad)):
            before = snapshot(c)
            with pytest.raises(TypeError, match="seq_ids"):
                call()
            assert_unchanged(before, c)


@pytest.mark.parametrize("dtype,k_scale", [(torch.float16, None), (torch.float32, None), (torch.float8_e4m3fn, 0.5)])
def test_latent_rows_of_any_width_start_on_16_byte_boundaries(dtype, k_scale):
    """A ``LatentCache`` whose row (kv_rank + rope_dim values) is no multiple of 16 bytes holds a view into rows
    padded to one, as the decode kernels read rows on a GPU (``rows_aligned``; ``mla_decode`` refuses others
    there): appends, forks (a partly filled page copied) and gathers keep the values, ``bytes_per_token`` counts
    the padded row, and a decode over the cache equals one over a contiguous copy of it."""
    from gqla_triton.ops._common.validation import rows_aligned
    from gqla_triton.ops.mla import mla_decode

    cache = LatentCache(3, 40, 20, 7, page_size=PS, dtype=dtype, device=P.device, k_scale=k_scale)
    width, size = 27, dtype.itemsize
    assert cache.kv.shape[-1] == width and rows_aligned(cache.kv)
    assert cache.bytes_per_token == cache.kv.stride(1) * size == -(-width * size // 16) * 16
    c, kr = randn((2, 21, 20), 0, device=P.device), randn((2, 21, 7), 1, device=P.device)
    cache.append([0, 2], c, kr)
    cache.fork(0, 1)
    for s, i in ((0, 0), (1, 0), (2, 1)):
        got = torch.cat(cache.gather(s), -1).float().cpu()
        want = torch.cat([c[i], kr[i]], -1).float().cpu()
        want = (want / k_scale).to(dtype).float() * k_scale if k_scale is not None else want.to(dtype).float()
        assert torch.equal(got, want), s
    q = randn((3, 1, 16, width), 2, dtype=torch.float16 if size == 2 else torch.float32)
    n = 3
    args = (cache.block_table[:n], cache.cache_seqlens[:n], 20)
    kw = dict(k_descale=cache.k_descale, q_descale=cache.k_descale.new_ones(1)) if k_scale is not None else {}
    if k_scale is not None:
        q = q.to(torch.float8_e4m3fn)
    want = mla_decode(q, cache.kv.contiguous(), *args, **kw)
    got = mla_decode(q, cache.kv, *args, **kw)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
