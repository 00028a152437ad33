"""Argument checks shared by the layers and their caches: a ``TypeError`` / ``ValueError`` naming the argument."""

from __future__ import annotations

import math
import numbers

import torch

from ..dispatch import is_interpreter

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _dname(dtype) -> str:
    return str(dtype).replace("torch.", "")


def check_int(name: str, value: object, *, lo: int | None = None, optional: bool = False) -> int | None:
    """``value`` as a Python int (bools and floats refused), ``>= lo`` when given; ``None`` passes if ``optional``."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        what = "None or an int" if optional else "an int"
        raise TypeError(f"{name}: expected {what}, got {type(value).__name__} {value!r}")
    value = int(value)
    if lo is not None and value < lo:
        raise ValueError(f"{name}: expected an int >= {lo}, got {value}")
    return value


def check_real(name: str, value: object, *, positive: bool = False) -> float:
    """``value`` as a finite float (bools refused), ``> 0`` when ``positive``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a finite real number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value) or (positive and value <= 0):
        raise ValueError(f"{name}: expected a finite{' positive' if positive else ''} real number, got {value!r}")
    return value


def check_float_dtype(name: str, dtype: object) -> torch.dtype:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype.is_complex:
        raise TypeError(f"{name}: expected a floating torch.dtype, got {dtype!r}")
    return dtype


def check_device(name: str, device: object) -> torch.device:
    try:
        return torch.device(device)
    except (TypeError, RuntimeError, ValueError) as e:
        raise ValueError(f"{name}: expected a torch.device (or its name), got {device!r}") from e


def check_index_tensor(name: str, t: object, *, shape: list, dtypes: tuple, device: torch.device) -> torch.Tensor:
    """An integer tensor of the given shape (``None`` entries: any size >= 1), dtype and device."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype in ({', '.join(map(_dname, dtypes))}), got {_dname(t.dtype)}")
    want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
    if t.dim() != len(shape) or any(s is not None and g != s for g, s in zip(t.shape, shape, strict=True)):
        raise ValueError(f"{name}: expected shape {want}, got {list(t.shape)}")
    if any(s is None and g == 0 for g, s in zip(t.shape, shape, strict=True)):
        raise ValueError(f"{name}: expected shape {want} with non-empty dims, got {list(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got one on {t.device}")
    return t


def check_kernel_inputs(name: str, dtype: torch.dtype, device: torch.device, impl: str, layer: str) -> None:
    """What the Triton/Gluon kernels accept (``impl != "reference"``): a ``TypeError`` / ``ValueError`` naming
    ``name`` and the supported dtypes and devices, before anything runs."""
    if impl == "reference":
        return
    if dtype not in KERNEL_DTYPES:
        raise TypeError(f"{name}: {layer}(impl={impl!r}) kernels take {', '.join(map(_dname, KERNEL_DTYPES))}; got "
                        f"{_dname(dtype)} (impl='reference' computes in any float dtype)")
    if is_interpreter():
        if dtype == torch.bfloat16:
            raise TypeError(f"{name}: bfloat16 under Triton's CPU interpreter (TRITON_INTERPRET=1) computes wrongly "
                            "(triton#11584); use float16 / float32 there, bfloat16 on a GPU, or impl='reference'")
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"{name}: the kernels run on cpu (interpreter) or cuda tensors, got {device}")
    elif device.type != "cuda":
        raise ValueError(f"{name}: {layer}(impl={impl!r}) kernels need CUDA tensors (or TRITON_INTERPRET=1 for the "
                         f"CPU interpreter), got a tensor on {device}; impl='reference' runs on any device")


def as_ids(name: str, ids: object, n: int | None = None) -> list[int]:
    """Slot ids as a list of Python ints: ``None`` (``0..n-1``), an int, a sequence of ints or a 0-/1-D integer
    tensor. Bools, floats and nested sequences are refused (``TypeError`` / ``ValueError`` naming ``name``)."""
    if ids is None:
        if n is None:
            raise ValueError(f"{name}: required")
        return list(range(n))
    if isinstance(ids, torch.Tensor):
        if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
            raise TypeError(f"{name}: expected an integer tensor, got {_dname(ids.dtype)}")
        if ids.dim() > 1:
            raise ValueError(f"{name}: expected a 0-D or 1-D tensor, got shape {list(ids.shape)}")
        return [int(s) for s in ids.reshape(-1).tolist()]
    if isinstance(ids, numbers.Integral) and not isinstance(ids, bool):
        return [int(ids)]
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise TypeError(f"{name}: expected an int, a sequence of ints or an integer tensor, got {type(ids).__name__}")
    out = []
    for s in ids:
        if isinstance(s, bool) or not isinstance(s, numbers.Integral):
            raise TypeError(f"{name}: expected int slot ids, got {type(s).__name__} {s!r}")
        out.append(int(s))
    return out


def check_ids_range(name: str, ids: list[int], n: int, *, unique: bool) -> None:
    for s in ids:
        if not 0 <= s < n:
            raise ValueError(f"{name}: slot {s} outside [0, {n})")
    if unique and len(set(ids)) != len(ids):
        raise ValueError(f"{name}: duplicate slots in {ids}")
