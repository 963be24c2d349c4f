"""Sign-bit packing, dispatched to the kernel of the tensor's device.

Public API:
  packbits(x)              -> uint8[ceil(n/8)]  (x: any float dtype, any shape)
  unpackbits(packed, n)    -> float32[n] of +-1
Used by the compressed backends (one scale per block of `block` elements):
  compensate(...)          error feedback, pass 1: x = buf + err, sum of x^2 per block
  pack_error(...)          error feedback, pass 2: pack sign(x), err = x - scale * sign(x)
  compress(...)            both passes and the scales between them, in one call (one
                           pass over memory where the kernel fuses them: the CPU's)
  decode_mean(...)         mean over rows of the block's scale * sign
  compress_rows(...)       compress on each row of a message matrix (every rank's
                           row of the all-to-all), in one launch where the kernel can
  decode_rows(...)         each row decoded on its own into its own stretch of out
                           (every rank's decode of the all-gather), in one launch

Wire format (docs/design.md): bit = 1 iff x >= 0, element 8*i + j in bit j of
byte i, identical to numpy.packbits(x >= 0, bitorder="little").

Which kernel runs: host tensors use the CPU builder; device tensors use the
current accelerator's `PackbitsBuilder`. A kernel that cannot be built falls
back to pure torch with one warning. ONEBIT_KERNELS=torch forces the
fallback everywhere (handy for tests and benchmarks).
"""
from __future__ import annotations

import os
import warnings
from typing import Optional

import torch

from .accelerator import get_accelerator
from .wire import SCALE_DTYPES

FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_kernels = {}


def _load(device_type: str):
    from .builders import OpBuilderError, TorchKernels, self_test
    from .accelerator import CpuAccelerator

    if os.environ.get("ONEBIT_KERNELS", "").lower() == "torch":
        return TorchKernels()
    acc = CpuAccelerator() if device_type == "cpu" else get_accelerator()
    builder = acc.create_op_builder("PackbitsBuilder") if acc.name == device_type else None
    if builder is None:
        return TorchKernels()
    try:
        kernels = builder.load()
        # A kernel that cannot run here fails now, where we can fall back.
        self_test(kernels, torch.device("cpu") if device_type == "cpu" else
                  torch.device(device_type, acc.current_device()))
        return kernels
    except (OpBuilderError, OSError, ImportError) as exc:
        warnings.warn(f"onebit: no native packbits kernel for {device_type} ({exc}); "
                      "using the pure-torch path, which is correct but slower",
                      RuntimeWarning, stacklevel=3)
        return TorchKernels()


def kernels_for(device: torch.device):
    """The kernels object for `device`'s type, loaded (or built) once."""
    k = _kernels.get(device.type)
    if k is None:
        k = _kernels[device.type] = _load(device.type)
    return k


def packbits(x: torch.Tensor) -> torch.Tensor:
    """Pack sign bits of `x` (flattened) into a uint8 tensor of ceil(numel/8) bytes."""
    if not isinstance(x, torch.Tensor) or x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"packbits: x must be a floating tensor of {FLOAT_DTYPES}, "
                         f"got {getattr(x, 'dtype', type(x).__name__)}")
    x = x.contiguous()
    out = torch.empty((x.numel() + 7) // 8, dtype=torch.uint8, device=x.device)
    if x.numel():
        kernels_for(x.device).pack(x, out)
    return out


def unpackbits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """float32 tensor of `numel` signs (+1.0 for a 1 bit, -1.0 for a 0 bit)."""
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8:
        raise ValueError(f"unpackbits: packed must be a uint8 tensor, got "
                         f"{getattr(packed, 'dtype', type(packed).__name__)}")
    if numel < 0 or (numel + 7) // 8 > packed.numel():
        raise ValueError(f"unpackbits: numel={numel} needs {(numel + 7) // 8} bytes, "
                         f"packed has {packed.numel()}")
    out = torch.empty(numel, dtype=torch.float32, device=packed.device)
    if numel:
        one = torch.ones(1, dtype=torch.float32, device=packed.device)
        block = (numel + 7) // 8 * 8  # one block, one scale of 1
        decode_mean(packed.contiguous().reshape(1, -1), one, numel, out, block)
    return out


def decode_mean(bits: torch.Tensor, scales: torch.Tensor, cols: int,
                out: Optional[torch.Tensor], block: int) -> torch.Tensor:
    """out[j] = mean over rows r of scales[r, j // block] * sign(bits[r], j), j < cols.

    bits: uint8 [rows, >= ceil(cols/8)], rows may be strided (message rows
    carry trailing scales); scales: float32 [rows, ceil(cols/block)],
    contiguous; block: a positive multiple of 8.
    """
    if (bits.dtype != torch.uint8 or bits.dim() != 2 or bits.stride(1) != 1
            or bits.shape[1] * 8 < cols or (cols and bits.shape[0] < 1)):
        raise ValueError(f"decode_mean: bits must be uint8 [rows >= 1, >= {(cols + 7) // 8}] with "
                         f"unit inner stride, got {bits.dtype} shape {tuple(bits.shape)} "
                         f"stride {bits.stride()}")
    _check_block(block)
    want = bits.shape[0] * ((cols + block - 1) // block)
    if scales.dtype != torch.float32 or not scales.is_contiguous() or scales.numel() != want:
        raise ValueError(f"decode_mean: scales must be contiguous float32 with {want} elements "
                         f"(rows x ceil(cols/block)), got {scales.dtype} {tuple(scales.shape)}")
    if out is None:
        out = torch.empty(cols, dtype=torch.float32, device=bits.device)
    elif (out.dtype != torch.float32 or not out.is_contiguous() or out.numel() < cols
          or out.device != bits.device or scales.device != bits.device):
        # (the kernels write cols floats from out's first byte)
        raise ValueError(f"decode_mean: out must be contiguous float32 with at least {cols} "
                         f"elements on {bits.device}, as scales, got {out.dtype} "
                         f"{tuple(out.shape)} on {out.device}")
    if cols:
        kernels_for(bits.device).decode(bits, scales, block, cols, out)
    return out


def _check_block(block: int) -> None:
    if not isinstance(block, int) or block <= 0 or block % 8:
        raise ValueError(f"block must be a positive multiple of 8, got {block!r}")


def compensate(buf: torch.Tensor, err: torch.Tensor, sumsq: torch.Tensor, block: int) -> None:
    """Error feedback, pass 1: err <- x = buf (zero-padded to err.numel()) + err,
    and sumsq[k] = sum of x^2 over block k (float64, one fixed order per
    block, so a block's sum never depends on where the block sits).

    buf, err: float32, contiguous; block divides err.numel()."""
    _check_block(block)
    kernels_for(err.device).compensate(buf, err, sumsq, block)


def pack_error(err: torch.Tensor, scales: torch.Tensor, block: int, out: torch.Tensor) -> None:
    """Error feedback, pass 2: out = packbits(err); err <- err - scales[k] *
    sign(err) on block k (sign(0) = +1). scales: float32, one per block."""
    _check_block(block)
    kernels_for(err.device).pack_error(err, scales, block, out)


def compress(buf: torch.Tensor, err: torch.Tensor, counts: torch.Tensor, block: int,
             scale_dtype: torch.dtype, scales_out: torch.Tensor, bits_out: torch.Tensor) -> None:
    """Error feedback on one message: err <- x = buf (zero-padded to
    err.numel()) + err; block k's scale s_k = sqrt(sum of x^2 / counts[k])
    (float64), rounded to `scale_dtype`, goes little-endian into the bytes
    `scales_out`; bits_out = packbits(x); err <- x - s_k * sign(x), with the
    rounded s_k, which is what the receivers will use.

    counts: float64, one per block (real elements, at least 1). A kernel
    with a fused `compress` (the CPU's) does this in one pass over memory;
    the others run compensate and pack_error, with the scales in torch
    between them: the same bits either way."""
    _check_block(block)
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"compress: scale_dtype must be one of {SCALE_DTYPES}, got {scale_dtype}")
    # The kernels take raw pointers: what they read and write must be there.
    n = err.numel()
    for name, t, dtype in (("buf", buf, torch.float32), ("err", err, torch.float32),
                           ("counts", counts, torch.float64), ("scales_out", scales_out, torch.uint8),
                           ("bits_out", bits_out, torch.uint8)):
        if t.dtype != dtype or not t.is_contiguous() or t.device != err.device:
            raise ValueError(f"compress: {name} must be contiguous {dtype} on {err.device}, got "
                             f"{t.dtype} {tuple(t.shape)} on {t.device}")
    if n % block or buf.numel() > n or counts.numel() != n // block or bits_out.numel() < n // 8:
        raise ValueError(f"compress: err ({n}) must be whole blocks of {block}, buf at most as "
                         f"long ({buf.numel()}), counts one per block ({counts.numel()}, need "
                         f"{n // block}), bits_out at least {n // 8} bytes ({bits_out.numel()})")
    if scales_out.numel() != counts.numel() * scale_dtype.itemsize:
        raise ValueError(f"compress: scales_out needs {counts.numel() * scale_dtype.itemsize} "
                         f"bytes, got {scales_out.numel()}")
    if n == 0:
        return
    k = kernels_for(err.device)
    if hasattr(k, "compress"):
        k.compress(buf, err, counts, block, scales_out, bits_out)
    else:
        composed_compress(k, buf, err, counts, block, scale_dtype, scales_out, bits_out)


def composed_compress(k, buf, err, counts, block, scale_dtype, scales_out, bits_out) -> None:
    """`compress` from kernels `k`'s two passes, the scales in torch between them."""
    sumsq = torch.empty(err.numel() // block, dtype=torch.float64, device=err.device)
    k.compensate(buf, err, sumsq, block)
    scales = sumsq.div_(counts).sqrt_().to(scale_dtype)
    scales_out.copy_(scales.view(torch.uint8).view(-1))
    k.pack_error(err, scales.float(), block, bits_out)


def compress_rows(buf: torch.Tensor, err: torch.Tensor, counts: torch.Tensor, block: int,
                  scale_dtype: torch.dtype, messages: torch.Tensor, code_bytes: int) -> None:
    """`compress` on each row r of `err`, into message row r: its codes in
    messages[r, :code_bytes], its scales right after. Row r's buf is
    buf[r * S:][:n] (S = err.stride(0), n = err.shape[1]), zero past buf's
    end; its counts are counts[r]. One launch where the kernel has
    `compress_rows` (the CPU's, CUDA's, SYCL's); else a call per row. The
    same bits either way: every block lies inside one row.

    err: fp32 [rows, n], unit inner stride (the worker's error seen as one
    row per rank); buf: fp32, contiguous; counts: float64 [rows, n / block],
    unit inner stride, row stride S / block; messages: uint8 [rows, >=
    code_bytes + n / block * scale bytes], unit inner stride."""
    _check_block(block)
    _check_rows(buf, err, counts, block, scale_dtype, messages, code_bytes)
    if err.numel() == 0:
        return
    k = kernels_for(err.device)
    if hasattr(k, "compress_rows"):
        scale_end = code_bytes + counts.shape[1] * scale_dtype.itemsize
        k.compress_rows(buf, err, counts, block, messages[:, code_bytes:scale_end],
                        messages[:, :code_bytes])
    else:
        compress_each_row(compress, buf, err, counts, block, scale_dtype, messages, code_bytes)


def compress_each_row(compress_one, buf, err, counts, block, scale_dtype, messages,
                      code_bytes) -> None:
    """`compress_rows` as one call of `compress_one` (`compress`'s arguments) per row."""
    stride, n = err.stride(0), err.shape[1]
    scale_end = code_bytes + counts.shape[1] * scale_dtype.itemsize
    for r in range(err.shape[0]):
        lo = r * stride
        compress_one(buf[lo:max(lo, min(lo + n, buf.numel()))], err[r], counts[r], block,
                     scale_dtype, messages[r, code_bytes:scale_end], messages[r, :code_bytes])


def _check_rows(buf, err, counts, block, scale_dtype, messages, code_bytes) -> None:
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"compress_rows: scale_dtype must be one of {SCALE_DTYPES}, "
                         f"got {scale_dtype}")
    if err.dtype != torch.float32 or err.dim() != 2 or err.stride(1) != 1:
        raise ValueError(f"compress_rows: err must be float32 [rows, n] with unit inner stride, "
                         f"got {err.dtype} {tuple(err.shape)} stride {err.stride()}")
    rows, n = err.shape
    if n % block:
        raise ValueError(f"compress_rows: a row of err ({n}) must be whole blocks of {block}")
    if rows > 1 and (err.stride(0) < n or err.stride(0) % block):
        raise ValueError(f"compress_rows: err's rows must not overlap and start on blocks "
                         f"(row stride {err.stride(0)}, n {n}, block {block})")
    if buf.dtype != torch.float32 or not buf.is_contiguous():
        raise ValueError("compress_rows: buf must be contiguous float32")
    if (counts.dtype != torch.float64 or tuple(counts.shape) != (rows, n // block)
            or counts.stride(1) != 1 or (rows > 1 and counts.stride(0) * block != err.stride(0))):
        raise ValueError(f"compress_rows: counts must be float64 [{rows}, {n // block}] laid out "
                         f"like err's blocks, got {counts.dtype} {tuple(counts.shape)} "
                         f"stride {counts.stride()}")
    if code_bytes < (n + 7) // 8:  # every kernel writes n / 8 bytes of signs
        raise ValueError(f"compress_rows: code_bytes ({code_bytes}) must hold the signs of "
                         f"{n} elements ({(n + 7) // 8} bytes)")
    need = code_bytes + n // block * scale_dtype.itemsize
    if (messages.dtype != torch.uint8 or messages.dim() != 2 or messages.shape[0] != rows
            or messages.shape[1] < need or messages.stride(1) != 1
            or (rows > 1 and messages.stride(0) < need)):
        raise ValueError(f"compress_rows: messages must be uint8 [{rows}, >= {need}] with unit "
                         f"inner stride, rows apart, got {messages.dtype} "
                         f"{tuple(messages.shape)} stride {messages.stride()}")
    if len({t.device for t in (buf, err, counts, messages)}) != 1:
        raise ValueError("compress_rows: buf, err, counts and messages must share a device")


def decode_rows(bits: torch.Tensor, scales: torch.Tensor, cols: int, out: torch.Tensor,
                stride: int, block: int) -> None:
    """Each row r decoded on its own: out[r * stride + j] = scales[r, j //
    block] * sign(bits[r], j), for j < cols and r * stride + j < out.numel()
    (the last rows may be cut short, or left out). One launch where the
    kernel has `decode_rows`, else a one-row `decode_mean` per row: the same
    bits.

    bits: uint8 [rows, >= ceil(cols/8)], unit inner stride; scales: float32
    [rows, ceil(cols/block)], contiguous; out: float32, contiguous; stride
    >= cols."""
    _check_block(block)
    if bits.dtype != torch.uint8 or bits.dim() != 2 or bits.stride(1) != 1 or bits.shape[1] * 8 < cols:
        raise ValueError(f"decode_rows: bits must be uint8 [rows, >= {(cols + 7) // 8}] with "
                         f"unit inner stride, got shape {tuple(bits.shape)}")
    want = (bits.shape[0], -(-cols // block))
    if scales.dtype != torch.float32 or not scales.is_contiguous() or tuple(scales.shape) != want:
        raise ValueError(f"decode_rows: scales must be contiguous float32 {list(want)}, got "
                         f"{scales.dtype} {tuple(scales.shape)}")
    if out.dtype != torch.float32 or not out.is_contiguous() or stride < cols:
        raise ValueError(f"decode_rows: out must be contiguous float32 and stride ({stride}) at "
                         f"least cols ({cols})")
    if len({t.device for t in (bits, scales, out)}) != 1:
        raise ValueError("decode_rows: bits, scales and out must share a device")
    k = kernels_for(out.device)
    if hasattr(k, "decode_rows"):
        if cols and out.numel():
            k.decode_rows(bits, scales, block, cols, out, stride)
    else:
        decode_each_row(decode_mean, bits, scales, cols, out, stride, block)


def decode_each_row(decode_one, bits, scales, cols, out, stride, block) -> None:
    """`decode_rows` as one call of `decode_one` (`decode_mean`'s arguments) per row."""
    for r in range(bits.shape[0]):
        lo = r * stride
        hi = min(lo + cols, out.numel())
        if lo < hi:
            decode_one(bits[r:r + 1], scales[r, :-(-(hi - lo) // block)], hi - lo, out[lo:hi],
                       block)
