"""Timing of fusedce against PyTorch (``python -m fusedce.bench``); not part of the tests."""
