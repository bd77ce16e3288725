"""The labs' graded exercises: for each, the cases that break its usual mistake, the reference the
grader compares with, the hints that name the mistake, and (where a roof applies) its score kind.

One exercise per act (the notebook that holds it in brackets):

- grid-stride vector add (01a): ``cases.vector_add`` and kind ``vector_add`` from the core;
- fp32 -> bf16 rounding in integer ops (01c): ``cases.bf16_round``, reference ``bf16_round_ref``;
- row softmax (02a): ``cases.softmax`` and kind ``softmax`` from the core;
- the fused GELU chain (03b): ``cases.gelu_chain``, ``gelu_chain_ref``, kind ``gelu_chain``;
- tiled matmul (04b): ``cases.matmul`` and kind ``matmul`` from the core;
- the FlashAttention inner loop (04d): ``cases.flash_attention``, ``flash_attention_ref``;
- one ring all-reduce step (05a): ``kernels.grade.ring.check_ring_step``;
- the paged-attention gather (06a): ``cases.paged_gather``, ``paged_gather_ref``;
- int4 unpack (07a): ``cases.int4_unpack``, ``int4_unpack_ref``;
- a grid barrier (08a): ``kernels.grade.barrier.check_grid_barrier``;
- the side quest's tree walk (09a): ``cases.forest``, ``forest_ref``.

References run on the float64 copies ``check`` gives them and never call the learner's code.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from kernels import device, fusion
from kernels.grade.core import KINDS, RTOL, Case, Kind, _float_dtypes, _name, _randn

# ----------------------------------------------------------------------------- Act 1.5: bf16

# fp32 bit patterns where rounding to bf16 is easy to get wrong, with what must come out.
_BF16_SPECIALS = [
    0x3F808000,  # 1 + 2**-8: a tie between 1.0 (even) and 1 + 2**-7: down to 1.0
    0x3F818000,  # a tie whose lower neighbour is odd: up
    0xBF808000,  # the same two ties, negative: the sign does not change the rule
    0xBF818000,
    0x3F808001,  # just above a tie: up
    0x3F807FFF,  # just below a tie: down
    0x7F7FFFFF,  # fp32's largest finite: rounds up to inf in bf16
    0x7F7F7FFF,  # rounds down to bf16's largest finite
    0x7F800000,  # +inf and -inf stay infinite
    0xFF800000,
    0x7FC00000,  # a quiet NaN
    0x7F800001,  # a NaN whose payload sits only in the low 16 bits: dropping them gives inf
    0xFF800001,
    0x7FFFFFFF,  # a NaN that a rounding bias would carry into the sign bit
    0x00000001,  # the smallest subnormal: rounds to zero
    0x00008000,  # a subnormal tie, even below: down to zero
    0x00018000,  # a subnormal tie, odd below: up
    0x80000000,  # -0.0
    0x00000000,
]


def _bits_to_float(bits: list[int]) -> torch.Tensor:
    return torch.from_numpy(np.array(bits, dtype=np.uint32).view(np.int32)).view(torch.float32)


def bf16_round_cases() -> list[Case]:
    """The special patterns, normal values over 60 binades, and random bit patterns (every class:
    subnormals, NaNs with any payload, infinities), each of odd length."""
    gen = torch.Generator().manual_seed(15)
    n = device.pick(1_000_003, 4099)

    def specials():
        return (_bits_to_float(_BF16_SPECIALS).to(device.DEVICE),)

    def binades():
        x = torch.randn(1237, generator=gen) * 2.0 ** torch.randint(-30, 30, (1237,), generator=gen)
        return (x.to(device.DEVICE),)

    def random_bits():
        bits = torch.randint(-(2**31), 2**31 - 1, (n,), generator=gen, dtype=torch.int64)
        return (bits.to(torch.int32).view(torch.float32).to(device.DEVICE),)

    kw = dict(out_dtype=torch.bfloat16, exact=True, diagnose=_bf16_diagnose)
    return [
        Case("bf16 rounding: ties, overflow, NaN, inf, subnormals, -0", specials, **kw),
        Case("bf16 rounding: normal values over 60 binades", binades, **kw),
        Case(f"bf16 rounding: {n} random bit patterns", random_bits, **kw),
    ]


def bf16_round_ref(x: torch.Tensor) -> torch.Tensor:
    """PyTorch's own fp32 -> bf16 conversion (round to nearest, ties to even). ``x`` arrives as a
    float64 copy of fp32 values: exact, so this rounds once, as from fp32."""
    return x.to(torch.bfloat16)


def _bf16_diagnose(out: torch.Tensor, ref: torch.Tensor, args: tuple) -> list[str]:
    x = args[0].float().cpu()
    got = out.detach().cpu().double()
    ref = ref.cpu()
    bad = ~((got == ref) | (got.isnan() & ref.isnan()))
    bits = x.view(torch.int32)
    low = bits & 0xFFFF
    truncated = (bits & ~0xFFFF).view(torch.float32).double()
    hints = []
    finite_bad = bad & ~x.isnan()
    if finite_bad.any() and ((got == truncated) | ~finite_bad).all():
        hints.append(
            "at every wrong element your result is x with its low 16 bits dropped (truncation, "
            "round toward zero): add a rounding bias before the shift, 0x7FFF plus the lowest bit "
            "you keep ((bits >> 16) & 1)"
        )
    ties = low == 0x8000
    if (bad & ties).any() and not (bad & ~ties & ~x.isnan()).any():
        i = int((bad & ties).nonzero()[0])
        hints.append(
            f"only exact ties are wrong (first at index {i}, bits 0x{int(bits[i]) & 0xFFFFFFFF:08X}):"
            " a tie goes to the neighbour whose last kept bit is 0 (ties to even)"
        )
    nan_bad = bad & x.isnan()
    if nan_bad.any():
        i = int(nan_bad.nonzero()[0])
        hints.append(
            f"a NaN input came out as {got[i].item()} (index {i}, bits "
            f"0x{int(bits[i]) & 0xFFFFFFFF:08X}): a NaN whose payload is in the low 16 bits becomes "
            "inf when they are dropped, and a rounding bias can carry into the sign or exponent; "
            "map NaN to a quiet NaN (0x7FC0) separately"
        )
    return hints


# ----------------------------------------------------------------------------- Act 3: GELU chain


def gelu_chain_cases() -> list[Case]:
    """Row widths that are not a block multiple, one row, and several rows (so that indexing ``w``
    and ``b`` by the flat offset instead of the column shows up)."""
    shapes = device.pick(
        [(1823, 781), (16_384, 4096), (5, 4097), (1, 1)], [(7, 123), (3, 1000), (1, 1)]
    )
    out = []
    for dtype in _float_dtypes():
        for i, (r, c) in enumerate(shapes):
            make = lambda r=r, c=c, d=dtype, s=i: (
                _randn([r, c], d, s),
                _randn([c], d, s + 1),
                _randn([c], d, s + 2),
            )
            out.append(Case(f"gelu_chain [{r}, {c}] {_name(dtype)}", make, diagnose=_gelu_diagnose))
    return out


def gelu_chain_ref(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``gelu(x * w + b) * sigmoid(x) + x`` (exact erf GELU), in the inputs' precision."""
    return F.gelu(x * w + b) * torch.sigmoid(x) + x


def _gelu_diagnose(out: torch.Tensor, ref: torch.Tensor, args: tuple) -> list[str]:
    if out.ndim != 2 or out.shape[0] < 2:
        return []
    err = (out.double() - ref).abs().amax(dim=1)
    tol = 1e-2 * ref.abs().amax().item() + 1e-6
    if err[0] <= tol and (err[1:] > tol).all():
        return [
            "row 0 is right and every other row is wrong: w and b have one value per column; "
            "index them by offsets % n_cols (the column), not by the flat offset"
        ]
    return []


def _gelu_chain_args() -> tuple:
    rows, d = device.pick((16_384, 4096), (64, 256))
    dtype = device.preferred_dtype(torch.bfloat16) if device.GPU_MODE else torch.float32
    return _randn([rows, d], dtype, 0), _randn([d], dtype, 1), _randn([d], dtype, 2)


def _compiled_chain():
    # torch.compile on a CPU takes longer than the exercise: compare with it on a GPU only.
    return fusion.compiled_gelu_chain() if device.GPU_MODE else None


# ----------------------------------------------------------------------------- Act 4: attention

_RESCALE_HINT = (
    "this case has more than one K/V tile and a running max that grows from tile to tile: when m "
    "changes, rescale the old l and acc by alpha = exp(m_old - m_new) before adding the new tile"
)
_MAX_HINT = "subtract the running max m before exponentiating (p = exp(s - m_new))"
_SCORES_HINT = f"this case has scores in the hundreds: exp(s) overflows unless you {_MAX_HINT}"
_OVERFLOW_HINT = f"NaN or inf: exp(s) overflowed; {_MAX_HINT}"


def _attention_says(hint: str | None):
    # NaN or inf where the reference is finite: exp overflowed, whichever case found it first (on a
    # GPU the long case whose scores grow along the keys reaches exp's range before the +-100s one).
    def diagnose(out, ref, args):
        said = [hint] if hint else []
        if torch.isfinite(ref).all() and not torch.isfinite(out).all():
            said.insert(0, _OVERFLOW_HINT)
        return said

    return diagnose


def flash_attention_cases() -> list[Case]:
    """[batch, heads, seq, head_dim] with lengths that end mid-tile, a single tile, keys whose
    scores grow along the sequence (the running max changes every tile) and huge scores."""
    shapes = device.pick(
        [(1, 1, 16, 64), (2, 3, 1000, 64), (1, 4, 4097, 128)],
        [(1, 1, 16, 16), (1, 2, 77, 16), (2, 1, 33, 32)],
    )
    # fp32 only in the interpreter: on a GPU tl.dot takes fp32 operands as TF32, whose error
    # (about 1e-3) is not the learner's; 16-bit operands are what a FlashAttention kernel takes.
    dtypes = [torch.float16, torch.bfloat16] if device.GPU_MODE else [torch.float32, torch.float16]
    dtypes = [d for d in dtypes if d in _float_dtypes()]
    out = []
    for dtype in dtypes:
        for i, (b, h, n, d) in enumerate(shapes):
            make = lambda b=b, h=h, n=n, d=d, t=dtype, s=i: tuple(
                _randn([b, h, n, d], t, s + j) for j in range(3)
            )
            hint = _RESCALE_HINT if n > 16 else None
            name = f"attention [{b}, {h}, {n}, {d}] {_name(dtype)}"
            out.append(
                Case(
                    name,
                    make,
                    reduce_len=n,
                    diagnose=_attention_says(hint),
                    atol_factor=_p16(dtype),
                )
            )
        b, h, n, d = shapes[1]
        out.append(
            Case(
                f"attention [{b}, {h}, {n}, {d}] {_name(dtype)}, scores growing along the keys",
                lambda b=b, h=h, n=n, d=d, t=dtype: _growing_keys(b, h, n, d, t),
                reduce_len=n,
                diagnose=_attention_says(_RESCALE_HINT),
                atol_factor=_p16(dtype),
            )
        )
        out.append(
            Case(
                f"attention [{b}, {h}, {n}, {d}] {_name(dtype)}, scores of +-100s",
                lambda b=b, h=h, n=n, d=d, t=dtype: _large_scores(b, h, n, d, t),
                reduce_len=n,
                hint=_SCORES_HINT,
                atol_factor=_p16(dtype),
            )
        )
    return out


def _p16(dtype: torch.dtype) -> float | None:
    """16-bit inputs: P is rounded to the inputs' dtype before P @ V (as in every FlashAttention),
    an error of one 16-bit rounding of the output's scale; fp32 keeps the default."""
    return None if dtype == torch.float32 else RTOL[dtype]


def _growing_keys(b: int, h: int, n: int, d: int, dtype: torch.dtype) -> tuple:
    q = _randn([b, h, n, d], torch.float32, 11).abs()
    k = (
        _randn([b, h, n, d], torch.float32, 12).abs()
        * torch.linspace(0.2, 2.0, n, device=device.DEVICE)[:, None]
    )
    v = _randn([b, h, n, d], torch.float32, 13)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _large_scores(b: int, h: int, n: int, d: int, dtype: torch.dtype) -> tuple:
    """Every key shares a component c, so each query row's scores carry an offset q.c of about
    +100 or -100 (alternate rows) on top of O(1) differences. Softmax ignores the offset; exp(s)
    overflows (or underflows to 0/0) without the max subtraction. The offset is exact enough in
    fp32 (products of about 30) that a correct kernel stays within tolerance."""
    sign = torch.where(torch.arange(n, device=device.DEVICE) % 2 == 0, 1.0, -1.0)[:, None]
    q = _randn([b, h, n, d], torch.float32, 21) * 0.5 + sign
    alpha = 100.0 * math.sqrt(d) / d
    k = _randn([b, h, n, d], torch.float32, 22) + alpha
    v = _randn([b, h, n, d], torch.float32, 23)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def flash_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q kᵀ / sqrt(d)) v in the inputs' precision (float64 under ``check``)."""
    s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    return torch.softmax(s, dim=-1) @ v


# ----------------------------------------------------------------------------- Act 6: paged gather


def paged_gather_cases() -> list[Case]:
    """Ragged lengths (an empty sequence, one token, lengths that end mid-block and on a block
    boundary), physical blocks in a shuffled order, and spare blocks full of 1e4 that a wrong
    lookup reads."""
    configs = device.pick(
        [(8, 16, 128, [0, 1, 15, 16, 17, 1000, 2047, 4099]), (4, 256, 64, [3000, 1, 511, 700])],
        [(2, 4, 16, [0, 1, 7, 8, 13]), (1, 16, 32, [33, 5, 16])],
    )
    out = []
    for dtype in _float_dtypes():
        for i, (n_kv, page, d, lens) in enumerate(configs):
            make = lambda n_kv=n_kv, page=page, d=d, lens=lens, t=dtype, s=i: _paged_pool(
                n_kv, page, d, lens, t, s
            )
            name = f"paged gather n_kv={n_kv} block={page} d={d} lens={lens} {_name(dtype)}"
            out.append(Case(name, make, diagnose=_paged_diagnose))
    return out


def _paged_pool(n_kv: int, page: int, d: int, lens: list[int], dtype: torch.dtype, seed: int):
    """A block pool holding each sequence's tokens in shuffled physical blocks, the block table
    (padded with a spare block's id) and the lengths."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [math.ceil(n / page) for n in lens]
    used = sum(per_seq)
    spare = 2
    n_blocks = used + spare
    pool = torch.full((n_blocks, n_kv, page, d), 1e4)
    perm = torch.randperm(used, generator=gen)
    table = torch.full((len(lens), max(max(per_seq), 1)), used, dtype=torch.int32)
    start = 0
    for s, nb in enumerate(per_seq):
        ids = perm[start : start + nb]
        start += nb
        table[s, :nb] = ids.to(torch.int32)
        tokens = torch.randn(n_kv, nb * page, d, generator=gen)
        pool[ids] = tokens.view(n_kv, nb, page, d).permute(1, 0, 2, 3)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    dev = device.DEVICE
    return pool.to(device=dev, dtype=dtype), table.to(dev), seq_lens.to(dev)


def paged_gather_ref(
    cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor
) -> torch.Tensor:
    """The sequences' tokens packed one after another, ``[sum(seq_lens), n_kv_heads, head_dim]``:
    token ``t`` of sequence ``s`` is row ``t % block_size`` of physical block
    ``block_table[s, t // block_size]`` (``kernels.paged_attention.gather_kv``, one sequence at a
    time)."""
    from kernels.paged_attention import gather_kv

    rows = [
        gather_kv(cache, block_table[s : s + 1], n)[0].transpose(0, 1)  # [n, n_kv_heads, d]
        for s, n in enumerate(seq_lens.tolist())
    ]
    return torch.cat(rows) if rows else cache.new_zeros(0, cache.shape[1], cache.shape[3])


def _paged_diagnose(out: torch.Tensor, ref: torch.Tensor, args: tuple) -> list[str]:
    cache, table, lens = args
    if out.shape != ref.shape:
        return []
    got = out.double().cpu()
    # What a kernel that skips the lookup reads: physical block = the sequence's logical block.
    identity = torch.arange(table.shape[1], dtype=torch.int32).expand_as(table.cpu())
    try:
        no_lookup = paged_gather_ref(cache.double().cpu(), identity.contiguous(), lens.cpu())
    except IndexError:
        no_lookup = None
    bad = (got - ref.cpu()).abs() > 1e-2 * (ref.cpu().abs() + 1)
    hints = []
    if no_lookup is not None and bad.any() and (got[bad] == no_lookup[bad]).all():
        hints.append(
            "the wrong rows hold what sits at physical block t // block_size: look the block up "
            "in the table first (block_table[seq, t // block_size])"
        )
    if (got.abs() >= 1e4 - 1).any():
        hints.append(
            "some rows were read from a spare block (every value 1e4): a token past a sequence's "
            "length, or a lookup in the wrong row of the block table"
        )
    return hints


# ----------------------------------------------------------------------------- Act 7: int4 unpack


def int4_unpack_cases() -> list[Case]:
    """Weights quantized by ``kernels.quant.quantize`` (odd N, groups of 32 and 128 and one per
    row), and a weight whose bytes take all 256 values (every nibble pair, -8 included)."""
    from kernels import quant

    shapes = device.pick(
        [(4097, 4096, 128), (11, 8192, 32), (1, 4096, None)],
        [(5, 256, 32), (3, 128, None), (1, 512, 128)],
    )
    out = []
    for i, (n, k, g) in enumerate(shapes):

        def make(n=n, k=k, g=g, s=i):
            qw = quant.quantize(_randn([n, k], torch.float32, s), bits=4, group_size=g)
            return qw.data, qw.scales, qw.group_size

        out.append(Case(f"int4 unpack N={n} K={k} group={g or k}", make, **_INT4))

    def every_byte():
        data = torch.arange(512, dtype=torch.int64).remainder(256).to(torch.uint8).view(2, 256)
        scales = (torch.arange(1, 9, dtype=torch.float32) / 4).view(2, 4).half()
        return data.to(device.DEVICE), scales.to(device.DEVICE), 128

    out.append(Case("int4 unpack: all 256 byte values, N=2 K=512 group=128", every_byte, **_INT4))
    return out


def int4_unpack_ref(data: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """``kernels.quant.dequantize`` of the packed weight, in fp32."""
    from kernels import quant

    n, half = data.shape
    qw = quant.QuantizedWeight(data, scales.half(), 4, int(group_size), (n, 2 * half))
    return quant.dequantize(qw, torch.float32)


def _int4_diagnose(out: torch.Tensor, ref: torch.Tensor, args: tuple) -> list[str]:
    data, scales, g = args
    got = out.detach().double().cpu()
    data, scales = data.cpu(), scales.cpu().double()
    n, half = data.shape
    lo = (data & 0xF).double() - 8
    hi = (data >> 4).double() - 8
    step = scales.repeat_interleave(g, dim=1)

    def same(q):
        return q.shape == got.shape and torch.allclose(q * step, got, rtol=1e-5, atol=1e-6)

    if same(torch.stack([lo, hi], dim=2).reshape(n, 2 * half)):
        return [
            "your output is the neighbour-pair layout (value 2j in byte j's low nibble, 2j+1 in "
            "its high nibble); the course packs value j in the low nibble and value j + K/2 in "
            "the high nibble of byte j"
        ]
    if same(torch.cat([hi, lo], dim=1)):
        return ["low and high nibbles are swapped: the low nibble holds the first half of the row"]
    if same(torch.cat([lo + 8, hi + 8], dim=1)):
        return ["values are stored as q + 8 in [0, 15] (offset binary): subtract 8"]
    if same(torch.cat([lo, hi], dim=1)):
        return []
    ratio = got / (ref.cpu() + (ref.cpu() == 0))
    if not ((ratio > 0) | (ref.cpu() == 0)).all():
        return []
    return [
        "the integers may be right but the scales are not: value k of a row uses scale "
        "scales[row, k // group_size], where k counts the unpacked values (0 .. K-1)"
    ]


_INT4 = dict(out_dtype=torch.float32, diagnose=_int4_diagnose)


# ----------------------------------------------------------------------------- side quest: trees


def forest_cases() -> list[Case]:
    """Random complete trees whose thresholds are values of X itself, so some rows meet a split
    exactly on its threshold (and must go left); row counts that are not a block multiple, one
    row, depths 1 to 8."""
    from kernels import trees

    configs = device.pick(
        [(10_000, 255, 8, 32), (4097, 33, 6, 7), (1, 3, 3, 4)],
        [(77, 9, 1, 5), (100, 13, 6, 7), (1, 3, 3, 4)],
    )
    out = []
    for i, (n, t, depth, f) in enumerate(configs):

        def make(n=n, t=t, depth=depth, f=f, s=i):
            x = _randn([n, f], torch.float32, s)
            ens = trees.random_ensemble(t, depth, f, X=x, seed=s)
            return x, ens.feature, ens.threshold, ens.leaf

        name = f"forest rows={n} trees={t} depth={depth} features={f}"
        out.append(Case(name, make, reduce_len=t, diagnose=_forest_diagnose))
    return out


def forest_ref(
    x: torch.Tensor, feature: torch.Tensor, threshold: torch.Tensor, leaf: torch.Tensor
) -> torch.Tensor:
    """``kernels.trees.predict_ref``: each row's leaf in every tree (right when x > threshold),
    the leaves summed in float64. ``x``, ``threshold`` and ``leaf`` arrive as float64 copies of
    fp32 values: cast back, exactly."""
    from kernels import trees

    ens = trees.Ensemble(feature, threshold.float(), leaf.float(), 0.0, x.shape[1])
    return trees.predict_ref(ens, x.float())


def _forest_diagnose(out: torch.Tensor, ref: torch.Tensor, args: tuple) -> list[str]:
    x, feature, threshold, leaf = args
    n_internal = feature.shape[1]
    depth = n_internal.bit_length()
    tr = torch.arange(feature.shape[0], device=x.device)[None, :]
    node = torch.zeros(x.shape[0], feature.shape[0], dtype=torch.long, device=x.device)
    for _ in range(depth):
        f = feature[tr, node].long()
        node = 2 * node + 1 + (x.gather(1, f) >= threshold[tr, node]).long()
    ge = leaf.double()[tr, node - n_internal].sum(dim=1)
    if torch.allclose(out.double(), ge, rtol=1e-5, atol=1e-5):
        return [
            "your result is what >= gives: a row whose value equals the threshold goes left "
            "(right only when x > threshold, as LightGBM's <= goes left)"
        ]
    return []


# ----------------------------------------------------------------------------- score kinds

# The fused chain reads x once and writes y once (w and b are one row each); about 20 FLOPs an
# element (a multiply and add, erf GELU, sigmoid, a multiply and add): napkin, for the plot only.
KINDS["gelu_chain"] = Kind(
    "copy",
    _gelu_chain_args,
    lambda a: (2 * a[0].numel() + 2 * a[1].numel()) * a[0].element_size(),
    lambda a: 20 * a[0].numel(),
    fusion.gelu_chain,
    _compiled_chain,
)
