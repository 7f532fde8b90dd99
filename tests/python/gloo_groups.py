"""Spawned gloo groups for the distributed tests.

A group runs a list of cases on every rank, in order; each rank records each case's traceback
(None when it passed) so that one failing case does not stop the group, and writes them to
out/rank{r}.json. One pytest case then checks one key on every rank.

Two things here are about the groups, not about fusedce:
  - a rank leaves with os._exit once its results are on disk and its group is destroyed. The
    interpreter's own teardown of torch.distributed's objects can abort the process
    ("terminate called without an active exception") after every case has passed; nothing of
    the test is left to run by then.
  - a group in which a rank is killed by a signal runs once more, in a fresh store, with a
    warning. Such a kill was seen twice in CI on the loaded 2-core VM and never in dozens of
    local runs; every case is seeded, so a crash of ours repeats and fails the second run.
    faulthandler prints the dying rank's Python stack to the test's stderr either way.
"""

import datetime
import faulthandler
import json
import os
import sys
import time
import traceback
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run_rank(rank, world, store_path, out_dir, keys, run_key, timeout_s, context=None):
    """One rank: joins the gloo group, runs run_key(key, ctx, rank, world) for every key, where
    ctx is context() (a device mesh, say) or the default group, and writes the findings.

    timeout_s bounds every collective: a rank left waiting by a wrong case fails that case
    instead of hanging the group."""
    faulthandler.enable()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    results = {}
    try:
        ctx = context() if context is not None else dist.group.WORLD
        for key in keys:
            try:
                run_key(key, ctx, rank, world)
                results[key] = None
            except BaseException:  # noqa: B036 -- pytest's failures are BaseExceptions
                results[key] = traceback.format_exc()
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _join(ctx, world, deadline_s):
    start = time.monotonic()
    while not ctx.join(timeout=1):
        if time.monotonic() - start > deadline_s:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"the group of {world} did not finish in {deadline_s} s (a hang)")


def spawn_group(world, keys, run_key, tmp_path_factory, *, timeout_s, deadline_s, context=None):
    """Every rank's findings ({key: traceback or None}) for `keys` run on `world` spawned ranks.
    A group still running after deadline_s is killed and fails the test (a hang)."""
    for attempt in range(2):
        out = tmp_path_factory.mktemp(f"group{world}")  # a fresh FileStore each attempt
        ctx = mp.spawn(run_rank, args=(world, str(out / "store"), str(out), list(keys), run_key,
                                       timeout_s, context), nprocs=world, join=False)
        try:
            _join(ctx, world, deadline_s)
        except mp.ProcessExitedException as e:
            if attempt == 1 or e.signal_name is None:
                raise
            warnings.warn(f"a rank of the gloo group of {world} died by {e.signal_name}; "
                          "running the group once more")
            continue
        return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def failures_of(results, key):
    """The ranks on which `key` failed or never ran, with their tracebacks, as one message."""
    return "\n".join(f"rank {r}:\n{res.get(key, 'missing: the rank never ran this case')}"
                     for r, res in enumerate(results) if res.get(key, "missing") is not None)
