"""Hugging Face ``transformers`` Llama-family models -> the same model with GQLA attention.

``convert_llama(model, kv_rank=..., rope_dim=...)`` replaces every decoder layer's ``self_attn`` by a
``GQLAHFAttention``: a ``GQLAttention`` (made by ``trans_gqla`` from the layer's q/k/v/o and the model's rotary
frequencies) behind the HF attention signature, so ``model(...)`` and ``model.generate(...)`` run unchanged.
With a HF cache the adapter keeps its own per-layer GQLA cache (``LatentCache`` for ``decode_path="absorb"``,
``GroupedCache`` for ``"grouped"``) and records only the token count in the HF cache (one-element-wide
placeholders), so HF's masks and positions stay right. ``transformers`` is an optional dependency
(``pip install -e ".[hf]"``); this module imports it only where a model is converted.
"""

from __future__ import annotations

import sys
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from ..layers._state import drop_when_freed
from ..layers.gqla import GQLAttention, _check_grouped_dims
from ..ops._common.validation import check_choice, check_dense, check_page_size, check_positive_int, is_int
from .trans_gqla import check_plain_attention, trans_gqla

__all__ = ["GQLAHFAttention", "convert_llama", "set_decode_path"]

_DECODE_PATHS = ("absorb", "grouped")


def _check_decode_path(attn: GQLAttention, path, name: str) -> None:
    """``path`` is one of ``_DECODE_PATHS`` (``check_choice``) whose decode kernels take ``attn`` (the grouped
    ones: its head dims and ``impl``), else a ``ValueError`` naming the argument ``name``."""
    check_choice(name, path, _DECODE_PATHS)
    if path == "grouped":
        try:
            _check_grouped_dims(attn.impl, attn.head_dim, attn.v_head_dim, attn.rope_dim)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None


def _allowed(mask: torch.Tensor) -> torch.Tensor:
    """HF 4-D mask (bool: True = attend; float: added to the scores, 0 = attend as is) -> bool, True where the mask
    leaves the score as it is. An integer mask is refused: HF's 4-D integer masks mean 1 = attend, the additive
    convention's opposite, so neither reading is safe."""
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(f"attention_mask: expected a bool (True = attend) or floating (0 = attend) 4-D mask, got "
                        f"{mask.dtype}")
    return mask if mask.dtype == torch.bool else mask == 0


def _positions(name: str, p, B: int, T: int, dev: torch.device) -> torch.Tensor:
    """``position_ids`` / ``cache_position`` broadcast to ``[B, T]`` (a ``ValueError`` naming it where they do not)."""
    p = check_dense(name, p)
    if p.is_floating_point() or p.is_complex() or p.dtype == torch.bool:
        raise TypeError(f"{name}: expected an integer tensor, got {p.dtype}")
    try:
        return torch.broadcast_to(p.to(dev), (B, T))
    except RuntimeError:
        raise ValueError(f"{name}: expected a shape that broadcasts to [{B}, {T}], got {list(p.shape)}") from None


class GQLAHFAttention(nn.Module):
    """A ``GQLAttention`` with the HF attention forward: ``(hidden_states [B, T, hidden], position_embeddings,
    attention_mask, cache / past_key_values, position_ids, **kwargs) -> (attn_output [B, T, hidden], None)``.

    Positions come from ``position_ids`` (else ``cache_position``, else the HF cache's length + 0..T-1); the model's
    ``position_embeddings`` are not used (the layer rotates with its own frequencies in float64). Without a HF cache
    any 4-D ``attention_mask`` is honoured (padding included; a float one is added to the scores). With one, a call
    whose HF cache is empty starts a new GQLA cache of ``max_seqlen`` tokens per sequence; later calls with that HF
    cache decode against it (each HF cache its own: conversations may interleave; it is freed with its HF cache).
    Cached calls need a purely causal mask (no padding): the GQLA caches hold no padding, and a padded batch is a
    ``ValueError``. The HF cache holds, per token, the GQLA slot of its row: row reorders of the HF cache (beam
    search's ``reorder_cache``) are followed; a HF cache whose length no longer matches the GQLA cache's (cropped by
    assisted or speculative generation) is a ``ValueError``, and so is a step past a fixed-size HF cache's capacity
    (a ``StaticCache``). A cached call that raises leaves both caches as they were (the HF cache records a step once
    it ran; a HF cache update that raises takes the GQLA step back).
    """

    def __init__(self, attn: GQLAttention, layer_idx: int, *, decode_path: str = "absorb", max_seqlen: int = 4096,
                 page_size: int = 64):
        super().__init__()
        if not isinstance(attn, GQLAttention):
            raise TypeError(f"attn: expected a GQLAttention, got {type(attn).__name__}")
        if not is_int(layer_idx):
            raise TypeError(f"layer_idx: expected an int, got {type(layer_idx).__name__} {layer_idx!r}")
        if layer_idx < 0:
            raise ValueError(f"layer_idx: expected an int >= 0, got {layer_idx!r}")
        _check_decode_path(attn, decode_path, "decode_path")
        check_positive_int("max_seqlen", max_seqlen)
        self.attn, self.layer_idx, self.decode_path = attn, layer_idx, decode_path
        self.max_seqlen, self.page_size = max_seqlen, check_page_size(page_size)
        self.is_causal = True
        self.gqla_cache = None

    @property
    def gqla_cache(self):
        """The GQLA cache of the latest cached call (kept after its HF cache is freed, until the next call starts
        another), or None. Setting None forgets every GQLA cache (continuing a HF cache is then a
        ``ValueError``)."""
        return self._latest

    @gqla_cache.setter
    def gqla_cache(self, value) -> None:
        if value is not None:
            raise ValueError("gqla_cache: only None (forget every GQLA cache) can be set")
        self._caches: dict[int, tuple[weakref.ref, object]] = {}  # id(HF cache) -> (weak ref to it, GQLA cache)
        self._latest = None

    def __getstate__(self) -> dict:
        # the GQLA caches are kept per HF cache object, named weakly (not picklable): a copy keeps the latest only
        state = dict(super().__getstate__())
        state["_caches"] = {}
        return state

    def _cache_of(self, hf_cache):
        e = self._caches.get(id(hf_cache)) if hf_cache is not None else None
        return e[1] if e is not None and e[0]() is hf_cache else None

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None, cache=None,
                position_ids=None, past_key_values=None, cache_position=None, **kwargs):
        hf_cache = cache if cache is not None else past_key_values
        B, T = self.attn.check_hidden(hidden_states)  # every check before the HF cache is updated
        if hf_cache is not None and not all(callable(getattr(hf_cache, n, None)) for n in ("get_seq_length", "update")):
            raise TypeError(f"cache: expected a HF cache object (get_seq_length, update), got "
                            f"{type(hf_cache).__name__}")
        past = int(hf_cache.get_seq_length(self.layer_idx)) if hf_cache is not None else 0
        cap = self._capacity(hf_cache)
        if cap is not None and past + T > cap:
            raise ValueError(f"cache: {T} more tokens after {past} pass the {cap} tokens that layer {self.layer_idx} "
                             f"of the HF cache ({type(hf_cache).__name__}) holds")
        dev = hidden_states.device
        if position_ids is not None:
            pos = _positions("position_ids", position_ids, B, T, dev)
        elif cache_position is not None:
            pos = _positions("cache_position", cache_position, B, T, dev)
        else:
            pos = (past + torch.arange(T, device=dev))[None].expand(B, T)
        causal = attention_mask is None or self._is_causal_mask(attention_mask, past, B, T)
        if hf_cache is None:
            out = self.attn(hidden_states, pos) if causal else self._masked_prefill(hidden_states, pos, attention_mask)
            return out, None
        if not causal:
            raise ValueError("attention_mask: the GQLA caches need a purely causal mask (no padding); pass prompts "
                             "of equal length or call without a cache (use_cache=False)")
        if past + T > self.max_seqlen:
            raise ValueError(f"hidden_states: {T} more tokens after {past} pass the GQLA cache's max_seqlen "
                             f"{self.max_seqlen} (GQLAHFAttention / convert_llama(max_seqlen=...))")
        gqla = self._cache_of(hf_cache)
        spares = None
        if past == 0:  # B slots for the sequences and B spare ones, through which a beam reorder is followed
            try:
                ref = weakref.ref(hf_cache, drop_when_freed(self, "_caches", id(hf_cache), 0))
            except TypeError:
                raise TypeError(f"cache: expected a HF cache object, got {type(hf_cache).__name__} (the GQLA cache "
                                "is kept per HF cache, named by a weak reference)") from None
            gqla = self.attn.make_cache(2 * B, self.max_seqlen, path=self.decode_path, page_size=self.page_size,
                                        dtype=hidden_states.dtype, device=dev)
        elif gqla is None or gqla.max_batch != 2 * B:
            raise ValueError(f"cache: the HF cache holds {past} tokens but layer {self.layer_idx} has no GQLA cache "
                             f"for batch {B} (start from an empty HF cache)")
        else:
            held = gqla.seqlens(range(B))
            if any(n != past for n in held):
                raise ValueError(f"cache: the HF cache holds {past} tokens per sequence but layer {self.layer_idx}'s "
                                 f"GQLA cache holds {held}: the HF cache was cropped or replaced (assisted or "
                                 "speculative generation), which the GQLA cache cannot follow; start from an empty "
                                 "HF cache")
            src = self._sources(hf_cache, B, past)
            if src != list(range(B)):  # the step runs on copies in the spare slots, kept only when it succeeds
                spares = tuple(range(B, 2 * B))
                for b, s in enumerate(src):
                    gqla.fork(s, B + b)
        # the HF cache records the step only once it ran: each token's entry names the GQLA slot of its row (two
        # exact channels); HF reorders whole rows (beam search), so a row's last entry names the slot of its history.
        # An update that raises takes the GQLA step back: the spare slots are dropped, or the lengths written back.
        row = torch.arange(B, device=dev)
        mark = torch.stack([row // 256 + 1, row % 256], -1).to(hidden_states.dtype)[:, None, None, :]
        ran = False
        try:
            out = self.attn(hidden_states, pos, gqla, seq_ids=spares)
            ran = True
            hf_cache.update(mark.expand(B, 1, T, 2), mark.expand(B, 1, T, 2), self.layer_idx)
        except BaseException:
            if spares is not None:
                gqla.free(spares)
            elif ran and past:
                gqla.cache_seqlens[:B] = past
            raise
        if spares is not None:
            gqla.free(range(B))
            for b in range(B):
                gqla.fork(B + b, b)
            gqla.free(spares)
        if past == 0:
            self._caches[id(hf_cache)] = (ref, gqla)
        self._latest = gqla
        return out, None

    def _capacity(self, hf_cache) -> int | None:
        """The tokens layer ``layer_idx`` of ``hf_cache`` holds at most (a ``StaticCache``'s ``max_cache_len``), None
        where it grows or rolls (a ``DynamicCache``, a sliding-window layer) or has not made the layer yet."""
        layers = getattr(hf_cache, "layers", None)
        layer = layers[self.layer_idx] if isinstance(layers, list) and self.layer_idx < len(layers) else None
        cap = getattr(layer, "max_cache_len", None)
        return int(cap) if is_int(cap) and cap > 0 and not getattr(layer, "is_sliding", False) else None

    def _sources(self, hf_cache, B: int, past: int) -> list[int]:
        """The GQLA slot whose history each row of ``hf_cache`` holds (a beam reorder moves whole rows): named by
        the entry of the row's last cached token in the HF cache's layer (its ``keys [B, 1, >= past, 2]``)."""
        layers = getattr(hf_cache, "layers", None)
        keys = getattr(layers[self.layer_idx], "keys", None) if isinstance(layers, list) and \
            self.layer_idx < len(layers) else None
        if not isinstance(keys, torch.Tensor) or keys.dim() != 4 or tuple(keys.shape[:2]) != (B, 1) or \
                keys.shape[-1] != 2 or keys.shape[-2] < past:
            got = list(keys.shape) if isinstance(keys, torch.Tensor) else type(keys).__name__
            raise ValueError(f"cache: expected layer {self.layer_idx} of the HF cache to hold the entries this "
                             f"adapter wrote (keys [{B}, 1, >= {past}, 2], a DynamicCache or StaticCache), got {got}")
        last = keys[:, 0, past - 1].long()
        src = ((last[:, 0] - 1) * 256 + last[:, 1]).tolist()
        if any(not 0 <= s < B for s in src):
            raise ValueError(f"cache: the HF cache's rows name GQLA slots {src}, outside [0, {B}): it was not made "
                             "by this layer's calls")
        return src

    @staticmethod
    def _is_causal_mask(mask: torch.Tensor, past: int, B: int, T: int) -> bool:
        check_dense("attention_mask", mask)
        if mask.dim() != 4 or mask.shape[0] not in (1, B) or mask.shape[1] != 1 or mask.shape[-2] != T or \
                mask.shape[-1] < past + T:
            raise ValueError(f"attention_mask: expected a 4-D mask [{B} or 1, 1, {T}, >= {past + T}], "
                             f"got {list(mask.shape)}")
        kv = mask.shape[-1]
        want = torch.arange(kv, device=mask.device)[None] <= (past + torch.arange(T, device=mask.device))[:, None]
        return bool((_allowed(mask) == want).all())

    def _masked_prefill(self, x: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Attention over the T tokens under a HF 4-D mask (e.g. left padding): a bool mask selects the keys, a
        float one is added to the scores (as HF's attention adds it; its dtype's minimum hides a key); rows with no
        key give 0."""
        a = self.attn
        B, T, _ = x.shape
        q_nope, q_rope, c, k_rope = a._project(x, pos)
        k_nope, v = a._expand(c)
        rep = a.num_heads // a.num_groups
        q = torch.cat([q_nope, q_rope], -1).transpose(1, 2)
        k = torch.cat([k_nope, k_rope[:, :, None].expand(B, T, a.num_groups, a.rope_dim)], -1)
        k, v = (t.transpose(1, 2).repeat_interleave(rep, dim=1) for t in (k, v))
        m = mask[..., :T].expand(B, 1, T, T)
        hidden = ~m if m.dtype == torch.bool else m <= torch.finfo(m.dtype).min
        bias = torch.zeros(m.shape, dtype=q.dtype, device=q.device) if m.dtype == torch.bool else m.to(q.dtype)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.masked_fill(hidden, -torch.inf),
                                           scale=a.softmax_scale)
        o = o.masked_fill(hidden.all(-1, keepdim=True), 0.0).transpose(1, 2)
        return a.o_proj(o.reshape(B, T, a.num_heads * a.v_head_dim).to(x.dtype))


def _decoder_layers(model):
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    rotary = getattr(base, "rotary_emb", None)
    if layers is None or rotary is None:
        raise TypeError(f"model: expected a transformers Llama-family model (model.layers, model.rotary_emb), got "
                        f"{type(model).__name__}")
    if not isinstance(getattr(rotary, "inv_freq", None), torch.Tensor):
        raise TypeError(f"model: expected its rotary_emb ({type(rotary).__name__}) to hold the frequencies of every "
                        "layer (inv_freq)")
    missing = [i for i, layer in enumerate(layers) if not isinstance(getattr(layer, "self_attn", None), nn.Module)]
    if missing:
        raise TypeError(f"model: layers {missing} have no self_attn module (a Llama-family decoder layer's attention)")
    return base, layers, rotary


def _check_supported(model) -> None:
    cfg = model.config
    rope = getattr(cfg, "rope_parameters", None) or {}
    kind = rope.get("rope_type", "default")
    if kind in ("dynamic", "longrope"):
        raise ValueError(f"model: rope_type {kind!r} changes its frequencies with the sequence length; "
                         "TransGQLA needs fixed frequencies")
    layer_types = getattr(cfg, "layer_types", None) or ()
    if getattr(cfg, "sliding_window", None) or any(t != "full_attention" for t in layer_types):
        raise ValueError("model: sliding-window attention layers are not supported")
    if getattr(cfg, "attention_bias", False) or getattr(cfg, "attention_dropout", 0.0):
        raise ValueError("model: attention biases / dropout are not supported (bias-free, dropout-free only)")
    # attention variants of Llama-shaped models that change the function TransGQLA factorizes
    for name, what in (("clip_qkv", "clamps q / k / v (clip_qkv)"),
                       ("attn_logit_softcapping", "soft-caps the attention logits (attn_logit_softcapping)"),
                       ("use_qk_norm", "normalizes q / k (use_qk_norm)")):
        if getattr(cfg, name, None) not in (None, False):
            raise ValueError(f"model: its attention {what}; not supported")
    if rope.get("llama_4_scaling_beta"):  # Ministral 3: q · (1 + β·log(1 + ⌊position / original_max⌋))
        raise ValueError(f"model: its attention scales the queries by their position (rope_parameters"
                         f"['llama_4_scaling_beta'] = {rope['llama_4_scaling_beta']!r}); not supported")
    if any(not flag for flag in getattr(cfg, "no_rope_layers", None) or ()):
        raise ValueError("model: some layers use no rotary embedding (no_rope_layers); TransGQLA rotates every layer")


def _check_rope(rotary, sa, inv: torch.Tensor, scaling: float) -> None:
    """The attention's RoPE must be Llama's rotate-half form: ``x·cos + rotate_half(x)·sin`` with ``cos`` / ``sin``
    of the angles ``position·inv_freq`` repeated over both halves (times ``attention_scaling``), what
    ``trans_gqla`` rotates with. Checked on the model's own ``rotary_emb`` and the ``apply_rotary_pos_emb`` of the
    attention's module, so a variant (interleaved pairs, no rotation) is refused rather than converted wrongly."""
    if not getattr(sa, "use_rope", True):
        raise ValueError("model: a layer's attention uses no rotary embedding (use_rope=False); not supported")
    apply = getattr(sys.modules.get(type(sa).__module__), "apply_rotary_pos_emb", None)
    d = 2 * inv.numel()
    dev = rotary.inv_freq.device
    pos = torch.tensor([[0, 1, 3, 1000]], device=dev)
    x = torch.randn(1, 1, 4, d, generator=torch.Generator().manual_seed(0)).to(dev)
    try:
        with torch.no_grad():
            cos, sin = rotary(torch.zeros(1, 4, d, device=dev), pos)
            got = apply(x, x, cos, sin)[0].double().cpu()
    except Exception as e:  # noqa: BLE001  (any failure means: not the rotate-half form this conversion assumes)
        raise ValueError(f"model: its attention ({type(sa).__name__}) has no Llama-style rotary embedding "
                         f"(rotary_emb(x, position_ids) and apply_rotary_pos_emb(q, k, cos, sin)): {e}") from None
    ang = pos[0, :, None].double().cpu() * inv[None, :]
    cos64, sin64 = (torch.cat([f(ang), f(ang)], -1) * scaling for f in (torch.cos, torch.sin))
    xd = x.double().cpu()
    want = xd * cos64 + torch.cat([-xd[..., d // 2:], xd[..., :d // 2]], -1) * sin64
    if got.shape != want.shape or not torch.allclose(got, want, rtol=0, atol=1e-3 * max(1.0, scaling)):
        raise ValueError(f"model: its attention ({type(sa).__name__}) rotates q / k otherwise than Llama's "
                         "rotate-half RoPE (e.g. interleaved pairs); not supported")


def _check_calib(ids, cfg, base) -> None:
    """``calib_input_ids``: a non-empty ``[B, T]`` integer tensor of token ids within the vocabulary, on the
    embedding's device."""
    check_dense("calib_input_ids", ids)
    if ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"calib_input_ids: expected an int64 / int32 tensor of token ids, got {ids.dtype}")
    if ids.dim() != 2 or ids.numel() == 0:
        raise ValueError(f"calib_input_ids: expected a non-empty [B, T] int64 / int32 tensor, got {ids.dtype} of "
                         f"shape {list(ids.shape)}")
    emb = getattr(base, "embed_tokens", None)
    dev = emb.weight.device if emb is not None else ids.device
    if ids.device != dev:
        raise ValueError(f"calib_input_ids: expected a tensor on the model's device {dev}, got {ids.device}")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= cfg.vocab_size:
        raise ValueError(f"calib_input_ids: token ids must lie in [0, {cfg.vocab_size}), got values in [{lo}, {hi}]")


def convert_llama(model, *, kv_rank: int, rope_dim: int, calib_input_ids: torch.Tensor | None = None,
                  decode_path: str = "absorb", impl: str = "auto", max_seqlen: int = 4096, page_size: int = 64,
                  balance_kv: bool = True):
    """Replace every attention of a HF Llama-family model (``LlamaForCausalLM`` / ``LlamaModel`` and models with
    the same layout: bias-free q/k/v/o, Llama's rotate-half RoPE with fixed frequencies on every layer, full
    attention, any ``num_key_value_heads``) by a ``GQLAHFAttention`` in place; returns ``model``. Attention variants
    that would convert into another function are a ``ValueError`` before anything changes: interleaved RoPE pairs
    (Cohere), layers without RoPE (SmolLM3), clamped q / k / v (``clip_qkv``), queries scaled by their position
    (Ministral 3's ``llama_4_scaling_beta``), soft-capped logits, q / k norms, sliding windows, biases,
    length-dependent RoPE, and any parameter of the attention besides its q / k / v / o projections (StableLM's and
    HunYuan's q / k layer norms, BitNet's sub-norm, differential attention's λ).

    ``kv_rank`` / ``rope_dim``: see ``trans_gqla`` (``rope_dim = num_key_value_heads·head_dim`` and ``kv_rank >=
    2·num_key_value_heads·head_dim`` reproduce the model exactly). ``calib_input_ids [B, T]``: token ids whose
    per-layer attention inputs calibrate the factorizations. ``decode_path``, ``max_seqlen``, ``page_size``: the
    adapters' GQLA caches (``set_decode_path`` switches later); ``impl``: the decode kernels.

    Saving: ``torch.save(model)``, or ``model.state_dict()`` loaded into the same model converted with the same
    arguments. ``save_pretrained`` keeps the source's config, so ``from_pretrained`` builds the unconverted
    attention and initializes it anew (its load report lists the converted weights as unexpected).
    """
    check_choice("decode_path", decode_path, _DECODE_PATHS)
    base, layers, rotary = _decoder_layers(model)
    _check_supported(model)
    cfg = model.config
    h, g = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // h
    if rotary.inv_freq.device.type == "meta":
        raise ValueError("model: its rotary_emb.inv_freq is on the meta device (it holds no values); load the model's "
                         "weights first")
    inv = rotary.inv_freq.detach().to("cpu", torch.float64)
    if inv.shape != (d // 2,):
        raise ValueError(f"model: partial rotary embeddings ({2 * inv.numel()} of {d} dims) are not supported")
    scaling = float(getattr(rotary, "attention_scaling", 1.0))
    page_size = check_page_size(page_size)
    if calib_input_ids is not None:
        _check_calib(calib_input_ids, cfg, base)
    acts = None
    if calib_input_ids is not None:
        acts = [[] for _ in layers]
        hooks = [layer.self_attn.register_forward_pre_hook(
            lambda mod, args, kw, i=i: acts[i].append((kw.get("hidden_states", args[0] if args else None)).detach()),
            with_kwargs=True) for i, layer in enumerate(layers)]
        try:
            with torch.no_grad():
                model(input_ids=calib_input_ids, use_cache=False)
        finally:
            for hk in hooks:
                hk.remove()
    for i, layer in enumerate(layers):  # every check before the first layer is replaced
        sa = layer.self_attn
        if isinstance(sa, GQLAHFAttention):
            raise ValueError(f"model: layer {i}'s attention is already converted")
        check_plain_attention(sa, "model", f"layer {i}'s attention")
        _check_rope(rotary, sa, inv, scaling)
    new = []
    for i, layer in enumerate(layers):
        sa = layer.self_attn
        w = sa.q_proj.weight
        gq = trans_gqla(sa, num_heads=h, num_groups=g, head_dim=d, kv_rank=kv_rank, rope_dim=rope_dim,
                        rope_inv_freq=inv, rope_attention_scaling=scaling,
                        softmax_scale=getattr(sa, "scaling", d ** -0.5),
                        calib=None if acts is None else torch.cat([a.reshape(-1, a.shape[-1]) for a in acts[i]]),
                        balance_kv=balance_kv, path="auto", impl=impl, device=w.device, dtype=w.dtype)
        new.append(GQLAHFAttention(gq, getattr(sa, "layer_idx", i), decode_path=decode_path, max_seqlen=max_seqlen,
                                   page_size=page_size))
    for layer, m in zip(layers, new, strict=True):
        layer.self_attn = m
    return model


def set_decode_path(model, path: str):
    """Set every converted attention's decode path ("absorb" | "grouped") and forget every GQLA cache: a HF cache
    in progress is then refused, an empty one starts on the new path. A path whose decode kernels do not take an
    attention's head dims is a ``ValueError`` that changes nothing."""
    check_choice("path", path, _DECODE_PATHS)
    mods = [m for m in model.modules() if isinstance(m, GQLAHFAttention)]
    if not mods:
        raise ValueError("model: holds no converted attention (run convert_llama first)")
    for m in mods:
        _check_decode_path(m.attn, path, "path")
    for m in mods:
        m.decode_path, m.gqla_cache = path, None
    return model
