"""The paged-append write plan (``layers.paged_append``): every argument checked by name before any change, strided
views of the tables read and written through their strides, slots the host does not read (device slots) masked in
the kernel and its torch twin: no address outside the tensors given."""

import pytest
import torch
from harness import P, gen

from gqla_triton.dispatch import is_interpreter
from gqla_triton.layers import paged_append as pa
from gqla_triton.layers.paged_append import append_rows, append_rows_torch

PS = 16
PLANS = [append_rows, append_rows_torch]


def tables(mb=3, mp=3, npg=9, device=P.device):
    """``(block_table, cache_seqlens, overflow)``: slot ``s`` owns pages ``s·mp ..``, lengths 0 .. 2·(mb-1)."""
    bt = torch.arange(mb * mp, dtype=torch.int32, device=device).view(mb, mp) % npg
    sl = torch.arange(mb, dtype=torch.int32, device=device) * 2
    ov = torch.zeros(mb, dtype=torch.bool, device=device)
    return bt, sl, ov


def call(plan, bt, sl, ov, slots, batch=2, T=2, **kw):
    kw = dict(dict(max_seqlen=48, num_pages=9, page_size=PS), **kw)
    return plan(bt, sl, ov, slots, batch, T, **kw)


def idx(*v, dtype=torch.long, device=P.device):
    return torch.tensor(v, dtype=dtype, device=device)


def _bad_calls():
    """``(label, exception, message part, call(plan, bt, sl, ov))``."""
    meta = torch.device("meta")
    return [
        ("negative slot", ValueError, "slots",
         lambda f, bt, sl, ov: call(f, bt, sl, ov, idx(0, -1, device=bt.device))),
        ("slot past the table", ValueError, "slots",
         lambda f, bt, sl, ov: call(f, bt, sl, ov, idx(0, 5, device=bt.device))),
        ("duplicate slots", ValueError, "slots",
         lambda f, bt, sl, ov: call(f, bt, sl, ov, idx(1, 1, device=bt.device))),
        ("int32 slots", TypeError, "slots", lambda f, bt, sl, ov: call(f, bt, sl, ov, idx(0, 1, dtype=torch.int32))),
        ("slots of another batch", ValueError, "slots", lambda f, bt, sl, ov: call(f, bt, sl, ov, idx(0, 1, 2))),
        ("slots as a list", TypeError, "slots", lambda f, bt, sl, ov: call(f, bt, sl, ov, [0, 1])),
        ("fewer table rows", ValueError, "cache_seqlens", lambda f, bt, sl, ov: call(f, bt[:2], sl, ov, None)),
        ("empty table", ValueError, "block_table", lambda f, bt, sl, ov: call(f, bt[:, :0], sl, ov, None)),
        ("int64 table", TypeError, "block_table", lambda f, bt, sl, ov: call(f, bt.long(), sl, ov, None)),
        ("1-d table", ValueError, "block_table", lambda f, bt, sl, ov: call(f, bt[0], sl, ov, None)),
        ("int64 lengths", TypeError, "cache_seqlens", lambda f, bt, sl, ov: call(f, bt, sl.long(), ov, None)),
        ("expanded lengths", ValueError, "cache_seqlens",
         lambda f, bt, sl, ov: call(f, bt, sl[:1].expand(3), ov, None)),
        ("shorter overflow", ValueError, "overflow", lambda f, bt, sl, ov: call(f, bt, sl, ov[:2], None)),
        ("int overflow", TypeError, "overflow", lambda f, bt, sl, ov: call(f, bt, sl, ov.int(), None)),
        ("lengths inside the table", ValueError, "cache_seqlens",
         lambda f, bt, sl, ov: call(f, bt, bt[0], ov, None)),
        ("meta tables", ValueError, "meta",
         lambda f, bt, sl, ov: call(f, bt.to(meta), sl.to(meta), ov.to(meta), None)),
        ("slots on meta", ValueError, "slots", lambda f, bt, sl, ov: call(f, bt, sl, ov, idx(0, 1).to(meta))),
        ("page_size 0", ValueError, "page_size", lambda f, bt, sl, ov: call(f, bt, sl, ov, None, page_size=0)),
        ("page_size 16.0", TypeError, "page_size", lambda f, bt, sl, ov: call(f, bt, sl, ov, None, page_size=16.0)),
        ("num_pages 0", ValueError, "num_pages", lambda f, bt, sl, ov: call(f, bt, sl, ov, None, num_pages=0)),
        ("max_seqlen -1", ValueError, "max_seqlen", lambda f, bt, sl, ov: call(f, bt, sl, ov, None, max_seqlen=-1)),
        ("num_tokens True", TypeError, "num_tokens", lambda f, bt, sl, ov: call(f, bt, sl, ov, None, T=True)),
        ("num_tokens 2.0", TypeError, "num_tokens", lambda f, bt, sl, ov: call(f, bt, sl, ov, None, T=2.0)),
        ("num_tokens 0", ValueError, "num_tokens", lambda f, bt, sl, ov: call(f, bt, sl, ov, None, T=0)),
        # the kernel's int32 token loop would step past int32 (and never end) on the last 1024 ints
        ("num_tokens near int32", ValueError, "num_tokens",
         lambda f, bt, sl, ov: call(f, bt, sl, ov, None, T=2**31 - 1)),
        ("batch -1", ValueError, "batch", lambda f, bt, sl, ov: call(f, bt, sl, ov, None, batch=-1)),
        ("batch 1.0", TypeError, "batch", lambda f, bt, sl, ov: call(f, bt, sl, ov, None, batch=1.0)),
        ("batch past the slots", ValueError, "batch", lambda f, bt, sl, ov: call(f, bt, sl, ov, None, batch=4)),
    ]


HOST_CHECKED = {"negative slot", "slot past the table", "duplicate slots"}  # slot values: read from CPU slots only


@pytest.mark.parametrize("plan", PLANS, ids=["kernel", "torch"])
@pytest.mark.parametrize("case", _bad_calls(), ids=lambda c: c[0])
def test_bad_arguments_are_refused_by_name_before_any_change(plan, case):
    """Every argument checked by name before any table changes. Slot values are checked where the host reads them
    (CPU slots): those cases run on CPU tables in both profiles (device slots are masked in the kernel instead,
    ``test_unchecked_slots_are_masked_in_the_kernel_and_the_torch_plan``)."""
    name, exc, match, bad = case
    bt, sl, ov = tables(device="cpu" if name in HOST_CHECKED else P.device)
    before = [t.clone() for t in (bt, sl, ov)]
    with pytest.raises(exc, match=match):
        bad(plan, bt, sl, ov)
    for a, b in zip((bt, sl, ov), before, strict=True):
        assert torch.equal(a, b)


def _strided(t, gap):
    """``t``'s values in every other element of a larger buffer filled with ``gap``; returns ``(view, base)``."""
    base = torch.full((2 * t.shape[0], *t.shape[1:]), gap, dtype=t.dtype, device=t.device)
    base[::2] = t
    return base[::2], base


@pytest.mark.parametrize("plan", PLANS, ids=["kernel", "torch"])
@pytest.mark.parametrize("slots", [None, (2, 0)])
def test_strided_tables_are_read_and_written_through_their_strides(plan, slots):
    """A transposed block table (``stride(1) != 1``) and every-other-element views of the lengths and flags: the
    rows, lengths and flags of contiguous copies; the gaps of the views' buffers stay untouched."""
    bt, sl, ov = tables()
    sl[1] = 47  # one token past max_seqlen 48: overflow
    want = [t.clone() for t in (bt, sl, ov)]
    s = None if slots is None else idx(*slots)
    rows_want = call(append_rows_torch, *want, s)
    bt_t = bt.t().contiguous().t()
    sl_v, sl_base = _strided(sl, -7)
    ov_v, ov_base = _strided(ov, True)
    assert bt_t.stride(1) != 1 and sl_v.stride(0) == 2 and ov_v.stride(0) == 2
    rows = call(plan, bt_t, sl_v, ov_v, s)
    assert torch.equal(rows, rows_want)
    assert torch.equal(sl_v, want[1]) and torch.equal(ov_v, want[2])
    assert (sl_base[1::2] == -7).all() and ov_base[1::2].all()
    assert torch.equal(bt_t, want[0])


@pytest.mark.parametrize("plan", PLANS, ids=["kernel", "torch"])
def test_no_batch_plans_nothing(plan):
    bt, sl, ov = tables()
    before = [t.clone() for t in (bt, sl, ov)]
    for slots in (None, idx()):
        rows = call(plan, bt, sl, ov, slots, batch=0)
        assert rows.shape == (0,) and rows.dtype == torch.long
    for a, b in zip((bt, sl, ov), before, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("T", [1, 3, 37])
def test_unchecked_slots_are_masked_in_the_kernel_and_the_torch_plan(T):
    """Slots the host does not read (on a device, or under torch.compile) may be out of range: such an entry reads
    and writes no slot and its tokens go to the scratch page, every access stays inside the tensors given, and the
    kernel and the torch plan agree."""
    gg = gen(3)
    bt = torch.randint(-2, 12, (3, 3), generator=gg, dtype=torch.int32).to(P.device)
    sl = torch.tensor([5, 40, 2**31 - 1], dtype=torch.int32, device=P.device)
    ov = torch.zeros(3, dtype=torch.bool, device=P.device)
    slots = idx(-1, 1, 3, -(2**62), 2**62)
    runs = []
    for plan in (pa._rows_kernel, pa._rows_torch):
        a = [t.clone() for t in (bt, sl, ov)]
        extra = () if plan is pa._rows_kernel else (False,)
        if plan is pa._rows_kernel and is_interpreter():
            from addresscheck import AddressCheck

            with AddressCheck(*a, slots) as ac:
                rows = plan(*a, slots, 5, T, 48, 9, PS, *extra)
            ac.assert_clean()
        else:
            rows = plan(*a, slots, 5, T, 48, 9, PS, *extra)
        runs.append((rows, a))
        assert int(rows.min()) >= 0 and int(rows.max()) < 10 * PS
        scratch = 9 * PS + torch.arange(T, device=P.device) % PS
        for b in (0, 2, 3, 4):
            assert torch.equal(rows[b * T:(b + 1) * T], scratch)
        assert a[1][0] == 5 and a[1][2] == 2**31 - 1 and not a[2][0] and not a[2][2]
    (ra, a), (rb, b) = runs
    assert torch.equal(ra, rb) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    one = [t.clone() for t in (bt, sl, ov)]  # the one slot in range, planned alone (host-checked)
    rows_one = call(append_rows_torch, *one, idx(1), batch=1, T=T)
    assert torch.equal(ra[T:2 * T], rows_one) and torch.equal(a[1], one[1]) and torch.equal(a[2], one[2])


@pytest.mark.parametrize("plan", [append_rows, append_rows_torch])
def test_an_inference_tensor_outside_inference_mode_is_refused_before_any_change(plan):
    """``overflow`` (or ``cache_seqlens``) made under ``torch.inference_mode()`` cannot be written outside it: the
    call is refused before the lengths move."""
    bt = torch.arange(8, dtype=torch.int32, device=P.device).view(2, 4)
    sl = torch.tensor([0, 3], dtype=torch.int32, device=P.device)
    with torch.inference_mode():
        ov = torch.zeros(2, dtype=torch.bool, device=P.device)
        sl_inf = sl.clone()
    for lens, over in ((sl, ov), (sl_inf, torch.zeros(2, dtype=torch.bool, device=P.device))):
        before = lens.clone()
        with pytest.raises(RuntimeError, match="inference_mode"):
            plan(bt, lens, over, None, 2, 2, max_seqlen=64, num_pages=8, page_size=16)
        assert torch.equal(lens, before)
