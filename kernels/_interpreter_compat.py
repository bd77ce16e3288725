"""Keep Triton 3.6's CPU interpreter working with NumPy 2.4 and later.

The interpreter holds a scalar kernel argument as a one-element array, and turns it into a Python
int (for ``range(0, K, BLOCK_K)``, say) with ``int(array)``. NumPy 2.4 made that conversion of an
array with ``ndim > 0`` a TypeError, so every interpreted loop over a runtime bound fails
(triton-lang/triton#9171). The course pins numpy 2.3 for CI, but a GPU machine or Colab brings its
own NumPy, and Act 5's workers run the interpreter there when only one GPU is present. ``apply()``
installs the fix (read the one element) when this NumPy needs it; it changes nothing
otherwise.
"""

from __future__ import annotations

import warnings

import numpy as np


def needs_patch() -> bool:
    """True when this NumPy refuses ``int()`` of a one-element array (NumPy 2.4+). NumPy 1.25 to
    2.3 only warn, which must not stop ``import kernels`` under ``-W error``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            int(np.zeros(1, dtype=np.int32))
        except TypeError:
            return True
    return False


def apply(force: bool = False) -> bool:
    """Patch the interpreter's ``tensor.__index__``; returns whether it did."""
    if not (force or needs_patch()):
        return False
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_gpu_brrr_compat", False):
        return False  # a Triton without this hook, or already patched

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        # .item(): the one element, on any NumPy (and an error for a block, as int() was)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    patch_lang_tensor._gpu_brrr_compat = True
    interpreter._patch_lang_tensor = patch_lang_tensor
    return True
