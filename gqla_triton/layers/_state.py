"""What a layer checks of a state dict before torch's loading copies any of it.

torch copies a module's tensors one by one and reports a wrong shape, a missing or an unexpected key only at the
end, after the others are copied. The layers check every entry's shape (and the keys they refuse outright) in
``_load_from_state_dict``, before anything of theirs is copied, and their own ``load_state_dict`` puts every
tensor back when the load fails for any other reason (a missing or unexpected key under ``strict``)."""

from __future__ import annotations

import torch
from torch import nn


def check_state_dict(module: nn.Module, state_dict, prefix: str, refused: tuple[tuple[str, str], ...] = ()) -> None:
    """Before ``module`` (and its children) take their entries of ``state_dict`` under ``prefix``: each entry of the
    module's own state that is present is a tensor of the module's shape, and none of ``refused`` (``(key, why)``
    pairs: keys whose loss would change the layer's function, refused even without ``strict``) is present. A
    ``ValueError`` names the offending keys."""
    for key, why in refused:
        if prefix + key in state_dict:
            raise ValueError(f"state_dict: {prefix + key}: {why}")
    bad = []
    for n, t in module.state_dict().items():
        k = prefix + n
        if k in state_dict:
            v = state_dict[k]
            if not isinstance(v, torch.Tensor) or tuple(v.shape) != tuple(t.shape):
                got = list(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
                bad.append(f"{k}: expected shape {list(t.shape)}, got {got}")
    if bad:
        raise ValueError(f"state_dict: {'; '.join(bad)}")


def load_or_restore(module: nn.Module, load, *args, **kwargs):
    """``load(*args, **kwargs)`` (the module's ``nn.Module.load_state_dict``); if it raises, every tensor of the
    module's state gets its values from before the call back, then the error propagates."""
    saved = {k: v.detach().clone() for k, v in module.state_dict().items()}
    try:
        return load(*args, **kwargs)
    except BaseException:
        with torch.no_grad():
            for k, v in module.state_dict().items():
                if k in saved and v.shape == saved[k].shape:
                    v.copy_(saved[k])
        raise
