"""A tensor-core matmul in Triton: tiles, grouped program order, autotuning, and on Hopper a
persistent kernel that moves tiles with TMA.

``matmul(a, b)`` computes ``a @ b`` for fp16/bf16 ``a[M, K]``, ``b[K, N]`` with fp32 accumulation.
Each program computes a BLOCK_M x BLOCK_N tile of C, walking K in BLOCK_K steps; ``tl.dot`` lowers to
the GPU's matrix instructions (``mma`` on Ampere/Ada, ``wgmma`` on Hopper; none on Turing's
``sm_75`` compile of bf16, which falls back to FMA-based code and is correct but slow).

Per tile it reads (BLOCK_M + BLOCK_N) * K values and does 2 * BLOCK_M * BLOCK_N * K FLOPs, so the
intensity against global memory grows with the tile: that is the whole point of tiling. Programs
are numbered in *groups* of GROUP_M row-tiles so that programs running at the same time share
column panels of B (and row panels of A) in L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import _validate, bench, device, roofline

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)


def _configs(tma: bool) -> list[triton.Config]:
    if device.INTERPRET:  # the interpreter cannot autotune over several configs: one small tile
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 4})]
    shapes = [  # (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps)
        (128, 256, 64, 3, 8),
        (256, 128, 64, 3, 8),
        (128, 128, 64, 4, 8),
        (128, 128, 64, 4, 4),
        (128, 64, 64, 4, 4),
        (64, 128, 64, 4, 4),
        (128, 128, 128, 3, 8),
        (64, 64, 64, 4, 4),
    ]
    hook = _set_descriptor_blocks if tma else None
    return [
        triton.Config(
            {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8},
            num_stages=s,
            num_warps=w,
            pre_hook=hook,
        )
        for bm, bn, bk, s, w in shapes
    ]


@triton.jit
def _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    # Grouped order: walk GROUP_M row-tiles down a column of tiles before moving right, so the
    # programs in flight reuse the same panels of A and B from L2.
    tiles_per_group = GROUP_M * num_pid_n
    first_m = (tile_id // tiles_per_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile_id % tiles_per_group) % group_rows
    pid_n = (tile_id % tiles_per_group) // group_rows
    return pid_m, pid_n


@triton.autotune(configs=_configs(tma=False), key=["M", "N", "K"])
@triton.jit
def _matmul_kernel(
    # pointers
    a_ptr,
    b_ptr,
    c_ptr,
    # sizes
    M,
    N,
    K,
    # strides
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    # meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid_m, pid_n = _tile_coords(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    # Rows/columns past the edge wrap around (modulo) instead of being masked: the loads stay
    # unconditional and the wrapped results are dropped by the masked store.
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :].to(tl.int64) * stride_bn
    # fp32 accumulator: 16-bit products summed over K would lose the low bits.
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K  # the last K step may be partial: mask it with zeros
        a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ptrs = c_ptr + rows[:, None].to(tl.int64) * stride_cm + cols[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


def _set_descriptor_blocks(nargs):
    # Autotuning changes the tile shape, and TMA descriptors carry the tile shape they copy.
    bm, bn, bk = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    nargs["a_desc"].block_shape = [bm, bk]
    nargs["b_desc"].block_shape = [bk, bn]
    nargs["c_desc"].block_shape = [bm, bn]


@triton.autotune(configs=_configs(tma=True), key=["M", "N", "K"])
@triton.jit
def _matmul_tma_persistent_kernel(
    # TMA descriptors: the copy engine moves whole tiles between global and shared memory
    a_desc,
    b_desc,
    c_desc,
    # sizes
    M,
    N,
    K,
    # meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_SMS: tl.constexpr,
):
    # Persistent: one program per SM loops over output tiles, so there is no tail wave of programs
    # and the next tile's loads can be issued while the current one finishes (flatten=True lets the
    # compiler pipeline across the tile boundary).
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile_id in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_SMS, flatten=True):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            # Out-of-bounds parts of a tile are zero-filled by the TMA unit itself.
            a = a_desc.load([pid_m * BLOCK_M, ki * BLOCK_K])
            b = b_desc.load([ki * BLOCK_K, pid_n * BLOCK_N])
            acc = tl.dot(a, b, acc)
        c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(c_desc.dtype))


def _tma_ok(a: torch.Tensor, b: torch.Tensor) -> bool:
    # TMA needs 16-byte-aligned row strides: K and N multiples of 8 for 2-byte types.
    return (
        device.GPU_MODE
        and device.capabilities().tma
        and a.shape[1] % 8 == 0
        and b.shape[1] % 8 == 0
    )


def matmul(a: torch.Tensor, b: torch.Tensor, *, persistent: bool | None = None) -> torch.Tensor:
    """``a @ b`` for 2-D fp16/bf16 tensors of one dtype, fp32 accumulation, output in that dtype.

    ``persistent``: use the persistent TMA kernel (Hopper+, K and N multiples of 8). Default: where
    it applies.
    """
    _validate.tensor("a", a, dtypes=SUPPORTED_DTYPES, ndim=2)
    _validate.tensor("b", b, dtypes=SUPPORTED_DTYPES, ndim=2)
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"a and b do not chain: a is {tuple(a.shape)}, b is {tuple(b.shape)}")
    _validate.same("a", a, "b", b, shape=False)
    M, K = a.shape
    N = b.shape[1]
    tma = _tma_ok(a, b) if persistent is None else persistent
    if tma and not _tma_ok(a, b):
        raise ValueError("persistent=True needs a GPU with TMA (Hopper+) and K, N multiples of 8")
    c = torch.empty(M, N, device=a.device, dtype=a.dtype)
    if M == 0 or N == 0:
        return c
    if K == 0:
        return c.zero_()
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        sms = device.capabilities().sm_count
        dummy = [64, 64]  # replaced per configuration by _set_descriptor_blocks
        a_desc = TensorDescriptor.from_tensor(a, dummy)
        b_desc = TensorDescriptor.from_tensor(b, dummy)
        c_desc = TensorDescriptor.from_tensor(c, dummy)

        def grid(meta):
            tiles = triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"])
            return (min(sms, tiles),)

        _matmul_tma_persistent_kernel[grid](a_desc, b_desc, c_desc, M, N, K, NUM_SMS=sms)
        return c

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    _matmul_kernel[grid](
        a,
        b,
        c,
        M,
        N,
        K,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        c.stride(0),
        c.stride(1),
    )
    return c


def matmul_ref(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp32 reference, cast to the inputs' dtype."""
    return (a.float() @ b.float()).to(a.dtype)


COMPILE_SPECS = [
    dict(
        kernel=_matmul_kernel.fn,
        signature={
            "a_ptr": f"*{t}",
            "b_ptr": f"*{t}",
            "c_ptr": f"*{t}",
            **{n: "i32" for n in ("M", "N", "K", "stride_am", "stride_ak", "stride_bk")},
            **{n: "i32" for n in ("stride_bn", "stride_cm", "stride_cn")},
        },
        constexprs={"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8},
    )
    for t in ("fp16", "bf16")
] + [
    dict(
        kernel=_matmul_tma_persistent_kernel.fn,
        signature={
            "a_desc": "tensordesc<bf16[128, 64]>",
            "b_desc": "tensordesc<bf16[64, 256]>",
            "c_desc": "tensordesc<bf16[128, 256]>",
            **{n: "i32" for n in ("M", "N", "K")},
        },
        constexprs={"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "NUM_SMS": 132},
        options={"num_warps": 8, "num_stages": 3},
        min_cc=90,  # TMA exists from Hopper on
    )
]


@bench.register("matmul")
def _bench_matmul(quick: bool) -> list[dict]:
    if not device.GPU_MODE:
        print("matmul benchmark skipped: tensor-core timings need a GPU")
        return []
    dtype = device.preferred_dtype(torch.bfloat16)
    peak = roofline.matmul_peak("bfloat16" if dtype is torch.bfloat16 else "float16")
    shapes = [(4096, 4096, 4096)] if quick else [
        (4096, 4096, 4096), (8192, 8192, 8192), (4000, 3000, 5000), (16, 8192, 8192),
    ]  # fmt: skip
    recs = []
    for m, n, k in shapes:
        a = torch.randn(m, k, device="cuda", dtype=dtype)
        b = torch.randn(k, n, device="cuda", dtype=dtype)
        flops = 2 * m * n * k
        cublas = bench.measure(lambda: a @ b, flops=flops)  # noqa: B023
        variants = [("triton", False)] + (
            [("triton-tma-persistent", True)] if _tma_ok(a, b) else []
        )
        for name, persistent in variants:
            ours = bench.measure(lambda p=persistent: matmul(a, b, persistent=p), flops=flops)  # noqa: B023
            recs.append(bench.record("matmul", name, (m, n, k), dtype, ours,
                                     baseline=("cublas", cublas), ceiling=(peak.name, peak.value)))  # fmt: skip
        recs.append(bench.record("matmul", "cublas", (m, n, k), dtype, cublas,
                                 ceiling=(peak.name, peak.value)))  # fmt: skip
    return recs
