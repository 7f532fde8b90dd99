"""The benchmark loop: for each case, dtype and job, each implementation checked against float64,
then all of them timed together (interleaved blocks), then each one's peak of extra memory,
gathered into rows."""

import dataclasses
import gc
import sys

import torch

from .measure import peak_extra_bytes, spread, time_blocks, time_runs
from .problems import tolerance
from .workloads import JOBS, make_workload


@dataclasses.dataclass
class Row:
    """One implementation on one case, dtype and job. status: 'ok', 'failed' or 'unavailable'
    (note says why; an 'ok' row's note says when it was timed alone, not with the job's other
    implementations). rate is GB/s for cross-entropy, TFLOP/s for linear cross-entropy;
    of_ceiling is rate over the copy bandwidth or the GEMM rate measured in the same run."""

    kind: str
    job: str
    case: str
    model: str
    tokens: int
    hidden: int
    vocab: int
    masked: bool
    dtype: str
    peer: str
    status: str
    note: str = ""
    median_ms: float = None
    p10_ms: float = None
    p90_ms: float = None
    runs: int = 0
    rate: float = None
    unit: str = ""
    of_ceiling: float = None
    peak_extra_mb: float = None
    loss_err: float = None
    grad_err: float = None
    correct: bool = None


def dtype_name(dtype):
    return str(dtype).replace("torch.", "")


class Progress:
    """A progress bar on stderr: tqdm when it is installed, else a counter redrawn in place."""

    def __init__(self, total, enabled):
        self.total, self.done, self.enabled, self.text = total, 0, enabled, ""
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="run", file=sys.stderr, dynamic_ncols=True)
            except ImportError:
                pass

    def show(self, text):
        """Name what runs now."""
        self.text = text
        if self.bar is not None:
            self.bar.set_description_str(text)
        elif self.enabled:
            self._draw()

    def advance(self):
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
        elif self.enabled:
            self._draw()

    def _draw(self):
        print(f"\r[{self.done}/{self.total}] {self.text[:70]:<70}", end="", file=sys.stderr, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            print(file=sys.stderr)


def _failure(e):
    text = f"{type(e).__name__}: {e}".strip().splitlines()[0]
    return text[:200]


def _release(device):
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


@dataclasses.dataclass
class Prepared:
    """One implementation ready to be timed on one job: its call, the call's inputs, and the
    errors of its checked call (None for an unchecked one)."""

    run: object
    inputs: list
    loss_err: float = None
    grad_err: float = None


def prepare_one(work, fn, job, checked=True):
    """Checks one implementation on one job of a workload and builds its timed call. An unchecked
    one (a different computation on purpose: the floor, every option on) is only built."""
    work.restore()
    loss_err, grad_err = work.check(fn, job) if checked else (None, None)
    run, inputs = work.make_run(fn, job)
    return Prepared(run, inputs, loss_err, grad_err)


def time_together(work, ready, device, repeat, warmup):
    """(name -> times or the exception that stopped it, note) for every prepared implementation
    of one job, interleaved in blocks (measure.time_blocks) so that they share the chip's drift.
    If one fails there, each is timed again alone, so that the others still get their rows, and
    the note ('timed alone: <why>') tells their rows that their times did not share the drift;
    otherwise the note is empty."""
    runs = {name: prep.run for name, prep in ready.items()}
    try:
        return time_blocks(runs, repeat, warmup, device, before=work.restore), ""
    except Exception as e:  # one implementation failed mid-run (out of memory, say): time each alone
        note = f"timed alone: {_failure(e)}"
        _release(device)
    times = {}
    for name, run in runs.items():
        try:
            work.restore()
            times[name] = time_runs(run, repeat, warmup, device)
        except Exception as e:
            times[name] = e
        _release(device)
    return times, note


def finish_one(work, prep, times, job, dtype, device, ceiling):
    """One implementation's Row fields from its times; its peak memory taken now, in a call of
    its own."""
    median, p10, p90 = spread(times)
    work.restore()
    peak = peak_extra_bytes(prep.run, prep.inputs, device)
    rate = work.rate(job, median)
    loss_tol, grad_tol = tolerance(dtype)
    loss_err, grad_err = prep.loss_err, prep.grad_err
    correct = None if loss_err is None else loss_err <= loss_tol and (grad_err is None or grad_err <= grad_tol)
    return dict(median_ms=median, p10_ms=p10, p90_ms=p90, runs=len(times), rate=rate,
                of_ceiling=rate / ceiling if ceiling else None,
                peak_extra_mb=None if peak is None else peak / 2**20,
                loss_err=loss_err, grad_err=grad_err, correct=correct)


def count_units(cases, dtypes, peers):
    """The number of rows run_benchmark will produce (the progress bar's length)."""
    return sum(len(JOBS[c.kind]) for c in cases for _ in dtypes for p in peers if p.offers(c.kind))


def run_benchmark(cases, dtypes, peers, device, repeat, warmup, ceilings, l2, progress):
    """Every row, in case / dtype / job / implementation order. ceilings: {'copy': GB/s,
    dtype: GEMM TFLOP/s}."""
    rows = []
    for case in cases:
        for dtype in dtypes:
            offering = [p for p in peers if p.offers(case.kind)]
            if not offering:
                continue
            base = dict(kind=case.kind, case=case.label, model=case.model, tokens=case.tokens,
                        hidden=case.hidden, vocab=case.vocab, masked=case.masked, dtype=dtype_name(dtype))
            try:
                work = make_workload(case, dtype, device, l2)
            except Exception as e:  # e.g. out of memory for the inputs or the reference
                for job in JOBS[case.kind]:
                    for peer in offering:
                        rows.append(Row(job=job, peer=peer.name, status="failed",
                                        note=f"inputs: {_failure(e)}", **base))
                        progress.advance()
                _release(device)
                continue
            ceiling = ceilings["copy"] if case.kind == "ce" else ceilings.get(dtype)
            for job in work.jobs:
                # every implementation checked first, then all of them timed together
                job_rows, ready = [], {}
                for peer in offering:
                    progress.show(f"{case.label} {dtype_name(dtype)} {job} {peer.name}: checking")
                    row = Row(job=job, peer=peer.name, status="ok", unit=work.unit, **base)
                    if case.kind in peer.reasons:
                        row.status, row.note = "unavailable", peer.reasons[case.kind]
                    else:
                        try:
                            ready[peer.name] = prepare_one(work, peer.fns[case.kind], job, peer.checked)
                        except Exception as e:  # a failing peer gets a row saying how
                            row.status, row.note = "failed", _failure(e)
                            _release(device)
                    job_rows.append(row)
                progress.show(f"{case.label} {dtype_name(dtype)} {job}: timing {len(ready)} together")
                times, alone = time_together(work, ready, device, repeat, warmup) if ready else ({}, "")
                for row in job_rows:
                    if row.peer in ready:
                        try:
                            if isinstance(times[row.peer], Exception):
                                raise times[row.peer]
                            fields = finish_one(work, ready[row.peer], times[row.peer], job, dtype, device, ceiling)
                            for key, value in fields.items():
                                setattr(row, key, value)
                            row.note = alone
                        except Exception as e:
                            row.status, row.note = "failed", _failure(e)
                    rows.append(row)
                    progress.advance()
                del ready
                _release(device)
            del work
            _release(device)
    return rows
