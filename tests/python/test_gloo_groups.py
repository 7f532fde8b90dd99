"""The spawned-group helper of the distributed tests (gloo_groups.py) must not hide anything: a
case that fails on one rank is reported with that rank's traceback, and a rank killed by a
signal fails the test once the group's second run dies too."""

import os
import signal

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from gloo_groups import failures_of, spawn_group

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")


def _fails_on_rank_1(key, group, rank, world):
    assert key == "passes" or rank == 0, f"planted failure of {key}"


def _aborts_on_rank_1(key, group, rank, world):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGABRT)


def test_a_failing_case_is_reported_with_its_rank(tmp_path_factory):
    results = spawn_group(2, ["fails", "passes"], _fails_on_rank_1, tmp_path_factory, timeout_s=10,
                          deadline_s=120)
    message = failures_of(results, "fails")
    assert "rank 1:" in message and "planted failure of fails" in message
    assert "rank 0:" not in message
    assert failures_of(results, "passes") == ""
    assert "missing" in failures_of(results, "never_run")


def test_a_rank_killed_twice_fails_the_test(tmp_path_factory):
    with pytest.warns(UserWarning, match="running the group once more"):
        with pytest.raises(mp.ProcessExitedException, match="SIGABRT"):
            spawn_group(2, ["aborts"], _aborts_on_rank_1, tmp_path_factory, timeout_s=10,
                        deadline_s=120)
