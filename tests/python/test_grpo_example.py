"""examples/grpo_step.py: one GRPO step through fusedce.linear_logprobs equals the step computed
from materialised logits in float64 (the example asserts it; this runs it)."""

import importlib.util
import os

import pytest

from conftest import DEVICES

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "grpo_step.py")


def _example():
    spec = importlib.util.spec_from_file_location("grpo_step", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grpo_step_matches_float64(device, dtype):
    # The example asserts the loss, the log-probabilities and every gradient itself: float32
    # against float64, bfloat16 within three times PyTorch's own bfloat16 step's error.
    worst = _example().main(["--device", device, "--dtype", dtype])
    if dtype == "float32":
        assert worst < 2e-5
