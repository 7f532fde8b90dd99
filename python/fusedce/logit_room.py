"""When ``fusedce.linear_logprobs`` keeps its logits by default (``keep_logits=None``).

The linear form has two ways to its gradients (token_logprobs.py): recompute the logits chunk by
chunk in the backward (four matrix products, extra memory bounded by a budget), or keep all
``(N, V_local)`` logits from forward to backward (three products, ``N * V_local`` elements of the
input dtype). Where a backward follows, keeping is the faster of the two wherever it may run; the
default keeps whenever the kept logits take no more than the memory the recomputing form is
allowed, and recomputes only past that. So the default is never slower than the recomputing form
without needing more memory than its bound, and never takes more than that bound. A call that
forms no gradient never keeps by default (token_logprobs.py does not ask this rule): nothing
would reuse the logits, and the recomputing form's forward folds them into per-row statistics
without writing them or reading them back (on a GPU inside the matrix product).

The room is the recomputing form's own bound, the linear cross-entropy's rule for its chunks
(include/fusedce/linear_cross_entropy.h, ``LinearOptions::chunk_budget_bytes``):

- CUDA, no budget given: the larger of 512 MiB and a float32 copy of the weight (the default
  logit budget, ``max(448 MiB, 4 V H - 64 MiB)``, plus the 64 MiB beside it for the matrix
  products' workspace and the per-row vectors), plus the float32 ``grad_weight`` accumulator
  (``4 V H`` bytes) when a 16-bit weight needs a gradient. The linear cross-entropy's default
  takes one chunk of all rows in that same room (budget plus accumulator).
- The CPU, no budget given: the CPU backend's default chunk of float32 logits (128 MiB).
- A ``chunk_budget_bytes`` given: that many bytes of logits held at once, on any device.

One more condition on the CPU: the two forms must give the same values there to float32
rounding. A GPU forms the recomputed logit chunks in the input dtype, as the kept logits are;
the CPU's recomputing form keeps its chunks in float32 whatever the input dtype, so a 16-bit
call there keeps its logits only when asked (``keep_logits=True``) and the default never
changes the CPU's values by the rounding of the logits to 16 bits.

``V`` here is this rank's rows of the head (a vocabulary-parallel head decides per rank, from
its own shard: each rank's memory is its own). The constants are the core's
(src/cuda/linear/linear_cuda.cpp, src/cpu/logprobs_cpu.cpp); tests/python/test_logit_room.py
reads them there, so the two cannot drift apart.
"""

import torch

__all__ = ["keeps_logits", "kept_bytes", "room_bytes"]

# src/cuda/linear/linear_cuda.cpp: kDefaultChunkBudget and kChunkOverheadBytes.
CUDA_LEAST_CHUNK_BUDGET = 448 << 20
CUDA_CHUNK_OVERHEAD = 64 << 20
# src/cpu/logprobs_cpu.cpp: kDefaultBudget (float32 logits of one chunk).
CPU_CHUNK_BUDGET = 128 << 20

_SIXTEEN_BIT = (torch.bfloat16, torch.float16)


def kept_bytes(rows, local_vocab, dtype):
    """Bytes of the kept logits: ``rows x local_vocab`` elements of ``dtype`` (F.linear's output)."""
    return int(rows) * int(local_vocab) * dtype.itemsize


def room_bytes(local_vocab, hidden_size, dtype, grad_weight, device_type, chunk_budget_bytes=None):
    """Bytes the recomputing form may take beyond its inputs and outputs, for a head of
    ``local_vocab`` rows of ``hidden_size`` in ``dtype`` on ``device_type`` ("cuda" or other,
    which runs on the CPU backend); ``grad_weight``: whether the weight's gradient is formed.
    ``chunk_budget_bytes`` (an int > 0), when given, is the room."""
    if chunk_budget_bytes is not None:
        return int(chunk_budget_bytes)
    if device_type != "cuda":
        return CPU_CHUNK_BUDGET
    weight_f32 = 4 * int(local_vocab) * int(hidden_size)
    room = max(CUDA_LEAST_CHUNK_BUDGET + CUDA_CHUNK_OVERHEAD, weight_f32)
    if grad_weight and dtype in _SIXTEEN_BIT:
        room += weight_f32  # the float32 grad_weight accumulator of several chunks
    return room


def keeps_logits(rows, hidden_size, local_vocab, dtype, grad_weight, device_type, chunk_budget_bytes=None):
    """Whether the default call keeps the logits: they fit the room (:func:`room_bytes`), and on
    the CPU the input is float32 (module docstring)."""
    if device_type != "cuda" and dtype != torch.float32:
        return False
    return kept_bytes(rows, local_vocab, dtype) <= room_bytes(local_vocab, hidden_size, dtype, grad_weight,
                                                             device_type, chunk_budget_bytes)
