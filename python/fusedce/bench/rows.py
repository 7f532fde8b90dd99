"""What the standalone benchmark scripts (bench/trl_post_training.py, bench/distill_bench.py)
share beside measure.py's timing: the peak of device memory one call takes, the differences a
row reports against a reference, and the rows themselves: columns every row carries, a CSV file
of them and a printed table."""

import csv
import datetime
import gc
import os
import sys

import torch

import fusedce
from fusedce.bench.measure import device_name

GIB = float(1 << 30)


def _bytes_of(tensors):
    return sum(t.untyped_storage().nbytes() for t in tensors if t is not None)


class _StreamOrderedPool:
    """The device's current memory pool, which cudaMallocAsync draws from: where fusedce's core
    takes a call's workspace when no torch tensor is passed for it (the distillation's CUDA
    path), memory torch's allocator statistics never see. Read through cuda.bindings (which torch
    itself depends on); with torch's allocator on the cudaMallocAsync backend the same pool holds
    torch's tensors, already counted, so it is not read then."""

    def __init__(self):
        from cuda.bindings import driver, runtime as rt

        if torch.cuda.get_allocator_backend() != "native":
            raise RuntimeError("torch allocates from the stream-ordered pool itself")
        self.rt, self.u64 = rt, driver.cuuint64_t
        err, self.pool = rt.cudaDeviceGetMemPool(torch.cuda.current_device())
        self._check(err)
        self.start()  # each call once here, so that a binding that does not fit fails now
        self.high()

    def _check(self, err):
        if err != self.rt.cudaError_t.cudaSuccess:
            raise RuntimeError(f"cuda.bindings: {err}")

    def _get(self, attr):
        err, value = self.rt.cudaMemPoolGetAttribute(self.pool, attr)
        self._check(err)
        return int(value)

    def start(self):
        """Resets the pool's high-water mark; returns the bytes in use now."""
        attrs = self.rt.cudaMemPoolAttr
        (err,) = self.rt.cudaMemPoolSetAttribute(self.pool, attrs.cudaMemPoolAttrUsedMemHigh, self.u64(0))
        self._check(err)
        return self._get(attrs.cudaMemPoolAttrUsedMemCurrent)

    def high(self):
        return self._get(self.rt.cudaMemPoolAttr.cudaMemPoolAttrUsedMemHigh)


def stream_ordered_pool():
    """A _StreamOrderedPool, or the reason there is none (a str) where it cannot be read."""
    try:
        return _StreamOrderedPool()
    except Exception as e:  # noqa: BLE001 - any failure only means the pool is not counted
        return f"{type(e).__name__}: {e}"


def peak_memory(run, device, pool=None):
    """(peak over what is live before run(), the same less run()'s outputs) in bytes, from one
    call; (None, None) on the CPU (no allocator statistics). With `pool` (stream_ordered_pool()),
    the call's high-water mark in the stream-ordered pool is added to torch's: the core's
    workspace there is live while the call's outputs are (they are allocated before it), so the
    sum is the call's peak."""
    if device != "cuda":
        return None, None
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    pool_base = pool.start() if pool is not None else 0
    outputs = run(0)
    torch.cuda.synchronize()
    over = torch.cuda.max_memory_allocated() - base
    if pool is not None:
        over += max(0, pool.high() - pool_base)
    return over, over - _bytes_of(outputs)


def release(device):
    """Frees what the previous row left cached, so each row's peak is its own."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def max_abs(a, b):
    """Largest |a - b| (None when either is missing; 0 for empty tensors)."""
    if a is None or b is None:
        return None
    if a.numel() == 0:
        return 0.0
    return (a.double() - b.double()).abs().max().item()


def max_rel(a, b):
    """Largest |a - b| relative to b's largest entry."""
    if a is None or b is None:
        return None
    if a.numel() == 0:
        return 0.0
    return max_abs(a, b) / max(b.double().abs().max().item(), 1e-300)


def gib(x):
    return None if x is None else x / GIB


def common_columns(device):
    """Columns every row carries: where and when it ran."""
    return {"device_name": device_name(device), "torch_version": torch.__version__,
            "fusedce_version": fusedce.__version__, "date": datetime.datetime.now().isoformat(timespec="seconds")}


def cell(v):
    """A value as a CSV cell or table entry: floats to 6 significant digits, None empty."""
    if isinstance(v, float):
        return f"{v:.6g}"
    return "" if v is None else v


def write_csv(path, rows):
    """rows (dicts) to path, the columns in the order they first appear."""
    keys = []
    for row in rows:
        keys += [k for k in row if k not in keys]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: cell(row.get(k)) for k in keys})


def print_rows(title, rows, columns):
    print(f"\n== {title}")
    print(" | ".join(columns))
    for row in rows:
        print(" | ".join(str(cell(row.get(c))) for c in columns))
    sys.stdout.flush()
