import os

# Kernel tests run in Triton's interpreter on machines without a GPU; importing kernels sets it up.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import kernels  # noqa: E402,F401
