"""Drop-ins under the names and signatures that other libraries' users already call, computed by
fusedce: :mod:`fusedce.compat.unsloth` (Unsloth's ``fast_cross_entropy_loss`` and
``patch_loss_functions``) and :mod:`fusedce.compat.verl` (verl's fused ``linear_cross_entropy``:
per-token log-probabilities and entropy). The Kernels Hub package's ``fused_linear_cross_entropy`` lives in
``torch-ext/`` (see docs/distribution.md)."""
