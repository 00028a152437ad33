"""Faster runs of Triton's CPU interpreter (the ``ci`` profile), with the same results.

The interpreter patches ``triton.language``'s builtins around each kernel launch, and again on every call of a
``@triton.jit`` helper inside the kernel (``_patch_lang`` in ``triton/runtime/interpreter.py``). The second
patching finds every builtin patched already and changes nothing, but it walks the language modules with
``inspect.getmembers`` each time: about a third of the interpreter's time on the GDN kernels, whose helpers run
thousands of times per launch. ``reuse_patches`` skips it where the helper's language modules are patched already
(a launch in progress); anywhere else the interpreter's own patching runs, and a Triton whose interpreter patches
differently (no ``_patch_lang``, or builtins that stay builtins) simply runs as it is.
"""

from __future__ import annotations

import contextlib
import inspect

import triton.language as tl

_ORIGINAL = None
skipped = 0  # helper calls whose repatching was skipped


class _Patched:
    """The scope of a skipped patching: the launch's own scope restores the modules."""

    def restore(self) -> None:
        pass


def _patched(module, builtin: str) -> bool:
    """Whether the interpreter has replaced ``module.builtin`` (a builtin of every Triton this runs on)."""
    member = getattr(module, builtin, None)
    return member is not None and not tl.core.is_builtin(member)


def _patch_lang(fn):
    global skipped
    langs = [v for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)]
    if langs and all(_patched(lang, "arange") for lang in langs) and (tl not in langs or _patched(tl.math, "exp")):
        skipped += 1
        return _Patched()
    return _ORIGINAL(fn)


def reuse_patches() -> None:
    """Install the shortcut (idempotent; nothing where the interpreter has no ``_patch_lang``)."""
    global _ORIGINAL
    from triton.runtime import interpreter

    if _ORIGINAL is None and callable(getattr(interpreter, "_patch_lang", None)):
        _ORIGINAL = interpreter._patch_lang
        interpreter._patch_lang = _patch_lang


@contextlib.contextmanager
def original_patching():
    """The interpreter's own patching on every helper call, for the duration."""
    from triton.runtime import interpreter

    if _ORIGINAL is None:
        yield
        return
    interpreter._patch_lang = _ORIGINAL
    try:
        yield
    finally:
        interpreter._patch_lang = _patch_lang
