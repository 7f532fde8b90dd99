"""Checks shared by the Python front ends, each written once: what the core cannot see (Python
types, devices, this build's backends; scalar arguments as the kernels will hold them, from
which the option objects of _options.py are checked), the optional device-side check of target
values, and the layout fixes the core cannot take (rows or vectors with stride 0)."""

import operator
import struct

import torch

from . import _library

_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
# Magnitudes that round to a normal float32 (round to nearest, ties to even): at least halfway
# between the largest subnormal and the smallest normal (2^-126), below halfway between the
# largest finite float32 and 2^128 (inf). Plain comparisons, which torch.compile traces.
_NORMAL_FROM = 2.0 ** -126 - 2.0 ** -150
_INF_FROM = 2.0 ** 128 - 2.0 ** 103
_INF = float("inf")


def _float32(value):
    """`value` rounded to float32 as the C++ core's Options fields hold it; inf beyond range."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return _INF if value > 0 else -_INF


def _real(value, name, where):
    if type(value) is float:  # the usual case, with nothing to convert
        return value
    # A bool is an int to Python, but softcap=True is a slip, not a cap of 1.
    if isinstance(value, (str, bytes, bool)) or (isinstance(value, torch.Tensor) and value.numel() != 1):
        raise TypeError(f"{where}: {name} must be a real number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{where}: {name} must be a real number, got {value!r}") from None


def _representable(value, name, where, what):
    """A non-zero finite `value` must round to a normal float32: the kernels hold it as a
    float32, and outside that range it would become 0 (an option silently off), inf, or a
    subnormal that keeps only a few of its digits."""
    if value != 0.0 and not _NORMAL_FROM <= abs(value) < _INF_FROM:
        became = ""
        if not torch.compiler.is_compiling():
            f32 = _float32(value)
            became = f" (it would become {'the subnormal ' if f32 != 0.0 and abs(f32) < 1 else ''}{f32!r})"
        raise ValueError(f"{where}: {name}={value!r} cannot be represented in float32, the kernels' "
                         f"type{became}; {what}")
    return value


def ignore_index_of(value, where):
    """`value` as the int64 the core compares targets with. Integers only (anything with
    __index__: int, a numpy integer, a one-element integer tensor), as F.cross_entropy takes them;
    not bool, and not a float, which int() would truncate."""
    if type(value) is int and _INT64_MIN <= value <= _INT64_MAX:  # the usual case
        return value
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        raise TypeError(f"{where}: ignore_index must be an integer, got the bool {value!r}")
    try:
        index = operator.index(value)
    except TypeError:
        raise TypeError(f"{where}: ignore_index must be an integer, got {value!r} "
                        f"({type(value).__name__})") from None
    if not _INT64_MIN <= index <= _INT64_MAX:
        raise ValueError(f"{where}: ignore_index must fit in int64, got {index}")
    return index


def check_target_values(target, vocab, ignore_index, where, *, shift_seq_len=0):
    """Raise ValueError naming the first entry of `target` (flattened) that is neither in
    [0, vocab) nor ignore_index, as the CPU core reports it. The test runs where the target is
    (on a GPU: a few (N,) kernels) and its outcome reaches the host in one copy, the call's
    only synchronisation. With shift_seq_len = S > 0 the first entry of each sequence of S is no
    row's target and is not checked. Under torch.compile the host read is a graph break."""
    t = target.reshape(-1)
    if t.numel() == 0:
        return
    t = t.to(torch.int64)
    bad = (t != ignore_index) & ((t < 0) | (t >= vocab))
    if shift_seq_len > 0:
        bad = bad.view(-1, shift_seq_len)
        bad[:, 0] = False
        bad = bad.view(-1)
    # argmax gives the first maximum: the first bad entry, if any. Tensor indices throughout, so
    # that the one read on the host is the .tolist() below.
    first = torch.argmax(bad.to(torch.uint8)).view(1)
    found, row, value = torch.cat([bad.index_select(0, first).to(torch.int64), first,
                                   t.index_select(0, first)]).tolist()
    if found:
        raise ValueError(f"{where}: target[{row}] = {value} is out of range [0, {vocab}) and is "
                         f"not ignore_index ({ignore_index})")


def unit_stride_vector(v):
    """A 1-D tensor the core can read: stride >= 1 (an expanded vector, stride 0, is copied)."""
    if v is not None and v.dim() == 1 and v.stride(0) < 1:
        return v.clone(memory_format=torch.contiguous_format)
    return v


def check_tensor(value, name, where, optional=False):
    """TypeError unless `value` is a tensor (or, `optional`, None)."""
    if value is None and optional:
        return
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{where}: {name} must be a tensor, got {type(value).__name__}")


def check_same_device(value, name, ref, ref_name, where, verb="is"):
    """ValueError unless `value` (None passes) is on `ref`'s device."""
    if value is not None and value.device != ref.device:
        raise ValueError(f"{where}: {name} is on {value.device} but {ref_name} {verb} on {ref.device}")


def check_cuda_build(x, name, where, verb="is"):
    """RuntimeError when `x` is on a CUDA device and this build has no CUDA kernels."""
    if x.is_cuda and not _library.with_cuda:
        raise RuntimeError(f"{where}: {name} {verb} on a CUDA device but this build of fusedce has no "
                           "CUDA kernels (it was built without nvcc or with a CPU-only torch)")

