"""Peak memory of one training run, as well as the platform lets us see it.

On a GPU: ``torch.cuda.max_memory_allocated``, the most bytes PyTorch's allocator had handed out
at once during the run (parameters, optimizer state, activations, logits, gradients), reset just
before the first step.

On the CPU there is no allocator counter, so we read the operating system's view of the process:
the peak resident set size (RSS) during training minus the RSS just before the first step. Each
run has a process of its own (see cli.py), so one run's peak cannot hide the other's. Linux
lets a process reset its recorded peak (``/proc/self/clear_refs``) and read it back
(``VmHWM`` in ``/proc/self/status``); elsewhere we fall back to ``resource.getrusage``'s
lifetime peak, or to sampling RSS with psutil, and say so.

RSS counts what the C allocator holds, not what tensors hold. glibc's malloc raises its threshold
for handing large blocks straight back to the operating system each time one is freed, after
which freed (N, V) buffers stay in a heap that fragments and grows step after step (tens of MB a
step in this demo). On the CPU we therefore fix that threshold at glibc's initial 128 KiB for the
training process: every tensor above it is returned when freed, and RSS follows the tensors.
"""

import ctypes
import re
import resource
import sys
import threading

import torch

_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"


def _status_kib(field):
    with open(_STATUS) as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1))


def _linux_peak_resettable():
    try:
        with open(_CLEAR_REFS, "w") as f:
            f.write("5")  # 5: reset the peak RSS to the current RSS
        _status_kib("VmHWM")
        return True
    except (OSError, AttributeError):
        return False


class PeakMemory:
    """``start()`` before the first step, ``stop()`` after the last; ``peak_bytes`` is then the
    figure described by ``what``."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.what = ""
        self.peak_bytes = 0
        self.base_bytes = 0
        self._mode = None
        self._sampler = None

    def start(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base_bytes = torch.cuda.memory_allocated(self.device)
            self._mode = "cuda"
            self.what = "torch.cuda.max_memory_allocated during training"
        elif sys.platform.startswith("linux") and _linux_peak_resettable():
            _return_large_frees_to_os()
            self.base_bytes = _status_kib("VmRSS") * 1024
            self._mode = "vmhwm"
            self.what = "peak RSS growth of the training process (Linux VmHWM - RSS at start)"
        else:
            self._start_fallback()

    def _start_fallback(self):
        try:
            import psutil
        except ImportError:
            psutil = None
        if psutil is not None:
            proc = psutil.Process()
            self.base_bytes = proc.memory_info().rss
            self._sampler = _RssSampler(proc)
            self._mode = "psutil"
            self.what = "peak RSS growth of the training process (psutil, sampled every 5 ms)"
        else:
            self.base_bytes = _ru_maxrss_bytes()
            self._mode = "rusage"
            self.what = "growth of the process's lifetime peak RSS (getrusage) during training"

    def stop(self):
        if self._mode == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device)
        elif self._mode == "vmhwm":
            self.peak_bytes = _status_kib("VmHWM") * 1024 - self.base_bytes
        elif self._mode == "psutil":
            self.peak_bytes = self._sampler.stop() - self.base_bytes
        else:
            self.peak_bytes = _ru_maxrss_bytes() - self.base_bytes
        return self.peak_bytes


def _return_large_frees_to_os():
    """Fixes glibc's mmap threshold (see the module docstring); no-op without glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_mmap_threshold = -3  # from glibc's malloc.h
    libc.mallopt(m_mmap_threshold, 128 * 1024)


def _ru_maxrss_bytes():
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB elsewhere
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


class _RssSampler:
    """Polls the RSS of `proc` on a thread; misses peaks shorter than the period."""

    def __init__(self, proc, period_s=0.005):
        self._proc, self._period = proc, period_s
        self._peak = proc.memory_info().rss
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._done.wait(self._period):
            self._peak = max(self._peak, self._proc.memory_info().rss)

    def stop(self):
        self._done.set()
        self._thread.join()
        return max(self._peak, self._proc.memory_info().rss)
