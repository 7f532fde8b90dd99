"""What a model's forward calls, read from its source once per class (or forward function):
its causal-LM loss function (a model that calls ``self.loss_function`` can be armed), or a
``CrossEntropyLoss`` of its own (served over the logits by TokenCrossEntropyLoss)."""

import ast
import inspect
import sys
import textwrap

from ._loss import TokenCrossEntropyLoss


_loss_calls = {}  # model class -> whether its forward calls self.loss_function


def _calls_loss_function(cls):
    """Whether `cls.forward`'s own source calls ``self.loss_function(...)``. A model that computes
    its loss otherwise (its own CrossEntropyLoss: T5, Bart, TrOCR, ...) must never be armed: it
    would receive the empty marker as its logits."""
    if cls not in _loss_calls:
        found = False
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
            found = any(isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr == "loss_function"
                        and isinstance(node.func.value, ast.Name) and node.func.value.id == "self"
                        for node in ast.walk(tree))
        except (OSError, TypeError, SyntaxError):
            pass
        _loss_calls[cls] = found
    return _loss_calls[cls]


_own_loss_calls = {}  # forward function -> whether it calls CrossEntropyLoss(...)


def _computes_own_cross_entropy(cls):
    """Whether `cls.forward`'s own source builds a ``CrossEntropyLoss(...)`` that its module now
    names TokenCrossEntropyLoss (the model's standard calls of it are served over the logits)."""
    forward = cls.forward
    module = sys.modules.get(getattr(forward, "__module__", None) or "")
    if module is None or module.__dict__.get("CrossEntropyLoss") is not TokenCrossEntropyLoss:
        return False
    if forward not in _own_loss_calls:
        found = False
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
            found = any(isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                        and node.func.id == "CrossEntropyLoss" for node in ast.walk(tree))
        except (OSError, TypeError, SyntaxError):
            pass
        _own_loss_calls[forward] = found
    return _own_loss_calls[forward]
