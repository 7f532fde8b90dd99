"""``python -m fusedce.demo``: a small language model trained twice, with PyTorch's loss and with
fusedce's fused linear cross-entropy, to show that the loss curves agree and what fusedce saves
in memory (and time, on a GPU).

The model (model.py) is a GPT-style decoder in plain PyTorch; the text (fusedce/data) is 400 KB
of Shakespeare, tokenised by a byte-pair encoding learned on it (tokenizer.py). Both runs start
from the same weights and see the same batches; only the loss differs (train.py). See
``python -m fusedce.demo --help`` and cli.py.
"""

from .cli import main

__all__ = ["main"]
