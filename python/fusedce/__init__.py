"""fusedce: fused cross-entropy for PyTorch.

``fusedce.cross_entropy`` / ``fusedce.CrossEntropyLoss`` are drop-ins for PyTorch's, computed by
the fusedce core in one sweep over the logits (loss and gradient together);
``fusedce.linear_cross_entropy`` / ``fusedce.LinearCrossEntropyLoss`` compute the same loss from
hidden states and a head's weight without ever storing the logits;
``fusedce.linear_logprobs`` / ``fusedce.logprobs`` give per-token log-probabilities and entropy
with gradients (reinforcement-learning post-training);
``fusedce.linear_distillation`` / ``linear_distillation_topk`` distil a teacher's distribution
(its head, or its top-k) into a student head without either's logits;
``fusedce.transformers.apply()`` puts them under every causal LM of Hugging Face transformers.
The ops behind them are ``torch.ops.fusedce.*`` (schemas in torch/registry.h).
"""

from . import _library  # noqa: E402

_library.load()

from . import ops  # noqa: E402  (fake kernels and autograd of the ops just loaded)
from . import linear_ops  # noqa: E402
from . import vp_ops  # noqa: E402  (fake kernels of the vocabulary-parallel ops)
from . import lp_ops  # noqa: E402  (fake kernels of the log-probability ops)
from . import distill_ops  # noqa: E402  (fake kernels of the distillation ops)
from . import distributed  # noqa: E402
from . import dtensor  # noqa: E402  (DTensor inputs of the vocabulary-parallel forms)
from . import transformers  # noqa: E402
from .functional import cross_entropy, vocab_parallel_cross_entropy  # noqa: E402
from .linear import linear_cross_entropy, vocab_parallel_linear_cross_entropy  # noqa: E402
from .nn import CrossEntropyLoss, LinearCrossEntropyLoss  # noqa: E402
from .token_logprobs import linear_logprobs, logprobs  # noqa: E402
from .distillation import linear_distillation, linear_distillation_topk  # noqa: E402

__version__ = "0.1.0"
with_cuda = _library.with_cuda
cpu_blas = _library.cpu_blas

__all__ = ["cross_entropy", "CrossEntropyLoss", "linear_cross_entropy", "LinearCrossEntropyLoss",
           "transformers", "ops", "with_cuda", "cpu_blas", "distributed", "vocab_parallel_cross_entropy",
           "vocab_parallel_linear_cross_entropy", "linear_logprobs", "logprobs", "linear_distillation",
           "linear_distillation_topk"]
