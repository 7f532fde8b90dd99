"""One rank of the vocabulary-parallel linear cross-entropy, timed on one device beside the
one-device call: ``python -m fusedce.bench --only shard``.

Each row is one head (N tokens x H hidden x V vocabulary), dtype, option variant and world size
W: the forward and backward (grad_hidden and grad_weight) of
``fusedce.linear_cross_entropy(hidden, weight[v0:v1], target, process_group=pg, vocab_start=v0,
vocab_total=V)`` for rank 0, which holds torch.chunk's first block of ceil(V / W) columns (the
largest, so the slowest rank), against ``fusedce.linear_cross_entropy(hidden, weight, target)``
over all V columns in the same run.

What runs is the rank's whole call: the front end's checks, the core's shard statistics per
token chunk, the layout check (a device-to-host read), the merge, the shard backward, the
conversion of the summed grad_hidden. Only the data the collectives move is stood in for, so no
communication is timed:
  - the group is torch's fake process group (torch.testing's ``fake`` backend) of W ranks with
    this process as rank 0: a real ProcessGroup, so the front end's rank and size queries are
    answered as in a group of W;
  - the all-gather (fusedce.distributed._all_gather_rows) returns a new block of what rank 0
    would receive: its own statistics of this call in its slot and the other ranks' statistics
    in theirs, each computed once before the timing by the same call over that rank's columns
    (stopped at its gather), so the merge sees the block a real group gives it (one rank holds
    each target, the maxima and argmax are the true ones) and the loss is the one-device loss
    (column ``loss_rel_diff``);
  - the all-reduce of grad_hidden (fusedce.distributed._all_reduce_sum) returns a copy of this
    rank's part (the functional all-reduce's output; the sum is communication).

Reported per row: both medians, the ideal 1/W of the one-device time, ``ratio`` = per-shard time
x W / one-device time (the inverse of the parallel efficiency, communication excluded: 1 is
perfect scaling, 1.25 means the W ranks together spend 25% more GPU time than one device), the
per-shard rate 6*N*H*V_local / time, and the bytes the two collectives would move per call,
computed, not measured:
  gather_bytes     W * (N + 1) * 9 * 4   the gathered float32 statistics every rank holds after
                                         the all-gather (each rank sends (N + 1) * 36 of them)
  allreduce_bytes  N * H * 4             the float32 grad_hidden each rank all-reduces
"""

import contextlib
import dataclasses
import math

import torch
import torch.distributed as dist

import fusedce

from .. import distributed
from ..vp_ops import STATS_WIDTH
from .cases import Case
from .measure import peak_extra_bytes, spread, time_runs
from .problems import make_linear
from .report import _sig
from .runner import dtype_name
from .workloads import _copies_for

WORLDS = (2, 4, 8)
VARIANTS = {"default": {}, "low_memory": {"low_memory": True}}


def _shard(tokens, hidden, vocab, masked=False):
    return Case("shard", tokens, vocab, hidden, masked)


def default_cases(device, quick):
    """GPU: the Llama 3.1 8B head, the Gemma 3 vocabulary at hidden 2048, the Qwen 3 8B head at
    16K tokens (quick: the first). CPU: a few dozen tokens through a head of 1000 columns (equal
    shards at every W) and one of 203 (torch.chunk's uneven blocks)."""
    if device == "cuda":
        shapes = [_shard(8192, 4096, 128256), _shard(8192, 2048, 262144), _shard(16384, 4096, 151936)]
    else:
        shapes = [_shard(64, 32, 1000), _shard(48, 16, 203)]
    return shapes[:1] if quick else shapes


def as_shard_cases(cases):
    """--shapes read for this group: every shape must be NxHxV."""
    out = []
    for c in cases:
        if c.kind == "ce" or c.kind == "logprobs":
            raise ValueError(f"--shapes: {c.label!r}: --only shard takes NxHxV shapes (optionally :masked)")
        out.append(dataclasses.replace(c, kind="shard"))
    return out


def chunk_layout(vocab, world):
    """(vocab_start, V_local) of each rank under torch.chunk's layout (blocks of ceil(V / W), the
    last smaller), or None when some rank would hold no column."""
    block = -(-vocab // world)
    bounds = [(r * block, min(block, vocab - r * block)) for r in range(world)]
    return bounds if all(count >= 1 for _, count in bounds) else None


def gather_bytes(tokens, world):
    return world * (tokens + 1) * STATS_WIDTH * 4


def allreduce_bytes(tokens, hidden):
    return tokens * hidden * 4


@contextlib.contextmanager
def fake_group(world):
    """The default process group as torch's fake backend of `world` ranks, this process rank 0."""
    if dist.is_initialized():
        raise RuntimeError("--only shard simulates one rank with torch's fake process group and needs a "
                           "process without a default process group")
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


class _Sent(Exception):
    """Carries the statistics a rank hands to its all-gather (raised there to stop the call)."""

    def __init__(self, stats):
        super().__init__("statistics captured at the all-gather")
        self.stats = stats


@contextlib.contextmanager
def _collectives_replaced(gather, all_reduce=None):
    """fusedce.distributed's two collectives replaced for the duration (module attributes, looked
    up at each call)."""
    real = distributed._all_gather_rows, distributed._all_reduce_sum
    distributed._all_gather_rows = gather
    distributed._all_reduce_sum = all_reduce or real[1]
    try:
        yield
    finally:
        distributed._all_gather_rows, distributed._all_reduce_sum = real


def sent_statistics(hidden, weight_rows, target, group, vocab_start, vocab_total, options):
    """The (N + 1, 9) block a rank holding `weight_rows` at `vocab_start` sends to the all-gather
    (its statistics and its layout record), from the same front-end call, stopped there."""
    def capture(stats, process_group):
        raise _Sent(stats.clone())

    with _collectives_replaced(capture), torch.no_grad():
        try:
            fusedce.linear_cross_entropy(hidden, weight_rows, target, process_group=group,
                                         vocab_start=vocab_start, vocab_total=vocab_total, **options)
        except _Sent as sent:
            return sent.stats
    raise RuntimeError("the vocabulary-parallel linear cross-entropy never reached its all-gather")


def received_block(hidden, weight, target, group, layout, options):
    """What every rank holds after the all-gather: each rank's sent statistics, in rank order."""
    return torch.cat([sent_statistics(hidden, weight[v0:v0 + count], target, group, v0, weight.shape[0],
                                      options) for v0, count in layout])


@contextlib.contextmanager
def collectives_stood_in(block, rank, rows):
    """fusedce.distributed's collectives as rank `rank` sees their results, without moving data:
    the all-gather returns a new block (as the functional all-gather allocates one) holding
    `block` with this call's statistics in `rank`'s slot; the all-reduce returns a copy of this
    rank's part (the functional all-reduce's output copy; the sum is communication)."""
    def gather(stats, process_group):
        out = block.clone()
        out[rank * rows:(rank + 1) * rows].copy_(stats)
        return out

    def all_reduce(tensor, process_group):
        return tensor.clone()

    with _collectives_replaced(gather, all_reduce):
        yield


def _leaves(copies):
    return [(h.detach().requires_grad_(True), w.detach().requires_grad_(True)) for h, w in copies]


def fwd_bwd(call, copies):
    """run(i): call(hidden, weight) on copy i mod k, then backward into fresh grad_hidden and
    grad_weight; returns [loss, grad_hidden, grad_weight]. Also the leaves (the inputs)."""
    leaves = _leaves(copies)

    def run(i):
        h, w = leaves[i % len(leaves)]
        h.grad = w.grad = None
        loss = call(h, w)
        loss.backward()
        out = [loss, h.grad, w.grad]
        h.grad = w.grad = None
        return out
    return run, [t for pair in leaves for t in pair]


def _copies(hidden, weight_rows, l2):
    k = _copies_for(hidden.nbytes + weight_rows.nbytes, l2)
    if k == 1:
        return [(hidden, weight_rows)]
    return [(hidden.clone(), weight_rows.clone()) for _ in range(k)]


@dataclasses.dataclass
class ShardRow:
    """One world size of one head, dtype and variant. status 'ok', 'skipped' (no even layout) or
    'failed' (note says why). Times in ms (median, p10, p90); rates in TFLOP/s (6*N*H*columns)."""

    kind: str
    case: str
    model: str
    tokens: int
    hidden: int
    vocab: int
    masked: bool
    dtype: str
    variant: str
    world: int
    rank: int
    vocab_local: int
    status: str
    note: str = ""
    runs: int = 0
    one_device_ms: float = None
    one_device_p10_ms: float = None
    one_device_p90_ms: float = None
    shard_ms: float = None
    shard_p10_ms: float = None
    shard_p90_ms: float = None
    ideal_ms: float = None
    ratio: float = None
    one_device_tflops: float = None
    shard_tflops: float = None
    one_device_peak_extra_mb: float = None
    shard_peak_extra_mb: float = None
    gather_bytes: int = None
    allreduce_bytes: int = None
    loss_rel_diff: float = None


def _timed(run, inputs, repeat, warmup, device):
    median, p10, p90 = spread(time_runs(run, repeat, warmup, device))
    peak = peak_extra_bytes(run, inputs, device)
    return median, p10, p90, None if peak is None else peak / 2**20


def _tflops(tokens, hidden, vocab, ms):
    return 6 * tokens * hidden * vocab / (ms * 1e-3) / 1e12


def _failure(e):
    return f"{type(e).__name__}: {e}".strip().splitlines()[0][:200]


def measure_world(hidden, weight, target, world, options, l2, repeat, warmup, device, rank=0):
    """(median, p10, p90, peak MB, loss) of rank `rank`'s forward + backward at `world` ranks."""
    layout = chunk_layout(weight.shape[0], world)
    v0, count = layout[rank]
    rows = target.numel() + 1
    with fake_group(world) as group:
        block = received_block(hidden, weight, target, group, layout, options)
        copies = _copies(hidden, weight[v0:v0 + count], l2)
        vocab = weight.shape[0]

        def call(h, w):
            return fusedce.linear_cross_entropy(h, w, target, process_group=group, vocab_start=v0,
                                                vocab_total=vocab, **options)

        with collectives_stood_in(block, rank, rows):
            run, inputs = fwd_bwd(call, copies)
            loss = float(run(0)[0].detach())
            median, p10, p90, peak = _timed(run, inputs, repeat, warmup, device)
    return median, p10, p90, peak, loss


def _release(device):
    import gc

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def measure_one_device(hidden, weight, target, options, l2, repeat, warmup, device):
    """(median, p10, p90, peak MB, loss) of the one-device call's forward + backward."""
    run, inputs = fwd_bwd(lambda h, w: fusedce.linear_cross_entropy(h, w, target, **options),
                          _copies(hidden, weight, l2))
    loss = float(run(0)[0].detach())
    return (*_timed(run, inputs, repeat, warmup, device), loss)


def _fill_world(row, problem, options, one, l2, repeat, warmup, device):
    """Row fields of one world size, given the one-device numbers `one` (or its failure text)."""
    hidden, weight, target = problem
    n, h = row.tokens, row.hidden
    if not isinstance(one, str):
        row.one_device_ms, row.one_device_p10_ms, row.one_device_p90_ms, row.one_device_peak_extra_mb, _ = one
        row.one_device_tflops = _tflops(n, h, row.vocab, one[0])
        row.ideal_ms = one[0] / row.world
    if row.vocab_local == 0:
        row.status, row.note = "skipped", f"torch.chunk's layout of {row.vocab} columns leaves a rank empty"
        return
    if isinstance(one, str):
        row.status, row.note = "failed", f"one-device call: {one}"
        return
    try:
        median, p10, p90, peak, loss = measure_world(hidden, weight, target, row.world, options, l2,
                                                     repeat, warmup, device)
    except Exception as e:  # the row says why
        row.status, row.note = "failed", _failure(e)
        return
    row.shard_ms, row.shard_p10_ms, row.shard_p90_ms, row.shard_peak_extra_mb = median, p10, p90, peak
    row.ratio = median * row.world / one[0]
    row.shard_tflops = _tflops(n, h, row.vocab_local, median)
    row.loss_rel_diff = abs(loss - one[4]) / abs(one[4]) if one[4] else abs(loss)


def run_case(case, dtype, device, repeat, warmup, l2, worlds=WORLDS, variants=VARIANTS, progress=None):
    """The rows of one head and dtype: per variant, the one-device call once, then each world."""
    rows = []
    base = dict(kind="shard", case=case.label, model=case.model, tokens=case.tokens, hidden=case.hidden,
                vocab=case.vocab, masked=case.masked, dtype=dtype_name(dtype))
    problem = make_linear(case, dtype, device)
    for variant, options in variants.items():
        try:
            one = measure_one_device(*problem, options, l2, repeat, warmup, device)
        except Exception as e:  # every world's row says why
            one = _failure(e)
        _release(device)
        for world in worlds:
            if progress is not None:
                progress.show(f"{case.label} {dtype_name(dtype)} {variant} W={world}")
            layout = chunk_layout(case.vocab, world)
            row = ShardRow(variant=variant, world=world, rank=0, vocab_local=layout[0][1] if layout else 0,
                           status="ok", runs=repeat, gather_bytes=gather_bytes(case.tokens, world),
                           allreduce_bytes=allreduce_bytes(case.tokens, case.hidden), **base)
            _fill_world(row, problem, options, one, l2, repeat, warmup, device)
            _release(device)
            rows.append(row)
            if progress is not None:
                progress.advance()
    return rows


def run_shard_benchmark(cases, dtypes, device, repeat, warmup, l2, progress=None):
    rows = []
    for case in cases:
        for dtype in dtypes:
            rows += run_case(case, dtype, device, repeat, warmup, l2, progress=progress)
    return rows


def count_units(cases, dtypes):
    return len(cases) * len(dtypes) * len(VARIANTS) * len(WORLDS)


def _cell(x, fmt):
    return "" if x is None else format(x, fmt)


def table(rows, meta):
    lines = [f"# {meta['device_name']} | torch {meta['torch_version']} | fusedce {meta['fusedce_version']} "
             f"({meta['fusedce_commit']})",
             "# one rank of the vocabulary-parallel linear cross-entropy (rank 0, the largest block), "
             "forward + backward (grad_hidden, grad_weight), collectives stood in for: no communication "
             "timed",
             "# ratio: per-shard ms x W / one-device ms (1 = perfect scaling); TFLOP/s: 6*N*H*columns; "
             "bytes: per call, computed (gathered float32 statistics; float32 grad_hidden all-reduced)",
             "# loss diff: the rank's merged loss against the one-device loss, relative",
             "",
             "| case | dtype | variant | W | V_local | one-device ms | per-shard ms (p10-p90) | ideal 1/W ms "
             "| ratio | TFLOP/s one-device / shard | gather bytes | all-reduce bytes | loss diff "
             "| peak extra MB one-device / shard |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.status != "ok":
            shard = f"{r.status}: {r.note}"
        else:
            shard = f"{r.shard_ms:.3f} ({r.shard_p10_ms:.3f}-{r.shard_p90_ms:.3f})"
        rates = "" if r.shard_tflops is None else f"{_sig(r.one_device_tflops)} / {_sig(r.shard_tflops)}"
        peaks = ("" if r.shard_peak_extra_mb is None
                 else f"{_cell(r.one_device_peak_extra_mb, '.0f')} / {_cell(r.shard_peak_extra_mb, '.0f')}")
        lines.append(f"| {r.case} | {r.dtype} | {r.variant} | {r.world} | {r.vocab_local} "
                     f"| {_cell(r.one_device_ms, '.3f')} | {shard} | {_cell(r.ideal_ms, '.3f')} "
                     f"| {_cell(r.ratio, '.3f')} | {rates} | {r.gather_bytes} | {r.allreduce_bytes} "
                     f"| {_cell(r.loss_rel_diff, '.1e')} | {peaks} |")
    return "\n".join(lines)


def summary(rows):
    """Per variant and W, the geometric mean of the ratio over the heads measured."""
    ratios = {}
    for r in rows:
        if r.status == "ok":
            ratios.setdefault((r.dtype, r.variant, r.world), []).append(r.ratio)
    return "\n".join(
        f"{dtype} {variant}, W={world}: per-shard time x W / one-device time, geometric mean "
        f"{math.exp(sum(map(math.log, xs)) / len(xs)):.3f} over {len(xs)} head{'s' if len(xs) > 1 else ''}"
        for (dtype, variant, world), xs in ratios.items())


CSV_META = ["device", "device_name", "torch_version", "fusedce_version", "fusedce_commit", "date",
            "gemm_tflops"]


def write_csv(rows, meta, path):
    """One line per row, every field of ShardRow plus the machine, torch, fusedce and the GEMM
    rate measured in the same run for the row's dtype."""
    import csv

    fields = [f.name for f in dataclasses.fields(ShardRow)] + CSV_META
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for r in rows:
            line = dataclasses.asdict(r)
            line.update({k: meta[k] for k in CSV_META if k != "gemm_tflops"})
            line["gemm_tflops"] = meta["gemm_tflops"].get(r.dtype, "")
            writer.writerow(line)
