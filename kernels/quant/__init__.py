"""Weight quantization for decoding (int8, int4 and a fused dequantize-GEMV) and fp8 for prefill.

Decoding a token multiplies a handful of activation rows ``x: bf16[M, K]`` by every weight matrix
``W: [N, K]`` of the model. With ``M`` of 1 to 16 the arithmetic is a rounding error and the time
is the weight read, so storing ``W`` in fewer bits makes the product faster in proportion to the
bytes removed. Per call the kernels here move

    bytes = weights (N*K*bits/8) + scales (2 * N * K/group) + x (2*M*K) + y (2*M*N),

and ``gemv_bytes`` returns exactly that, so every timing converts to an effective GB/s that can be
held against the measured copy bandwidth.

Format (``quantize``): symmetric, round-to-nearest, one fp16 scale per ``group_size`` consecutive
values of a row (``group_size=None``: one per row, "per channel"):

- int8: ``data`` is int8 ``[N, K]`` in [-127, 127];
- int4: two values a byte, ``data`` is uint8 ``[N, K/2]``. Byte ``j`` of a row holds value ``j``
  in its low nibble and value ``j + K/2`` in its high nibble, each stored as ``q + 8`` in [1, 15].
  Splitting the row in halves (rather than pairing neighbours ``2j, 2j+1``) means a tile of
  ``BLOCK_K`` bytes unpacks into two *contiguous* runs of K, so the matching pieces of ``x`` are two
  plain vector loads, with no shuffling of ``x`` or of the unpacked weights.

Kernels:

- ``_qmm_kernel`` (the default path, any M): tensor cores. Each program owns ``BLOCK_N`` output
  features and walks K in tiles of ``BLOCK_K`` bytes; the packed tile is unpacked into small
  integers (exact in fp16/bf16) and fed to ``tl.dot`` unscaled, and the group scale multiplies the
  fp32 partial product, once per tile and output instead of once per weight. ``x`` is padded to a
  tile of at least 16 rows (masked: the padding costs no memory traffic).
- ``_gemv_kernel`` (``path="gemv"``, 1 to 4 rows): the textbook GEMV on CUDA cores, one fp32 FMA
  per weight and row, kept to measure against: it runs out of instruction issue slots long before
  HBM runs out of bytes.
- ``int4_gemv_mma`` (``path="cuda"``, int4 with groups of 128, bf16, 1 to 8 rows; the default
  where it builds: an NVIDIA GPU of compute capability 8.0+ with nvcc): CUDA C++ in
  ``kernels/cuda/int4_gemv_mma.cu``. The weight is repacked once (``repack_int4_mma``) into the
  register order of the tensor-core instruction, so each lane's 16-byte load unpacks straight into
  ``mma`` operands, with no shared memory for the weights and no padded copies of x: the
  instructions per weight byte that limit the Triton kernel (Act 7 measures them) disappear.
- Unpacking uses a few lines of PTX per four bytes (``INT4_BF16_ASM`` and friends) where the GPU
  supports them, and portable Triton code elsewhere (the interpreter, pre-Ampere GPUs).
- Both kernels take a split of K across programs (``SPLIT_K``): each split writes fp32 partial
  sums that ``kernels.partial_sums`` adds in a fixed order (no atomics), used only when
  the output features alone cannot fill the GPU.

fp8 for prefill (cc >= 8.9): ``quantize_fp8`` (per tensor, per row, or per 1 x 128 block, fused in
one Triton pass), ``fp8_linear`` (``torch._scaled_mm``, per-tensor or per-row scales) and
``fp8_block_matmul`` (a Triton ``tl.dot`` kernel with 1 x 128 activation and 128 x 128 weight
scales, DeepSeek-V3's recipe). Accuracy helpers build heavy-tailed weights and a small
decoder-like MLP stack to compare schemes.

The package, one module per concern (every public name is re-exported here, so ``quant.gemv``,
``quant.quantize`` and the rest work unchanged):

- ``formats``: ``QuantizedWeight``, ``quantize``, ``unpack``, ``dequantize``, ``gemv_bytes``;
- ``ptx``: the PTX and portable unpacking helpers the Triton kernels share;
- ``qgemv``: the two Triton kernels, ``gemv`` and ``gemv_ref``, the GEMV benchmark;
- ``cuda_int4``: the CUDA C++ int4 kernel's configurations, ``repack_int4_mma`` and its build;
- ``fp8``: fp8 quantization and matmuls for prefill, the fp8 benchmark;
- ``accuracy``: heavy-tailed weights and the MLP stack that compares schemes;
- ``prefetch``: the prefetching CUDA-core GEMV that scripts/gpu/quant_probe.py measures.

``QuantizedWeight`` checks its fields when it is built (dtypes, shapes, bits, group size), so a
hand-built weight with the wrong dtype fails at once instead of returning garbage.
"""

from kernels.quant import accuracy, cuda_int4, formats, fp8, prefetch, ptx, qgemv
from kernels.quant.accuracy import (
    ACT_SCHEMES,
    WEIGHT_SCHEMES,
    MLPStack,
    activations,
    divergence,
    fake_quantize_act,
    fake_quantize_weight,
    mlp_forward,
    mlp_stack,
    relative_error,
    student_t,
)
from kernels.quant.cuda_int4 import (
    INT4_MMA_CONFIGS,
    INT4_MMA_MAX_M,
    _int4_mma_build_error,
    _int4_mma_module,
    int4_mma_unavailable,
    repack_int4_mma,
)
from kernels.quant.formats import (
    SCALE_DTYPE,
    SUPPORTED_DTYPES,
    QuantizedWeight,
    dequantize,
    gemv_bytes,
    quantize,
    unpack,
)
from kernels.quant.fp8 import (
    FP8_BLOCK,
    FP8_MAX,
    bench_fp8,
    fp8_block_matmul,
    fp8_block_matmul_ref,
    fp8_dtype,
    fp8_linear,
    quantize_fp8,
    quantize_fp8_weight,
)
from kernels.quant.ptx import (
    INT4_BF16_ASM,
    INT4_FP16_ASM,
    INT8_BF16_ASM,
    INT8_FP16_ASM,
    _unpack_int4,
    _unpack_int8,
)
from kernels.quant.qgemv import (
    GEMV_MAX_M,
    GEMV_SHAPES,
    MAX_M_BLOCK,
    _gemv_kernel,
    _qmm_kernel,
    _use_asm,
    bench_gemv,
    gemv,
    gemv_ref,
    max_block_k,
)

# Every Triton kernel of the package, for tests/test_compile.py.
COMPILE_SPECS = qgemv.COMPILE_SPECS + fp8.COMPILE_SPECS
