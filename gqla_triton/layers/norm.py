"""RMS normalisation: ``RMSNorm`` (a module) and ``gated_rms_norm`` (Qwen3-Next's output gate)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops._common.validation import check_device, check_eps, check_float_dtype, check_positive_int

__all__ = ["RMSNorm", "gated_rms_norm"]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


class RMSNorm(nn.Module):
    """``x / rms(x) · weight`` over the last dim, computed in at least float32, returned in ``x``'s dtype."""

    def __init__(self, dim: int, eps: float = 1e-6, device=None, dtype=None):
        super().__init__()
        check_positive_int("dim", dim)
        self.eps = check_eps("eps", eps)
        check_float_dtype(dtype)
        device = check_device(device)
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def reset_parameters(self) -> None:
        """The weight as the constructor makes it: ones (e.g. after ``to_empty`` of a layer built on meta)."""
        with torch.no_grad():
            self.weight.fill_(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., dim]`` of a floating dtype -> the same shape and dtype."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point() or x.dtype.itemsize < 2:
            raise TypeError(f"x: expected a floating dtype of 16 bits or more, got {x.dtype}")
        if x.device != self.weight.device:
            raise ValueError(f"x: expected a tensor on the norm's device {self.weight.device}, got one on {x.device}")
        dim = self.weight.shape[0]
        if x.dim() == 0 or x.shape[-1] != dim:
            raise ValueError(f"x: expected a last dimension of {dim}, got shape {list(x.shape)}")
        xf = x.to(_compute_dtype(x.dtype))
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.to(xf.dtype)).to(x.dtype)


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``RMSNorm(o) · weight · silu(z)`` over the last dim (per value head), in at least float32; z's dtype out."""
    cdt = _compute_dtype(z.dtype)
    of = o.to(cdt)
    of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps)
    return (of * weight.to(cdt) * F.silu(z.to(cdt))).to(z.dtype)
