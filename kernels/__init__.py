"""GPU Brrr kernels: the package the course's notebooks import.

Importing it decides, once, how Triton runs: on a machine without a CUDA device we set
``TRITON_INTERPRET=1`` *before* triton is first imported, so every ``@triton.jit`` kernel runs in
Triton's CPU interpreter (slow, but it executes the same kernel source). ``kernels.device`` is the
one place that reports and acts on that decision.
"""

import os
import sys

if "triton" not in sys.modules:
    import torch

    if not torch.cuda.is_available():
        # setdefault: a user who exports TRITON_INTERPRET=0 (e.g. to compile for a GPU target from a
        # CPU-only machine) keeps their choice.
        os.environ.setdefault("TRITON_INTERPRET", "1")
# Triton 3.x warns once about this default under -W error; make the default explicit instead.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from kernels import _interpreter_compat

    _interpreter_compat.apply()  # NumPy 2.4+ and Triton 3.6's interpreter (see that module)

__version__ = "0.1.0"
