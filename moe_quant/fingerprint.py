"""The byte fingerprint of a tensor: one int64 that changes when the tensor's bytes change (the exit check of
:func:`moe_quant.reuse_quantized_weights`).

Definition. Let ``b_0 .. b_{n-1}`` be the bytes of ``t`` in row-major element order (the bytes of
``t.reshape(-1)``: storage offset and strides do not enter, the dtype only through the bytes). They form
``N = ceil(n / 8)`` little-endian 64-bit words ``w_0 .. w_{N-1}``, the last one zero-padded. Then, all
arithmetic modulo ``2**64``::

    F(t)    = sum_{i < N} term(w_i, i)
    term    = mix(w XOR (i * WORD_KEY))
    mix(x)  = xs(xs(x) * WORD_MIX),   xs(x) = x XOR (x >> 32)   (logical shift)

returned as an int64 tensor of one element (two's complement) on ``t``'s device; ``WORD_KEY`` and
``WORD_MIX`` are odd constants, defined once in :mod:`moe_quant.kernels.fingerprint.config` (the kernel compiles
them in, so they live below it; a change there reaches the kernel's disk-cache hash).

* Integer arithmetic modulo ``2**64`` is exact and its sum does not depend on the order of the terms: the
  chunked reference below and the CUDA kernel (any grid, any split into launches) give the same value.
* Each term is a bijection of its word (XOR with a key, ``xs``, a product with an odd constant: each
  invertible), so a change of any one word -- one flipped bit anywhere, a byte of the zero-padded last word --
  always changes ``F``.
* The position enters before the nonlinear mix, so a swap of two different words (or changes of several)
  changes ``F`` except by an unstructured coincidence. A linear form ``sum w_i * c_i`` with odd ``c_i``
  would not do: ``c_i - c_j`` is even, so swapping two words that differ only in bit 63 never changes it,
  and words that agree in their low bits swapped at a distance of a power of two often do not.

:func:`fingerprint` runs the CuTe-DSL kernel (``moe_quant/kernels/fingerprint/kernel.py``: one read of the bytes,
two launches for an aligned tensor) where the quantization kernels run, the reference elsewhere.
"""

from __future__ import annotations

import torch

from . import backends
from .kernels.fingerprint.config import WORD_KEY, WORD_MIX, as_int64  # the definition's constants (see there)

CHUNK_WORDS = 1 << 22  # words per step of the reference (bounds its temporaries to a few 32 MiB tensors)
_LOW32 = 0xFFFFFFFF


_KEY = as_int64(WORD_KEY)
_MIX = as_int64(WORD_MIX)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` in row-major element order as a flat uint8 tensor (a view where ``t`` is contiguous)."""
    return t.detach().reshape(-1).view(torch.uint8)


def _xs_(x: torch.Tensor) -> torch.Tensor:
    """``x ^= x >> 32`` (logical shift) in place; ``x`` int64."""
    return x.bitwise_xor_((x >> 32).bitwise_and_(_LOW32))


def word_terms(words: torch.Tensor, first: int) -> torch.Tensor:
    """``term(words[j], first + j)`` for every word of the int64 tensor ``words`` (a new int64 tensor)."""
    x = torch.arange(first, first + words.numel(), dtype=torch.int64, device=words.device)
    x.mul_(_KEY).bitwise_xor_(words)
    return _xs_(_xs_(x).mul_(_MIX))


def _words(part: torch.Tensor) -> torch.Tensor:
    """The uint8 tensor ``part`` as int64 words: a view where its size and offset allow, else a zero-padded copy."""
    if part.numel() % 8 == 0 and part.storage_offset() % 8 == 0:
        return part.view(torch.int64)
    buf = torch.zeros(-(-part.numel() // 8) * 8, dtype=torch.uint8, device=part.device)
    buf[: part.numel()].copy_(part)
    return buf.view(torch.int64)


def reference_words_sum(b: torch.Tensor, first_word: int = 0) -> torch.Tensor:
    """``sum_j term(w_j, first_word + j)`` mod 2**64 over the words ``w_j`` of the flat uint8 tensor ``b`` (any
    length: the last word zero-padded), ``CHUNK_WORDS`` words at a time; an int64 tensor of one element."""
    total = torch.zeros((), dtype=torch.int64, device=b.device)
    step = 8 * CHUNK_WORDS
    for start in range(0, b.numel(), step):
        total += word_terms(_words(b[start:start + step]), first_word + start // 8).sum()
    return total


def reference_fingerprint(t: torch.Tensor) -> torch.Tensor:
    """``F(t)`` in plain PyTorch on ``t``'s device (see the module doc); the kernel's oracle."""
    return reference_words_sum(as_bytes(t))


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """``F(t)`` as an int64 tensor of one element on ``t``'s device, without synchronizing: the CuTe-DSL kernel
    where ``backends.use_quant_kernels`` says the kernels run (Hopper or newer with cutlass-dsl), the
    reference elsewhere. Both give the same value."""
    b = as_bytes(t)
    if b.is_cuda and type(b) is torch.Tensor and backends.use_quant_kernels(b):
        from .kernels.fingerprint import ops as ops_fingerprint

        return ops_fingerprint.fingerprint_bytes(b)
    return reference_words_sum(b)
