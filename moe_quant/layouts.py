"""Scale layouts of docs/design.md section 3: the one home of the blocked-offset math.

``blocked_offset`` is plain integer arithmetic, so the same function serves Python
ints, torch index tensors (the reference below) and CuTe-DSL integers (the kernels).

Grouped layouts take ``offs``: int32 cumulative *end* offsets of each group, as
``torch._grouped_mm`` takes them. All shapes are static upper bounds computed from
tensor shapes alone; nothing here reads ``offs`` on the host. Offsets are sanitized
(clamped to ``[0, total]`` and made non-decreasing) before use, so that whatever
``offs`` holds nothing is written outside the output buffers.
"""

from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import guard_or_false

from . import validation as v
from .numerics import BLOCK_SIZE

TILE_ROWS = 128  # rows of one blocked scale tile
TILE_COLS = 4  # scale columns of one tile
TILE_BYTES = TILE_ROWS * TILE_COLS  # 512
M_GROUP_ALIGN = TILE_ROWS  # M-groups: each group's scale rows padded to 128
K_GROUP_ALIGN = BLOCK_SIZE  # K-groups: each group's tokens padded to 32


def ceil_div(a, b):
    return (a + b - 1) // b


def round_up(a, b):
    return ceil_div(a, b) * b


def row_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` with row-major strides, as the kernels read their inputs: ``t.contiguous()``, except that a
    tensor without elements is copied too. PyTorch counts every zero-element tensor as contiguous,
    whatever its strides, so ``contiguous()`` keeps e.g. the zero strides of an expanded gradient
    (``out.sum().backward()`` with M = 0 rows), which the kernels' stride checks reject.

    Under ``torch.compile`` with a data-dependent (unbacked) row count the emptiness test does not guard:
    it is taken as "not known to be empty", and ``contiguous()`` of traced strides makes a copy wherever
    they are not known to be row-major (an expanded gradient included), so either branch is correct."""
    n = t.numel()
    # eager: a plain int, no symbolic test (while dynamo traces, type() of a symbolic size answers int too)
    empty = n == 0 if type(n) is int and not torch.compiler.is_compiling() else guard_or_false(n == 0)
    if empty:
        return t.clone(memory_format=torch.contiguous_format)  # no data: costs nothing
    return t.contiguous()


def blocked_offset(r, c, n_col_tiles):
    """Byte offset of scale ``(r, c)`` inside a blocked matrix with ``n_col_tiles`` tiles per row-tile.

    128x4 tiles of 512 bytes, row-tile-major; in a tile, rows b, 32+b, 64+b, 96+b share one
    16-byte line.
    """
    return TILE_BYTES * (n_col_tiles * (r // TILE_ROWS) + c // TILE_COLS) + tile_byte(r, c)


def tile_byte(r, c):
    """Byte of scale ``(r, c)`` inside its 512-byte 128x4 tile (rows b, 32+b, 64+b, 96+b share one 16-byte
    line): the in-tile part of :func:`blocked_offset`, also what the kernels gather a tile in shared memory by."""
    return 16 * (r % 32) + 4 * ((r // 32) % 4) + (c % TILE_COLS)


def blocked_shape(rows: int, cols: int) -> tuple[int, int]:
    """Padded ``(128*ceil(rows/128), 4*ceil(cols/4))`` shape of a blocked scale matrix."""
    return round_up(rows, TILE_ROWS), round_up(cols, TILE_COLS)


def whole_scale_tiles(cols: int) -> bool:
    """``cols`` scale columns fill whole 4-column tiles (no padding column): the condition under which blocked
    scales concatenate along columns (:func:`concat_blocked_cols`)."""
    return cols % TILE_COLS == 0


def concat_blocked_cols(left: torch.Tensor, right: torch.Tensor, left_cols: int) -> torch.Tensor:
    """The blocked (or M-groups blocked) scale matrix of ``[L | R]``, columns concatenated, from those of ``L``
    (``left_cols`` scale columns, before padding) and ``R`` (same row count). Exact where ``left_cols`` fills
    whole tiles (:func:`whole_scale_tiles`, so no padding column sits between the two): tiles are
    row-tile-major with the column tiles inside, and every group of the M-groups layout starts on a 128-row
    tile. Rows past the last whole row tile hold no scale in either layout (the groups' padded rows end on a
    tile) and come back zero."""
    rows, cl = left.shape
    if not whole_scale_tiles(left_cols) or cl != left_cols or right.shape[0] != rows:
        raise ValueError(f"concat_blocked_cols: left ({left_cols} scale columns, buffer {tuple(left.shape)}) must "
                         f"be whole tiles of {TILE_COLS} scale columns and right {tuple(right.shape)} its row count")
    whole = rows // TILE_ROWS
    lb, rb = left.view(torch.uint8), right.view(torch.uint8)
    tiles = torch.cat([lb[:whole * TILE_ROWS].reshape(whole, -1, TILE_BYTES),
                       rb[:whole * TILE_ROWS].reshape(whole, -1, TILE_BYTES)], 1)
    out = torch.cat([tiles.reshape(-1), lb.new_zeros((rows - whole * TILE_ROWS) * (cl + right.shape[1]))])
    return out.view(rows, cl + right.shape[1]).view(left.dtype)


def m_groups_blocked_shape(m: int, cols: int, n_groups: int) -> tuple[int, int]:
    """Static upper-bound shape of the M-groups blocked scale buffer: ``(M + 128 G, 4 nc)``."""
    return m + TILE_ROWS * n_groups, round_up(cols, TILE_COLS)


def k_groups_padded_len(m: int, n_groups: int) -> int:
    """Static upper bound of the per-group-padded token count: ``round_up(M, 32) + 32 G``."""
    return round_up(m, K_GROUP_ALIGN) + K_GROUP_ALIGN * n_groups


def k_groups_blocked_shape(rows: int, m: int, n_groups: int) -> tuple[int, int]:
    """Static upper-bound shape of the K-groups blocked scale buffer: ``(Rp, ceil(M/32) + 4 G)``."""
    return round_up(rows, TILE_ROWS), ceil_div(m, BLOCK_SIZE) + TILE_COLS * n_groups


def k_groups_plain_shape(rows: int, m: int, n_groups: int) -> tuple[int, int]:
    """Shape of the plain K-groups scales of per-group-padded data: ``(R, Mp/32)``, ``Mp = k_groups_padded_len(m,
    G)``: row r that of column r of the ``(M, R)`` tensor, column j that of padded tokens ``[32 j, 32 j + 32)`` (zero
    outside groups; :func:`moe_quant.reference.quantize_colwise_k_groups_plain`, :func:`unblock_k_groups`)."""
    return rows, k_groups_padded_len(m, n_groups) // BLOCK_SIZE


def k_groups_plain_offset(r, token, mp):
    """Byte of the scale of (column ``r``, padded token ``token``) in the plain K-groups scales
    (:func:`k_groups_plain_shape`) of data padded to ``mp`` tokens: plain integer arithmetic (ints, index tensors,
    CuTe-DSL integers: the ``cols_fp8`` block kernels write their scales by it)."""
    return r * (mp // BLOCK_SIZE) + token // BLOCK_SIZE


# ----------------------------------------------------------------------------- groups


def sanitize_offsets(offs: torch.Tensor, total: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Group ends clamped to ``[0, total]`` and made non-decreasing (``dtype``, on ``offs``' device, no sync).

    Valid offsets come back unchanged; whatever garbage ``offs`` holds, the result describes
    groups inside ``[0, total)``, which is what every kernel and GEMM is given. ``dtype=torch.int32``
    of int32 ``offs`` (what the GEMMs take) is two kernels and no conversion.
    """
    if dtype == torch.int32 and offs.dtype == torch.int32:
        # int32 values are <= 2**31 - 1, so a larger bound clamps nothing (and does not fit the dtype)
        hi = total if isinstance(total, torch.SymInt) or total < 2**31 else 2**31 - 1
        return offs.clamp(0, hi).cummax(0).values
    return offs.to(torch.int64).clamp(0, total).cummax(0).values.to(dtype)


def group_bounds(offs: torch.Tensor, total: int, align: int):
    """Per-group ``(starts, sizes, padded_starts, padded_ends)`` as int64 device tensors.

    ``offs`` is sanitized first (:func:`sanitize_offsets`). Padded sizes are
    ``round_up(size, align)``; padded starts are their exclusive prefix sum.
    """
    ends = sanitize_offsets(offs, total)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    sizes = ends - starts
    padded = round_up(sizes, align)
    padded_ends = torch.cumsum(padded, 0)
    return starts, sizes, padded_ends - padded, padded_ends


def group_of(index: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Group id of each index (``len(ends)`` where past the last group)."""
    return torch.searchsorted(ends, index, right=True)


def padded_group_offsets(offs: torch.Tensor, total: int, align: int = K_GROUP_ALIGN) -> torch.Tensor:
    """int32 end offsets of the groups after padding each to a multiple of ``align``.

    ``offs``: int32 (G,) group ends (sanitized against ``total``, the unpadded row count);
    ``align``: a positive int.
    """
    total = v.check_size("total", total)
    align = v.check_size("align", align)
    if not isinstance(align, torch.SymInt) and align == 0:
        raise ValueError("align must be a positive int, got 0")
    v.check_offsets(offs, n_groups=None, total=total, device=getattr(offs, "device", None), validate=False)
    return group_bounds(offs, total, align)[3].to(torch.int32)


def received_group_table(counts: torch.Tensor, total: int):
    """The sanitized blocks of ``counts (R, E)`` for ``total`` rows received by an expert-parallel all-to-all
    (rank-major; :mod:`moe_quant.ep.permute` holds the semantics), as int64 device tensors:
    ``(src_starts (R, E), sizes (R, E), dst_starts (R, E), offs (E,) int32)``.

    ``src_starts`` index the input (r-major), ``dst_starts`` the output (expert-major); ``offs`` are
    the cumulative group ends of the E experts. No host synchronization.
    """
    n_ranks, n_experts = counts.shape
    c = counts.to(torch.int64).clamp(min=0).reshape(-1)
    src_ends = torch.cumsum(c, 0).clamp(max=total)  # running total clamped to M, r-major
    src_starts = torch.cat([src_ends.new_zeros(1), src_ends[:-1]])[: c.numel()]  # previous clamped end
    sizes = src_ends - src_starts
    sizes_er = sizes.view(n_ranks, n_experts).t().reshape(-1)  # expert-major
    dst_ends_er = torch.cumsum(sizes_er, 0)
    dst_starts = (dst_ends_er - sizes_er).view(n_experts, n_ranks).t()
    offs = sizes.view(n_ranks, n_experts).sum(0).cumsum(0).to(torch.int32)
    return src_starts.view(n_ranks, n_experts), sizes.view(n_ranks, n_experts), dst_starts, offs


# ----------------------------------------------------------------------------- plain <-> blocked


def _flat_index_2d(rows: int, cols: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    r = torch.arange(rows, device=device).unsqueeze(1).expand(rows, cols)
    c = torch.arange(cols, device=device).unsqueeze(0).expand(rows, cols)
    return r, c


def _scatter_bytes(numel: int, dest: torch.Tensor, src: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Zero uint8 buffer of ``numel`` bytes with ``src[keep]`` written at ``dest[keep]``.

    Dropped elements go to one trash byte past the end, so no host sync is needed.
    """
    out = torch.zeros(numel + 1, dtype=torch.uint8, device=src.device)
    dest = torch.where(keep, dest, numel)
    out.scatter_(0, dest.reshape(-1), src.reshape(-1))
    return out[:numel]


def _as_bytes(scales: torch.Tensor, name: str = "scales", ndim: int | None = None) -> torch.Tensor:
    if not isinstance(scales, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of uint8 or float8_e8m0fnu, got {type(scales).__name__}")
    if scales.dtype not in (torch.uint8, torch.float8_e8m0fnu):
        raise TypeError(f"{name} must be uint8 or float8_e8m0fnu, got {scales.dtype}")
    if ndim is not None and scales.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(scales.shape)}")
    return scales.view(torch.uint8)


def _check_blocked_size(blocked: torch.Tensor, expected: tuple, what: str) -> None:
    """A blocked buffer is either the ``expected`` 2-D shape or the same bytes flattened."""
    numel = 1
    for d in expected:
        numel *= d
    if blocked.ndim == 1 and blocked.numel() == numel:
        return
    v.check_shape("blocked", blocked, expected, what)


def _group_offsets(offs, scales: torch.Tensor, total) -> None:
    v.check_offsets(offs, n_groups=None, total=total, device=scales.device, validate=False)


def _like(out: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return out.view(scales.dtype)


def to_blocked(scales: torch.Tensor) -> torch.Tensor:
    """Plain ``(R, C)`` scales -> blocked, as a ``(128 nr, 4 nc)`` tensor whose bytes are in blocked order."""
    s = _as_bytes(scales, ndim=2)
    rows, cols = s.shape
    rp, cp = blocked_shape(rows, cols)
    r, c = _flat_index_2d(rows, cols, s.device)
    dest = blocked_offset(r, c, cp // TILE_COLS)
    out = _scatter_bytes(rp * cp, dest, s, torch.ones_like(dest, dtype=torch.bool))
    return _like(out.view(rp, cp), scales)


def from_blocked(blocked: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`to_blocked`: the plain ``(rows, cols)`` scales.

    ``blocked`` must be the ``(128 ceil(rows/128), 4 ceil(cols/4))`` buffer :func:`to_blocked` returns
    for that ``rows``/``cols`` (or its bytes flattened).
    """
    _as_bytes(blocked, "blocked")
    rows, cols = v.check_size("rows", rows), v.check_size("cols", cols)
    _check_blocked_size(blocked, blocked_shape(rows, cols), f"the blocked layout of rows={rows}, cols={cols}")
    b = _as_bytes(blocked, "blocked").reshape(-1)
    r, c = _flat_index_2d(rows, cols, b.device)
    out = b[blocked_offset(r, c, blocked_shape(rows, cols)[1] // TILE_COLS)]
    return _like(out, blocked)


def to_blocked_3d(scales: torch.Tensor) -> torch.Tensor:
    """Per-expert scales ``(E, R, C)`` -> ``(E, 128 nr * 4 nc)``: ``out[e] = blocked(scales[e])``."""
    s = _as_bytes(scales, ndim=3)
    e, rows, cols = s.shape
    rp, cp = blocked_shape(rows, cols)
    r, c = _flat_index_2d(rows, cols, s.device)
    dest = blocked_offset(r, c, cp // TILE_COLS)
    dest = dest.unsqueeze(0) + rp * cp * torch.arange(e, device=s.device).view(e, 1, 1)
    out = _scatter_bytes(e * rp * cp, dest, s, torch.ones_like(dest, dtype=torch.bool))
    return _like(out.view(e, rp * cp), scales)


def from_blocked_3d(blocked: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`to_blocked_3d`: ``(E, rows, cols)``; ``blocked`` is ``(E, 128 nr * 4 nc)``."""
    b = _as_bytes(blocked, "blocked", ndim=2)
    rows, cols = v.check_size("rows", rows), v.check_size("cols", cols)
    rp, cp = blocked_shape(rows, cols)
    v.check_shape("blocked", blocked, (b.shape[0], rp * cp), f"(E, blocked bytes of rows={rows}, cols={cols})")
    e = b.shape[0]
    r, c = _flat_index_2d(rows, cols, b.device)
    idx = blocked_offset(r, c, blocked_shape(rows, cols)[1] // TILE_COLS).reshape(-1)
    return _like(b[:, idx].view(e, rows, cols), blocked)


# ----------------------------------------------------------------------------- M groups


def _m_groups_dest(m: int, cols: int, offs: torch.Tensor):
    """Destination byte and validity of every plain scale ``(r, c)`` in the M-groups buffer."""
    starts, sizes, pstarts, _ = group_bounds(offs, m, M_GROUP_ALIGN)
    r, c = _flat_index_2d(m, cols, offs.device)
    g = group_of(torch.arange(m, device=offs.device), starts + sizes)
    keep = (g < offs.numel()).unsqueeze(1).expand(m, cols)
    g = g.clamp(max=offs.numel() - 1).unsqueeze(1)
    cp = round_up(cols, TILE_COLS)
    dest = pstarts[g] * cp + blocked_offset(r - starts[g], c, cp // TILE_COLS)
    return dest, keep


def to_blocked_m_groups(scales: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rowwise scales ``(M, C)`` with token groups along M -> M-groups blocked buffer ``(M + 128 G, 4 nc)``.

    Group g's rows are blocked on their own and placed at padded row
    ``P_g = sum_{j<g} 128 ceil(m_j/128)``. Rows past the last offset are not stored; every
    other byte of the buffer is zero. ``offs``: int32 (G,) group ends on the scales' device
    (sanitized, see the module doc).
    """
    s = _as_bytes(scales, ndim=2)
    m, cols = s.shape
    _group_offsets(offs, s, m)
    shape = m_groups_blocked_shape(m, cols, offs.numel())
    if offs.numel() == 0:
        return _like(torch.zeros(shape, dtype=torch.uint8, device=s.device), scales)
    dest, keep = _m_groups_dest(m, cols, offs)
    out = _scatter_bytes(shape[0] * shape[1], dest, s, keep)
    return _like(out.view(shape), scales)


def from_blocked_m_groups(blocked: torch.Tensor, offs: torch.Tensor, m: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`to_blocked_m_groups`; rows outside every group read as zero.

    ``blocked`` is the ``(m + 128 G, 4 ceil(cols/4))`` buffer (or its bytes flattened).
    """
    _as_bytes(blocked, "blocked")
    m, cols = v.check_size("m", m), v.check_size("cols", cols)
    _group_offsets(offs, blocked, m)
    _check_blocked_size(
        blocked,
        m_groups_blocked_shape(m, cols, offs.numel()),
        f"the M-groups layout of m={m}, cols={cols}, G={offs.numel()}",
    )
    b = _as_bytes(blocked).reshape(-1)
    if offs.numel() == 0:
        return _like(torch.zeros(m, cols, dtype=torch.uint8, device=b.device), blocked)
    dest, keep = _m_groups_dest(m, cols, offs)
    out = torch.where(keep, b[torch.where(keep, dest, 0)], 0)
    return _like(out, blocked)


# ----------------------------------------------------------------------------- K groups


def _k_groups_columns(rows: int, m: int, offs: torch.Tensor):
    """Per scale column of per-group-padded data, ``(base, stride, keep)`` (int64, ``(n_cols,)``): scale ``(r, j)``
    lies at byte ``base[j] + (r // 128) stride[j] + tile_byte(r, 0)`` of the K-groups blocked buffer, where ``keep[j]``
    (a column of a group).

    Scale column ``j`` covers padded tokens ``[32 j, 32 j + 32)``; group g owns columns
    ``[P_g/32, P_g/32 + c_g)`` with ``c_g = ceil(m_g/32)``, blocked on its own with
    ``ceil(c_g/4)`` column tiles at byte ``S_g * Rp``, ``S_g = sum_{j<g} 4 ceil(c_j/4)``.
    """
    n_cols = k_groups_plain_shape(rows, m, offs.numel())[1]
    _, sizes, pstarts, pends = group_bounds(offs, m, K_GROUP_ALIGN)
    c_g = ceil_div(sizes, BLOCK_SIZE)
    tiles_g = ceil_div(c_g, TILE_COLS)
    s_g = torch.cumsum(tiles_g, 0) - tiles_g  # in column tiles
    j = torch.arange(n_cols, device=offs.device)
    g = group_of(j * BLOCK_SIZE, pends)
    keep = g < offs.numel()
    g = g.clamp(max=offs.numel() - 1)
    local = j - pstarts[g] // BLOCK_SIZE
    keep &= local < c_g[g]
    rp = round_up(rows, TILE_ROWS)
    base = s_g[g] * TILE_COLS * rp + TILE_BYTES * (local // TILE_COLS) + local % TILE_COLS
    return base, TILE_BYTES * tiles_g[g], keep


def _k_groups_dest(rows: int, m: int, offs: torch.Tensor):
    """Destination byte and validity of every scale ``(r, j)`` of per-group-padded data (:func:`_k_groups_columns`
    over the full ``(rows, n_cols)`` grid)."""
    base, stride, keep = _k_groups_columns(rows, m, offs)
    r = torch.arange(rows, device=offs.device).unsqueeze(1)
    dest = base.unsqueeze(0) + (r // TILE_ROWS) * stride.unsqueeze(0) + tile_byte(r, 0)
    return dest, keep.unsqueeze(0).expand(rows, keep.numel())


def to_blocked_k_groups(scales: torch.Tensor, offs: torch.Tensor, m: int) -> torch.Tensor:
    """Colwise scales of per-group-padded data -> K-groups blocked buffer ``(Rp, ceil(M/32) + 4 G)``.

    ``scales`` is ``(R, k_groups_padded_len(m, G) / 32)``: scale column j covers padded tokens
    ``[32 j, 32 j + 32)`` (see :func:`quantize_colwise_k_groups` in ``reference``). ``m`` is the
    unpadded token count and ``offs`` the unpadded group ends.
    """
    s = _as_bytes(scales, ndim=2)
    m = v.check_size("m", m)
    _group_offsets(offs, s, m)
    rows = s.shape[0]
    v.check_shape(
        "scales", s, k_groups_plain_shape(rows, m, offs.numel()),
        f"(R, (round_up(m, 32) + 32 G) / 32) for m={m}, G={offs.numel()}",
    )
    shape = k_groups_blocked_shape(rows, m, offs.numel())
    if offs.numel() == 0:
        return _like(torch.zeros(shape, dtype=torch.uint8, device=s.device), scales)
    dest, keep = _k_groups_dest(rows, m, offs)
    out = _scatter_bytes(shape[0] * shape[1], dest, s, keep)
    return _like(out.view(shape), scales)


def from_blocked_k_groups(blocked: torch.Tensor, offs: torch.Tensor, rows: int, m: int) -> torch.Tensor:
    """Inverse of :func:`to_blocked_k_groups`: ``(rows, k_groups_padded_len(m, G) / 32)``, zero outside groups.

    ``blocked`` is the ``(128 ceil(rows/128), ceil(m/32) + 4 G)`` buffer (or its bytes flattened).
    """
    _as_bytes(blocked, "blocked")
    rows, m = v.check_size("rows", rows), v.check_size("m", m)
    _group_offsets(offs, blocked, m)
    _check_blocked_size(
        blocked,
        k_groups_blocked_shape(rows, m, offs.numel()),
        f"the K-groups layout of rows={rows}, m={m}, G={offs.numel()}",
    )
    return unblock_k_groups(blocked, offs, rows, m)


def unblock_k_groups(blocked: torch.Tensor, offs: torch.Tensor, rows: int, m: int) -> torch.Tensor:
    """:func:`from_blocked_k_groups` of checked arguments (``offs`` sanitized int32 on ``blocked``'s device): device
    ops only, no host read (the block keeps x's colwise scales plain for the emulated GEMM's dequantization).

    The source byte of scale ``(r, j)`` is ``col_base[j] + (r // 128) col_stride[j] + tile_row[r]``
    (:func:`_k_groups_columns`: a part per column and a part per row), so the ``(rows, n_cols)`` index is one
    broadcast multiply and two adds (int32 where the buffer allows) and the bytes one gather; a column outside every
    group reads a 512-byte zero pad past the buffer (``tile_row`` < 512)."""
    b = _as_bytes(blocked).reshape(-1)
    n_cols = k_groups_plain_shape(rows, m, offs.numel())[1]
    if offs.numel() == 0:
        return _like(torch.zeros(rows, n_cols, dtype=torch.uint8, device=b.device), blocked)
    col_base, col_stride, tile_row = _k_groups_source(rows, m, offs, b.numel())
    src = torch.arange(rows, device=b.device, dtype=col_base.dtype).div_(TILE_ROWS, rounding_mode="floor")
    src = src.unsqueeze(1) * col_stride.unsqueeze(0)
    src += col_base.unsqueeze(0)
    src += tile_row.unsqueeze(1)
    padded = torch.cat([b, b.new_zeros(TILE_BYTES)])
    return _like(padded.index_select(0, src.view(-1)).view(rows, n_cols), blocked)


def _k_groups_source(rows: int, m: int, offs: torch.Tensor, n_bytes: int):
    """``(col_base (n_cols,), col_stride (n_cols,), tile_row (rows,))`` of :func:`unblock_k_groups`: scale ``(r, j)``
    of per-group-padded data lies at byte ``col_base[j] + (r // 128) col_stride[j] + tile_row[r]`` of the K-groups
    blocked buffer (``n_bytes`` long; :func:`_k_groups_columns`); a column outside every group has ``col_base =
    n_bytes`` and stride 0 (the zero pad). int32 when every index fits, else int64."""
    dtype = torch.int32 if n_bytes + TILE_BYTES < 2**31 else torch.int64
    base, stride, keep = _k_groups_columns(rows, m, offs)
    col_base = torch.where(keep, base, n_bytes).to(dtype)
    col_stride = torch.where(keep, stride, 0).to(dtype)
    return col_base, col_stride, tile_byte(torch.arange(rows, device=offs.device, dtype=dtype), 0)
