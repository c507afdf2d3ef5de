"""Block attention in Triton: the ring's per-step work on CUDA (and on CPU under ``TRITON_INTERPRET=1``).

One program computes a tile of ``BLOCK_M`` query rows of one (batch, head) against the whole key block,
``BLOCK_N`` keys at a time, with the online softmax (FlashAttention-2). Visibility comes from positions:
``kv_pos <= q_pos`` when causal, ``q_pos - kv_pos < window`` with a window, ``kv_pos < seq_bound``
(padding), and an optional dense bool mask. Score modifiers (`lowering.scores`) apply to ``scale · q kᵀ``
before masking: soft-capping fused (``c·tanh(s/c)``; tanh from exponentials, the interpreter has no
libdevice), ALiBi computed from the positions and a per-head slope, a dense float bias tile loaded like
the mask. From the positions' ranges (and a per-tile summary of the
dense mask) each key tile is classified before anything is loaded: *invisible* tiles are skipped (no
loads, no math), *fully visible* ones skip the mask arithmetic, the rest apply it. GQA/MQA: query head ``h``
reads KV head ``h // group``; K/V are never repeated in memory.

Forward results are fp32 (out, and the LSE in natural-log units); with ``out``/``lse`` accumulators
given, the kernel merges its result into them in place (log-sum-exp identity), so the ring needs no
separate merge pass. Backward: one kernel for dq (per query tile), one for dk/dv (per key tile, summing
the query heads of its group in registers, no atomics); both recompute probabilities from the saved LSE
and take ``delta = rowsum(dO * O) - dLSE`` from the caller. On request the dq kernel also stores each
tile's gradient with respect to the modified scores (that is, to an additive bias; before the soft-cap's
chain rule), so the ring can train bias tables tile by tile.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # the kernels' softmax runs in base 2
NO_BOUND = tl.constexpr(2**62)  # seq_bound when no key is padding (kernels read only constexpr globals)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _tile_ranges(pos_ptr, start, length, BLOCK: tl.constexpr):
    """Offsets, validity, positions and the (lowest, highest) valid position of one tile."""
    offs = start + tl.arange(0, BLOCK).to(tl.int64)  # 64-bit offsets: tensors may exceed 2^31 elements
    valid = offs < length
    pos = tl.load(pos_ptr + offs, mask=valid, other=0)
    lowest = tl.min(tl.where(valid, pos, NO_BOUND), 0)
    highest = tl.max(tl.where(valid, pos, -1), 0)
    return offs, valid, pos, lowest, highest


@triton.jit
def _may_be_visible(
    q_lo,
    q_hi,
    kv_lo,
    kv_hi,
    seq_bound,
    window,
    TILES,
    b,
    h,
    tile_m,
    tile_n,
    stb,
    sth,
    stm,
    stn,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_MASK: tl.constexpr,
):
    """False when nothing in the tile can be visible (all keys padding, after every query, out of the
    window, or hidden by the dense mask's per-tile summary): the tile is skipped without loading it."""
    see = kv_lo < seq_bound
    if IS_CAUSAL:
        see = see & (kv_lo <= q_hi)
    if HAS_WINDOW:
        see = see & (q_lo - kv_hi < window)
    if HAS_MASK:
        see = see & (tl.load(TILES + b * stb + h * sth + tile_m * stm + tile_n * stn) != 0)
    return see


@triton.jit
def _needs_mask(
    q_lo, q_hi, kv_lo, kv_hi, some_invalid, seq_bound, window, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr
):
    """False when the positions leave every pair of the tile visible: no mask arithmetic needed."""
    partial = some_invalid | (kv_hi >= seq_bound)
    if IS_CAUSAL:
        partial = partial | (kv_hi > q_lo)
    if HAS_WINDOW:
        partial = partial | (q_hi - kv_lo >= window)
    return partial


@triton.jit
def _masked(
    scores,
    b,
    h,
    rows,
    row_ok,
    q_pos,
    cols,
    col_ok,
    kv_pos,
    seq_bound,
    window,
    MASK,
    smb,
    smh,
    smn,
    smm,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_MASK: tl.constexpr,
):
    visible = row_ok[:, None] & col_ok[None, :] & (kv_pos[None, :] < seq_bound)
    if IS_CAUSAL:
        visible = visible & (kv_pos[None, :] <= q_pos[:, None])
    if HAS_WINDOW:
        visible = visible & (q_pos[:, None] - kv_pos[None, :] < window)
    if HAS_MASK:
        tile = tl.load(
            MASK + b * smb + h * smh + rows[:, None] * smn + cols[None, :] * smm,
            mask=row_ok[:, None] & col_ok[None, :],
            other=0,
        )
        visible = visible & (tile != 0)
    return tl.where(visible, scores, float("-inf"))


@triton.jit
def _tanh(x):
    """tanh in fp32 from exponentials: an odd series near 0 (where 1 - e^-2|x| would cancel)."""
    a = tl.abs(x)
    e = tl.exp(-2.0 * a)
    x2 = x * x
    series = a * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0))))
    t = tl.where(a < 0.125, series, (1.0 - e) / (1.0 + e))
    return tl.where(x < 0, -t, t)


@triton.jit
def _modified(
    scores,
    b,
    h,
    rows,
    row_ok,
    q_pos,
    cols,
    col_ok,
    kv_pos,
    softcap,
    SLOPES,
    BIAS,
    sbb,
    sbh,
    sbn,
    sbm,
    HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """(scores with the score modifiers applied, the soft-capped scores before any bias), natural units."""
    if HAS_SOFTCAP:
        scores = softcap * _tanh(scores / softcap)
    capped = scores
    if HAS_ALIBI:
        scores = scores + tl.load(SLOPES + h) * (kv_pos[None, :] - q_pos[:, None]).to(tl.float32)
    if HAS_BIAS:
        scores = scores + tl.load(
            BIAS + b * sbb + h * sbh + rows[:, None] * sbn + cols[None, :] * sbm,
            mask=row_ok[:, None] & col_ok[None, :],
            other=0.0,
        )
    return scores, capped


@triton.jit
def _program(length, heads, BLOCK: tl.constexpr):
    """(tile, batch, head) of this program: a 1-D grid, tiles of one head adjacent (they share K/V in
    cache), indices 64-bit so that offsets never wrap."""
    pid = tl.program_id(0).to(tl.int64)
    tiles = tl.cdiv(length, BLOCK)
    return pid % tiles, pid // tiles // heads, pid // tiles % heads


@triton.jit
def _load_tile(PTR, b, h, offs, ok, dims, dim_ok, sb, sh, sn, sd, UPCAST: tl.constexpr):
    """Rows ``offs`` of one (batch, head) as a [rows, BLOCK_D] tile; rows and dims past the end read 0."""
    tile = tl.load(
        PTR + b * sb + h * sh + offs[:, None] * sn + dims[None, :] * sd, mask=ok[:, None] & dim_ok[None, :], other=0.0
    )
    if UPCAST:
        tile = tile.to(tl.float32)
    return tile


@triton.jit
def _scores(
    q,
    k,
    scale,
    b,
    h,
    rows,
    row_ok,
    q_pos,
    q_lo,
    q_hi,
    cols,
    col_ok,
    kv_pos,
    kv_lo,
    kv_hi,
    some_invalid,
    seq_bound,
    window,
    MASK,
    smb,
    smh,
    smn,
    smm,
    softcap,
    SLOPES,
    BIAS,
    sbb,
    sbh,
    sbn,
    sbm,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """(the modified scores of a tile in base-2 units, hidden pairs -inf and no mask arithmetic when all
    are visible; the soft-capped scores in natural units, for the backward's chain rule)."""
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    scores, capped = _modified(
        scores,
        b,
        h,
        rows,
        row_ok,
        q_pos,
        cols,
        col_ok,
        kv_pos,
        softcap,
        SLOPES,
        BIAS,
        sbb,
        sbh,
        sbn,
        sbm,
        HAS_SOFTCAP,
        HAS_ALIBI,
        HAS_BIAS,
    )
    scores = scores * LOG2E
    # a dense mask always applies (its per-tile summary already skipped hidden tiles)
    if HAS_MASK or _needs_mask(q_lo, q_hi, kv_lo, kv_hi, some_invalid, seq_bound, window, IS_CAUSAL, HAS_WINDOW):
        scores = _masked(
            scores,
            b,
            h,
            rows,
            row_ok,
            q_pos,
            cols,
            col_ok,
            kv_pos,
            seq_bound,
            window,
            MASK,
            smb,
            smh,
            smn,
            smm,
            IS_CAUSAL,
            HAS_WINDOW,
            HAS_MASK,
        )
    return scores, capped


@triton.jit
def _key_tile(
    q,
    K,
    V,
    MASK,
    b,
    h,
    kv_h,
    scale,
    rows,
    row_ok,
    q_pos,
    q_lo,
    q_hi,
    cols,
    col_ok,
    kv_pos,
    kv_lo,
    kv_hi,
    some_invalid,
    dims,
    dim_ok,
    seq_bound,
    window,
    skb,
    skh,
    skn,
    skd,
    svb,
    svh,
    svn,
    svd,
    smb,
    smh,
    smn,
    smm,
    softcap,
    SLOPES,
    BIAS,
    sbb,
    sbh,
    sbn,
    sbm,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """A key tile as a query tile's kernels see it: (k, v, the scores in base-2 units, the capped scores)."""
    k = _load_tile(K, b, kv_h, cols, col_ok, dims, dim_ok, skb, skh, skn, skd, UPCAST)
    v = _load_tile(V, b, kv_h, cols, col_ok, dims, dim_ok, svb, svh, svn, svd, UPCAST)
    scores, capped = _scores(
        q,
        k,
        scale,
        b,
        h,
        rows,
        row_ok,
        q_pos,
        q_lo,
        q_hi,
        cols,
        col_ok,
        kv_pos,
        kv_lo,
        kv_hi,
        some_invalid,
        seq_bound,
        window,
        MASK,
        smb,
        smh,
        smn,
        smm,
        softcap,
        SLOPES,
        BIAS,
        sbb,
        sbh,
        sbn,
        sbm,
        IS_CAUSAL,
        HAS_WINDOW,
        HAS_MASK,
        HAS_SOFTCAP,
        HAS_ALIBI,
        HAS_BIAS,
        PRECISION,
    )
    return k, v, scores, capped


@triton.jit
def _forward_kernel(
    Q,
    K,
    V,
    QPOS,
    KVPOS,
    MASK,
    TILES,
    SLOPES,
    BIAS,
    OUT,
    LSE,
    sqb,
    sqh,
    sqn,
    sqd,
    skb,
    skh,
    skn,
    skd,
    svb,
    svh,
    svn,
    svd,
    smb,
    smh,
    smn,
    smm,
    stb,
    sth,
    stm,
    stn,
    sbb,
    sbh,
    sbn,
    sbm,
    sob,
    soh,
    son,
    sod,
    slb,
    slh,
    sln,
    H,
    n,
    m,
    scale,
    window,
    seq_bound,
    softcap,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MERGE: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid_m, b, h = _program(n, H, BLOCK_M)
    kv_h = h // GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < D
    rows, row_ok, q_pos, q_lo, q_hi = _tile_ranges(QPOS, pid_m * BLOCK_M, n, BLOCK_M)
    q = _load_tile(Q, b, h, rows, row_ok, dims, dim_ok, sqb, sqh, sqn, sqd, UPCAST)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(0, m, BLOCK_N):
        cols, col_ok, kv_pos, kv_lo, kv_hi = _tile_ranges(KVPOS, start, m, BLOCK_N)
        if _may_be_visible(
            q_lo,
            q_hi,
            kv_lo,
            kv_hi,
            seq_bound,
            window,
            TILES,
            b,
            h,
            pid_m,
            start // BLOCK_N,
            stb,
            sth,
            stm,
            stn,
            IS_CAUSAL,
            HAS_WINDOW,
            HAS_MASK,
        ):
            k, v, scores, capped = _key_tile(
                q,
                K,
                V,
                MASK,
                b,
                h,
                kv_h,
                scale,
                rows,
                row_ok,
                q_pos,
                q_lo,
                q_hi,
                cols,
                col_ok,
                kv_pos,
                kv_lo,
                kv_hi,
                start + BLOCK_N > m,
                dims,
                dim_ok,
                seq_bound,
                window,
                skb,
                skh,
                skn,
                skd,
                svb,
                svh,
                svn,
                svd,
                smb,
                smh,
                smn,
                smm,
                softcap,
                SLOPES,
                BIAS,
                sbb,
                sbh,
                sbn,
                sbm,
                IS_CAUSAL,
                HAS_WINDOW,
                HAS_MASK,
                HAS_SOFTCAP,
                HAS_ALIBI,
                HAS_BIAS,
                UPCAST,
                PRECISION,
            )
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(scores - shift[:, None])
            alpha = tl.exp2(m_i - shift)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
    seen = l_i > 0
    out = tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) / LOG2E, float("-inf"))
    out_ptrs = OUT + b * sob + h * soh + rows[:, None] * son + dims[None, :] * sod
    lse_ptrs = LSE + b * slb + h * slh + rows * sln
    io_mask = row_ok[:, None] & dim_ok[None, :]
    if MERGE:  # fold into the running accumulators: lse = log(e^lse_acc + e^lse), out weighted alike
        lse_acc = tl.load(lse_ptrs, mask=row_ok, other=float("-inf"))
        out_acc = tl.load(out_ptrs, mask=io_mask, other=0.0)
        top = tl.maximum(lse_acc, lse)
        top_safe = tl.where(top == float("-inf"), 0.0, top)
        w_acc, w_blk = tl.exp(lse_acc - top_safe), tl.exp(lse - top_safe)
        total = w_acc + w_blk
        safe_total = tl.where(total > 0, total, 1.0)
        out = (out_acc * w_acc[:, None] + out * w_blk[:, None]) / safe_total[:, None]
        lse = tl.where(total > 0, top_safe + tl.log(safe_total), float("-inf"))
    tl.store(out_ptrs, out, mask=io_mask)
    tl.store(lse_ptrs, lse, mask=row_ok)


@triton.jit
def _row_stats(LSE, DELTA, b, h, rows, row_ok, slb, slh, sln):
    """The saved LSE (in base-2 units; +inf for rows with no visible key, so their p is 0) and delta."""
    lse = tl.load(LSE + b * slb + h * slh + rows * sln, mask=row_ok, other=float("-inf"))
    delta = tl.load(DELTA + b * slb + h * slh + rows * sln, mask=row_ok, other=0.0)
    return tl.where(lse == float("-inf"), float("inf"), lse * LOG2E), delta


@triton.jit
def _score_grads(p, do, v, delta, PRECISION: tl.constexpr):
    """The gradient of the loss with respect to the modified scores (and so to an additive bias)."""
    return p * (tl.dot(do, tl.trans(v), input_precision=PRECISION) - delta[:, None])


@triton.jit
def _uncapped(ds, capped, softcap, HAS_SOFTCAP: tl.constexpr):
    """The score gradient carried back to ``scale · q kᵀ`` (through the soft-cap: 1 - tanh²)."""
    if HAS_SOFTCAP:
        t = capped / softcap
        ds = ds * (1.0 - t * t)
    return ds


@triton.jit
def _dq_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    QPOS,
    KVPOS,
    MASK,
    TILES,
    SLOPES,
    BIAS,
    DQ,
    DS,
    sqb,
    sqh,
    sqn,
    sqd,
    skb,
    skh,
    skn,
    skd,
    svb,
    svh,
    svn,
    svd,
    sdb,
    sdh,
    sdn,
    sdd,
    smb,
    smh,
    smn,
    smm,
    stb,
    sth,
    stm,
    stn,
    sbb,
    sbh,
    sbn,
    sbm,
    slb,
    slh,
    sln,
    H,
    n,
    m,
    scale,
    window,
    seq_bound,
    softcap,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    STORE_DS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid_m, b, h = _program(n, H, BLOCK_M)
    kv_h = h // GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < D
    rows, row_ok, q_pos, q_lo, q_hi = _tile_ranges(QPOS, pid_m * BLOCK_M, n, BLOCK_M)
    q = _load_tile(Q, b, h, rows, row_ok, dims, dim_ok, sqb, sqh, sqn, sqd, UPCAST)
    do = _load_tile(DO, b, h, rows, row_ok, dims, dim_ok, sdb, sdh, sdn, sdd, UPCAST)
    lse2, delta = _row_stats(LSE, DELTA, b, h, rows, row_ok, slb, slh, sln)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(0, m, BLOCK_N):
        cols, col_ok, kv_pos, kv_lo, kv_hi = _tile_ranges(KVPOS, start, m, BLOCK_N)
        if _may_be_visible(
            q_lo,
            q_hi,
            kv_lo,
            kv_hi,
            seq_bound,
            window,
            TILES,
            b,
            h,
            pid_m,
            start // BLOCK_N,
            stb,
            sth,
            stm,
            stn,
            IS_CAUSAL,
            HAS_WINDOW,
            HAS_MASK,
        ):
            k, v, scores, capped = _key_tile(
                q,
                K,
                V,
                MASK,
                b,
                h,
                kv_h,
                scale,
                rows,
                row_ok,
                q_pos,
                q_lo,
                q_hi,
                cols,
                col_ok,
                kv_pos,
                kv_lo,
                kv_hi,
                start + BLOCK_N > m,
                dims,
                dim_ok,
                seq_bound,
                window,
                skb,
                skh,
                skn,
                skd,
                svb,
                svh,
                svn,
                svd,
                smb,
                smh,
                smn,
                smm,
                softcap,
                SLOPES,
                BIAS,
                sbb,
                sbh,
                sbn,
                sbm,
                IS_CAUSAL,
                HAS_WINDOW,
                HAS_MASK,
                HAS_SOFTCAP,
                HAS_ALIBI,
                HAS_BIAS,
                UPCAST,
                PRECISION,
            )
            p = tl.exp2(scores - lse2[:, None])
            ds = _score_grads(p, do, v, delta, PRECISION)
            if STORE_DS:  # the gradient with respect to a bias, into DS (contiguous [B, H, n, m])
                tl.store(
                    DS + ((b * H + h) * n + rows[:, None]) * m + cols[None, :],
                    ds,
                    mask=row_ok[:, None] & col_ok[None, :],
                )
            ds = _uncapped(ds, capped, softcap, HAS_SOFTCAP)
            dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    tl.store(
        DQ + b * sqb + h * sqh + rows[:, None] * sqn + dims[None, :] * sqd,
        dq * scale,
        mask=row_ok[:, None] & dim_ok[None, :],
    )


@triton.jit
def _dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    QPOS,
    KVPOS,
    MASK,
    TILES,
    SLOPES,
    BIAS,
    DK,
    DV,
    sqb,
    sqh,
    sqn,
    sqd,
    skb,
    skh,
    skn,
    skd,
    svb,
    svh,
    svn,
    svd,
    sdb,
    sdh,
    sdn,
    sdd,
    smb,
    smh,
    smn,
    smm,
    stb,
    sth,
    stm,
    stn,
    sbb,
    sbh,
    sbn,
    sbm,
    slb,
    slh,
    sln,
    HKV,
    n,
    m,
    scale,
    window,
    seq_bound,
    softcap,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid_n, b, kv_h = _program(m, HKV, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < D
    cols, col_ok, kv_pos, kv_lo, kv_hi = _tile_ranges(KVPOS, pid_n * BLOCK_N, m, BLOCK_N)
    k = _load_tile(K, b, kv_h, cols, col_ok, dims, dim_ok, skb, skh, skn, skd, UPCAST)
    v = _load_tile(V, b, kv_h, cols, col_ok, dims, dim_ok, svb, svh, svn, svd, UPCAST)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for g in range(GROUP):  # the query heads that read this KV head
        h = kv_h * GROUP + g
        for start in range(0, n, BLOCK_M):
            rows, row_ok, q_pos, q_lo, q_hi = _tile_ranges(QPOS, start, n, BLOCK_M)
            if _may_be_visible(
                q_lo,
                q_hi,
                kv_lo,
                kv_hi,
                seq_bound,
                window,
                TILES,
                b,
                h,
                start // BLOCK_M,
                pid_n,
                stb,
                sth,
                stm,
                stn,
                IS_CAUSAL,
                HAS_WINDOW,
                HAS_MASK,
            ):
                q = _load_tile(Q, b, h, rows, row_ok, dims, dim_ok, sqb, sqh, sqn, sqd, UPCAST)
                do = _load_tile(DO, b, h, rows, row_ok, dims, dim_ok, sdb, sdh, sdn, sdd, UPCAST)
                lse2, delta = _row_stats(LSE, DELTA, b, h, rows, row_ok, slb, slh, sln)
                scores, capped = _scores(
                    q,
                    k,
                    scale,
                    b,
                    h,
                    rows,
                    row_ok,
                    q_pos,
                    q_lo,
                    q_hi,
                    cols,
                    col_ok,
                    kv_pos,
                    kv_lo,
                    kv_hi,
                    (start + BLOCK_M > n) | (pid_n * BLOCK_N + BLOCK_N > m),
                    seq_bound,
                    window,
                    MASK,
                    smb,
                    smh,
                    smn,
                    smm,
                    softcap,
                    SLOPES,
                    BIAS,
                    sbb,
                    sbh,
                    sbn,
                    sbm,
                    IS_CAUSAL,
                    HAS_WINDOW,
                    HAS_MASK,
                    HAS_SOFTCAP,
                    HAS_ALIBI,
                    HAS_BIAS,
                    PRECISION,
                )
                p = tl.exp2(scores - lse2[:, None])
                dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision=PRECISION)
                ds = _uncapped(_score_grads(p, do, v, delta, PRECISION), capped, softcap, HAS_SOFTCAP)
                dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=PRECISION)
    kv_mask = col_ok[:, None] & dim_ok[None, :]
    tl.store(DK + b * skb + kv_h * skh + cols[:, None] * skn + dims[None, :] * skd, dk * scale, mask=kv_mask)
    tl.store(DV + b * svb + kv_h * svh + cols[:, None] * svn + dims[None, :] * svd, dv, mask=kv_mask)


# ---- launchers ------------------------------------------------------------------------------------------
def _config(q: torch.Tensor) -> dict:
    d = q.size(-1)
    block_d = max(16, triton.next_power_of_2(d))
    block = 16 if INTERPRETED else (64 if block_d > 64 else 128)
    return dict(
        D=d,
        BLOCK_D=block_d,
        BLOCK_M=block,
        BLOCK_N=block,
        UPCAST=INTERPRETED,  # the interpreter's dot mishandles bf16: it computes in fp32 instead
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )


def _positions(pos: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return pos.to(device=like.device, dtype=torch.int64).contiguous()


def _mask_args(mask: torch.Tensor | None, shape, block_m: int, block_n: int, device) -> tuple:
    """The mask broadcast to [B, Hq, n, m] (strides 0 where it broadcasts) as bytes, and its per-tile
    summary (does any pair of the BLOCK_M x BLOCK_N tile see?), each with its strides."""
    if mask is None:
        return None, (0, 0, 0, 0), None, (0, 0, 0, 0)
    b, h, n, m = shape
    mask = mask.to(device=device, dtype=torch.bool)
    mask = mask[(None,) * (4 - mask.dim())]
    mask = mask.expand(mask.size(0), mask.size(1), n, m)  # full along queries and keys, broadcast elsewhere
    padded = torch.nn.functional.pad(mask, (0, -m % block_n, 0, -n % block_m))
    tiles = padded.unflatten(3, (-1, block_n)).unflatten(2, (-1, block_m)).any(5).any(3).to(torch.uint8)
    tiles = tiles.expand(b, h, *tiles.shape[2:])
    mask = mask.expand(shape)
    return mask.view(torch.uint8), mask.stride(), tiles, tiles.stride()


def _score_args(softcap, alibi_slopes, bias, shape, device) -> tuple[tuple, tuple, float, dict]:
    """(slopes and bias pointers, the bias's strides broadcast to ``shape``, the soft-cap, the flags)."""
    if alibi_slopes is not None:
        alibi_slopes = alibi_slopes.to(device=device, dtype=torch.float32).contiguous()
    strides = (0, 0, 0, 0)
    if bias is not None:
        bias = bias.to(device=device, dtype=torch.float32)
        bias = bias[(None,) * (4 - bias.dim())].expand(shape)
        strides = bias.stride()
    flags = dict(HAS_SOFTCAP=softcap is not None, HAS_ALIBI=alibi_slopes is not None, HAS_BIAS=bias is not None)
    return (alibi_slopes, bias), strides, float(softcap or 1.0), flags


def forward(
    q,
    k,
    v,
    q_pos,
    kv_pos,
    *,
    scale: float,
    is_causal: bool,
    window=None,
    mask=None,
    seq_bound: int | None = None,
    softcap=None,
    alibi_slopes=None,
    bias=None,
    out=None,
    lse=None,
):
    """(out, lse) fp32; with ``out``/``lse`` fp32 accumulators given, merges into them and returns them."""
    b, hq, n, d = q.shape
    m = k.size(2)
    q_pos, kv_pos = _positions(q_pos, q), _positions(kv_pos, q)
    merge = out is not None
    if not merge:
        out = torch.empty((b, hq, n, d), dtype=torch.float32, device=q.device)
        lse = torch.empty((b, hq, n), dtype=torch.float32, device=q.device)
    config = _config(q)
    mask_bytes, mask_strides, tiles, tile_strides = _mask_args(
        mask, (b, hq, n, m), config["BLOCK_M"], config["BLOCK_N"], q.device
    )
    score_ptrs, bias_strides, cap, score_flags = _score_args(softcap, alibi_slopes, bias, (b, hq, n, m), q.device)
    grid = (triton.cdiv(n, config["BLOCK_M"]) * b * hq,)
    _forward_kernel[grid](
        q,
        k,
        v,
        q_pos,
        kv_pos,
        mask_bytes,
        tiles,
        *score_ptrs,
        out,
        lse,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *mask_strides,
        *tile_strides,
        *bias_strides,
        *out.stride(),
        *lse.stride(),
        hq,
        n,
        m,
        float(scale),
        int(window or 0),
        int(NO_BOUND.value if seq_bound is None else seq_bound),
        cap,
        GROUP=hq // k.size(1),
        IS_CAUSAL=bool(is_causal),
        HAS_WINDOW=window is not None,
        HAS_MASK=mask is not None,
        **score_flags,
        MERGE=merge,
        **config,
    )
    return out, lse


def backward(
    dout,
    q,
    k,
    v,
    out,
    lse,
    q_pos,
    kv_pos,
    *,
    scale: float,
    is_causal: bool,
    window=None,
    mask=None,
    seq_bound: int | None = None,
    softcap=None,
    alibi_slopes=None,
    bias=None,
    dlse=None,
    score_grads: bool = False,
):
    """(dq, dk, dv) fp32, given the final (merged) out and lse of every query row; with ``score_grads``
    also ``ds`` [B, Hq, n, m] fp32, the gradient with respect to the modified scores (0 where hidden)."""
    b, hq, n, d = q.shape
    hkv, m = k.size(1), k.size(2)
    dout = dout.to(q.dtype)  # the kernels' dots take one dtype (the forward's fp32 out may bring an fp32 dout)
    q, k, v, dout = (t.contiguous() for t in (q, k, v, dout))  # the gradients are written with these strides
    q_pos, kv_pos = _positions(q_pos, q), _positions(kv_pos, q)
    delta = (dout.float() * out.float()).sum(-1)
    if dlse is not None:
        delta = delta - dlse.float()
    lse, delta = lse.float().contiguous(), delta.contiguous()
    dq = torch.empty((b, hq, n, d), dtype=torch.float32, device=q.device)
    dk = torch.empty((b, hkv, m, d), dtype=torch.float32, device=q.device)
    dv = torch.empty((b, hkv, m, d), dtype=torch.float32, device=q.device)
    ds = torch.zeros((b, hq, n, m), dtype=torch.float32, device=q.device) if score_grads else None
    config = _config(q)
    mask_bytes, mask_strides, tiles, tile_strides = _mask_args(
        mask, (b, hq, n, m), config["BLOCK_M"], config["BLOCK_N"], q.device
    )
    score_ptrs, bias_strides, cap, score_flags = _score_args(softcap, alibi_slopes, bias, (b, hq, n, m), q.device)
    flags = dict(
        GROUP=hq // hkv,
        IS_CAUSAL=bool(is_causal),
        HAS_WINDOW=window is not None,
        HAS_MASK=mask is not None,
        **score_flags,
    )
    scalars = (n, m, float(scale), int(window or 0), int(NO_BOUND.value if seq_bound is None else seq_bound), cap)
    strides = (
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *dout.stride(),
        *mask_strides,
        *tile_strides,
        *bias_strides,
        *lse.stride(),
    )
    _dq_kernel[(triton.cdiv(n, config["BLOCK_M"]) * b * hq,)](
        q,
        k,
        v,
        dout,
        lse,
        delta,
        q_pos,
        kv_pos,
        mask_bytes,
        tiles,
        *score_ptrs,
        dq,
        ds,
        *strides,
        hq,
        *scalars,
        **flags,
        STORE_DS=bool(score_grads),
        **config,
    )
    _dkdv_kernel[(triton.cdiv(m, config["BLOCK_N"]) * b * hkv,)](
        q,
        k,
        v,
        dout,
        lse,
        delta,
        q_pos,
        kv_pos,
        mask_bytes,
        tiles,
        *score_ptrs,
        dk,
        dv,
        *strides,
        hkv,
        *scalars,
        **flags,
        **config,
    )
    return (dq, dk, dv, ds) if score_grads else (dq, dk, dv)
