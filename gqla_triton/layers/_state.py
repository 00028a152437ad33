"""What a layer checks of a state dict before torch's loading copies any of it.

torch copies a module's tensors one by one and reports a wrong shape, a missing or an unexpected key only at the
end, after the others are copied. The layers check every entry's shape (and the keys they refuse outright) in
``_load_from_state_dict``, before anything of theirs is copied, and their own ``load_state_dict`` puts every
parameter and buffer back (the same objects, their values) when the load fails for any other reason (a missing or
unexpected key under ``strict``)."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping

import torch
from torch import nn


def entry_problem(v, t: torch.Tensor, *, assign: bool = False) -> str | None:
    """Why ``v`` cannot be loaded into the state tensor ``t`` (None when it can): not a dense tensor, another shape,
    no values (meta), or another kind: a real floating tensor of 16 bits or more for a floating one (a cast from an
    integer, bool or complex tensor would not be the layer's weights, float8 ones lack their scales), the very dtype
    for an integer one (bits); with ``assign`` (the tensor replaces ``t``) also ``t``'s dtype and device, or the
    layer would compute in mixed dtypes."""
    if not isinstance(v, torch.Tensor):
        return f"expected a tensor, got {type(v).__name__}"
    if v.layout != torch.strided or v.is_nested:
        return f"expected a dense tensor, got a {'nested' if v.is_nested else v.layout} one"
    if tuple(v.shape) != tuple(t.shape):
        return f"expected shape {list(t.shape)}, got {list(v.shape)}"
    if v.device.type == "meta" and t.device.type != "meta":
        return "on the meta device (it holds no values)"
    if t.is_floating_point() and (not v.is_floating_point() or v.is_complex()):
        return f"expected a real floating tensor, got {v.dtype}"
    if t.is_floating_point() and v.element_size() < 2 <= t.element_size():
        return f"{v.dtype} weights need their scales; dequantise them first"
    if not t.is_floating_point() and v.dtype != t.dtype:
        return f"expected {t.dtype}, got {v.dtype}"
    if assign and (v.dtype != t.dtype or v.device != t.device):
        return f"assign=True takes the layer's dtype and device ({t.dtype}, {t.device}), got {v.dtype}, {v.device}"
    return None


def assigning(local_metadata) -> bool:
    """Whether ``_load_from_state_dict``'s load replaces the module's tensors (``load_state_dict(assign=True)``)."""
    return isinstance(local_metadata, dict) and bool(local_metadata.get("assign_to_params_buffers", False))


def check_state_dict(module: nn.Module, state_dict, prefix: str, refused: tuple[tuple[str, str], ...] = (), *,
                     assign: bool = False) -> None:
    """Before ``module`` (and its children) take their entries of ``state_dict`` under ``prefix``: each entry of the
    module's own state that is present can be loaded (``entry_problem``), and none of ``refused`` (``(key, why)``
    pairs: keys whose loss would change the layer's function, refused even without ``strict``) is present. A
    ``ValueError`` names the offending keys."""
    for key, why in refused:
        if prefix + key in state_dict:
            raise ValueError(f"state_dict: {prefix + key}: {why}")
    bad = []
    for n, t in module.state_dict().items():
        k = prefix + n
        if k in state_dict:
            why = entry_problem(state_dict[k], t, assign=assign)
            if why is not None:
                bad.append(f"{k}: {why}")
    if bad:
        raise ValueError(f"state_dict: {'; '.join(bad)}")


def load_or_restore(module: nn.Module, load, state_dict, **kwargs):
    """``load(state_dict, **kwargs)`` (the module's ``nn.Module.load_state_dict``) of a mapping whose keys are
    strings (else a ``TypeError`` naming them, before anything is loaded); if it raises, every parameter and buffer
    of the module and its children is the object it was before the call, with its values from before the call (a
    load with ``assign=True`` leaves the state dict's tensors as they were), then the error propagates."""
    if isinstance(state_dict, Mapping):
        odd = sorted(repr(k) for k in state_dict if not isinstance(k, str))
        if odd:
            raise TypeError(f"state_dict: expected str keys (parameter and buffer names), got {', '.join(odd)}")
    held = [(m, dict(m._parameters), dict(m._buffers)) for m in module.modules()]
    saved = [(t, t.untyped_storage().data_ptr(), t.detach().clone())
             for _, params, bufs in held for t in (*params.values(), *bufs.values()) if t is not None]
    try:
        return load(state_dict, **kwargs)
    except BaseException:
        with torch.no_grad():
            for m, params, bufs in held:
                m._parameters.clear()
                m._parameters.update(params)
                m._buffers.clear()
                m._buffers.update(bufs)
            for t, ptr, values in saved:
                if t.untyped_storage().data_ptr() == ptr:
                    t.copy_(values)
                else:  # its contents swapped (torch.__future__'s swap_module_params_on_conversion): its own again
                    t.data = values
        raise


def drop_when_freed(owner: object, table: str, key, slot: int) -> Callable[[weakref.ref], None]:
    """The callback of a weak reference kept at ``getattr(owner, table)[key][slot]``: removes that entry when its
    referent is freed, unless a newer entry holding another reference replaced it. Holds ``owner`` weakly."""
    owner_ref = weakref.ref(owner)

    def drop(ref: weakref.ref) -> None:
        entries = getattr(owner_ref(), table, None)
        entry = entries.get(key) if entries is not None else None
        if entry is not None and entry[slot] is ref:
            del entries[key]

    return drop
