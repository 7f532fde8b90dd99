"""Token metrics from the fused call: device-side sums of argmax hits, softmax entropy and
scored targets per model (training's and evaluation's apart), token_metrics() to read them, and
the Trainer callback that logs them."""

import math
import threading
import warnings
import weakref

import torch


class TokenSums:
    """Sums over the scored (non-ignored) targets of the losses of one owner: argmax hits
    (int64), softmax entropy in nats (float64, so that sums over many steps do not drift), and
    the number of targets (int64). 0-D tensors on the device of the first loss added, so that
    adding a micro-batch is three device-side additions and never waits for the device."""

    __slots__ = ("num_correct", "entropy_sum", "tokens")

    def __init__(self):
        self.num_correct = self.entropy_sum = self.tokens = None

    def add(self, num_correct, entropy_sum, tokens):
        if self.tokens is None:
            device = tokens.device
            self.num_correct = torch.zeros((), dtype=torch.int64, device=device)
            self.entropy_sum = torch.zeros((), dtype=torch.float64, device=device)
            self.tokens = torch.zeros((), dtype=torch.int64, device=device)
        device = self.tokens.device  # a model split over devices sends its sums to the first one
        self.num_correct += num_correct.detach().to(device)
        self.entropy_sum += entropy_sum.detach().to(device, torch.float64)
        self.tokens += tokens.detach().to(device)

    def reset(self):
        self.num_correct = self.entropy_sum = self.tokens = None

    def values(self, device=None):
        """(num_correct, entropy_sum, tokens) as one float64 (3,) tensor on `device` (the sums'
        own by default); zeros when nothing was added. float64 holds the counts exactly below
        2**53."""
        if self.tokens is None:
            return torch.zeros(3, dtype=torch.float64, device=device)
        out = torch.stack([self.num_correct.double(), self.entropy_sum, self.tokens.double()])
        return out if device is None else out.to(device)


_sums = weakref.WeakKeyDictionary()  # model -> TokenSums of the losses computed in its calls
_unowned = TokenSums()  # losses computed outside any model call, in a compiled call, or in a
                        # DataParallel replica (a new module object every step)
# The same for the losses computed without gradients (evaluation), kept apart from training's.
_eval_sums = weakref.WeakKeyDictionary()
_eval_unowned = TokenSums()
_calls = threading.local()  # .stack: the PreTrainedModel calls in progress in this thread
_adding = threading.Lock()  # DataParallel's replicas run their losses in concurrent threads


def _model_calls():
    stack = getattr(_calls, "stack", None)
    if stack is None:
        stack = _calls.stack = []
    return stack


def _store(evaluation):
    """(per-model sums, unowned sums) of training's losses or, `evaluation`, of those computed
    without gradients."""
    return (_eval_sums, _eval_unowned) if evaluation else (_sums, _unowned)


@torch.compiler.disable
def _collect(metrics, tokens, training):
    """Add one loss's metrics to the sums of the outermost model whose call is in progress:
    training's sums for a loss computed with gradients enabled (`training`), evaluation's
    otherwise. Outside dynamo's graph (a compiled model's loss breaks the graph here), so that
    the sums are ordinary tensors updated in place."""
    stack = getattr(_calls, "stack", None)
    owner = stack[0] if stack and not getattr(stack[0], "_is_replica", False) else None
    per_model, unowned = _store(not training)
    with _adding:
        if owner is None:
            sums = unowned
        else:
            sums = per_model.get(owner)
            if sums is None:
                sums = per_model[owner] = TokenSums()
        sums.add(metrics["num_correct_tokens"], metrics["entropy_sum"], tokens)


def _owned_by(model, evaluation=False):
    """The TokenSums that `model`'s metrics are made of: those of `model` and of every module
    inside it (a wrapper such as a PEFT model, DDP or an OptimizedModule holds the
    PreTrainedModel whose calls collected them), and the unowned ones; every one for None."""
    per_model, unowned = _store(evaluation)
    if model is None:
        return [*per_model.values(), unowned]
    modules = model.modules() if isinstance(model, torch.nn.Module) else (model,)
    return [s for s in (per_model.get(m) for m in modules) if s is not None] + [unowned]


def _summed(model, device=None, evaluation=False):
    """(num_correct, entropy_sum, tokens) summed over _owned_by(model, evaluation), float64
    (3,) on `device` (by default the device of the first sums that hold any)."""
    owned = _owned_by(model, evaluation)
    if device is None:
        device = next((s.tokens.device for s in owned if s.tokens is not None), "cpu")
    return torch.stack([s.values(device) for s in owned]).sum(0)


def _as_metrics(values):
    """{"token_accuracy", "entropy", "tokens"} from summed (num_correct, entropy_sum, tokens);
    the means are NaN when no token was scored."""
    correct, entropy, tokens = values.tolist()  # the one host synchronisation
    mean = (lambda x: x / tokens) if tokens else (lambda x: math.nan)
    return {"token_accuracy": mean(correct), "entropy": mean(entropy), "tokens": int(tokens)}


def token_metrics(model=None, reset=False, evaluation=False):
    """The token metrics collected under ``apply(metrics=True)`` since the last reset:
    ``{"token_accuracy": hits / tokens, "entropy": mean softmax entropy in nats, "tokens": the
    number of scored (non-ignored) targets}``, summed over every loss computed with gradients
    enabled (with `evaluation`: without gradients, as Trainer.evaluate computes them; the two
    are kept apart) in calls of `model` (or of a PreTrainedModel inside it), plus the unowned
    ones (computed outside any model call, in a compiled call or in a DataParallel replica);
    `model=None`: every loss. The means are NaN when no token was scored. Reads the device
    once; ``reset`` then zeroes those sums."""
    values = _summed(model, evaluation=evaluation)
    if reset:
        reset_token_metrics(model, evaluation)
    return _as_metrics(values)


def reset_token_metrics(model=None, evaluation=False):
    """Zero the sums that token_metrics(model, evaluation=evaluation) reads."""
    for sums in _owned_by(model, evaluation):
        sums.reset()


def _make_metrics_callback():
    from transformers import TrainerCallback
    from transformers.training_args import ParallelMode

    class MetricsCallback(TrainerCallback):
        """Adds ``token_accuracy`` and ``entropy`` (mean per-token softmax entropy, nats) to
        every training log of a ``Trainer`` (a log with ``loss``), from the sums that
        ``apply(metrics=True)`` collects: over every micro-batch of every step since the
        previous log, and over every rank under DDP (summed there, as the counts are, before
        dividing). The sums are reset at every training log and when training begins.
        Likewise ``eval_token_accuracy`` and ``eval_entropy`` (``<prefix>_...`` for
        Trainer.evaluate's metric_key_prefix) in every evaluation log, from the sums of the
        losses computed without gradients since the previous evaluation log (or prediction).

        Trainer calls callbacks in order, and the report_to integrations (wandb, TensorBoard,
        ...) come before callbacks passed to Trainer; :func:`add_metrics_callback` puts this one
        first so that they see the metrics. Wherever it is, it also writes them into the entry
        of ``trainer.state.log_history`` that Trainer made for the log (Trainer appends a copy
        of the logs there before calling on_log)."""

        def __init__(self):
            self._warned = False

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            reset_token_metrics(model)
            reset_token_metrics(model, evaluation=True)

        def on_predict(self, args, state, control, model=None, **kwargs):
            # Trainer.predict logs nothing: its losses must not count in the next evaluation.
            reset_token_metrics(model, evaluation=True)

        def _read(self, args, model, evaluation):
            values = _summed(model, args.device, evaluation)
            reset_token_metrics(model, evaluation)
            if args.parallel_mode == ParallelMode.DISTRIBUTED and torch.distributed.is_initialized():
                torch.distributed.all_reduce(values)
            return _as_metrics(values)

        @staticmethod
        def _write(state, logs, key, new):
            logs.update(new)
            # Trainer.log appends a copy of `logs` to the history just before on_log.
            last = state.log_history[-1] if state.log_history else None
            if last is not None and last.get("step") == state.global_step \
                    and last.get(key) == logs[key]:
                last.update(new)

        def _on_evaluation_log(self, args, state, logs, model):
            """``<prefix>_token_accuracy`` and ``<prefix>_entropy`` next to an evaluation's
            ``<prefix>_loss`` (Trainer.evaluate's metric_key_prefix, "eval" by default)."""
            prefix = next((k[:-len("_runtime")] for k in logs
                           if k.endswith("_runtime") and k[:-len("_runtime")] + "_loss" in logs),
                          None)
            if prefix is None:
                return  # the end-of-training summary, or a log of the user's
            metrics = self._read(args, model, evaluation=True)
            if metrics["tokens"]:
                self._write(state, logs, prefix + "_loss",
                            {prefix + "_token_accuracy": metrics["token_accuracy"],
                             prefix + "_entropy": metrics["entropy"]})

        def on_log(self, args, state, control, logs=None, model=None, **kwargs):
            if logs is None:
                return
            if "loss" not in logs:
                return self._on_evaluation_log(args, state, logs, model)
            metrics = self._read(args, model, evaluation=False)
            if metrics["tokens"] == 0:
                if not self._warned:
                    self._warned = True
                    warnings.warn("fusedce.transformers.MetricsCallback: no token metrics were "
                                  "collected since the previous log (call "
                                  "fusedce.transformers.apply(metrics=True) before training; "
                                  "models that compute their own loss have none)", stacklevel=2)
                return
            self._write(state, logs, "loss", {"token_accuracy": metrics["token_accuracy"],
                                              "entropy": metrics["entropy"]})

    return MetricsCallback


def add_metrics_callback(trainer):
    """Insert a MetricsCallback ahead of `trainer`'s other callbacks (so that the report_to
    integrations log the metrics too) and return it."""
    callback = _metrics_callback_class()()
    trainer.callback_handler.callbacks.insert(0, callback)
    return callback


def _metrics_callback_class():
    # MetricsCallback subclasses transformers' TrainerCallback: made on first use (one class
    # for the process), so that importing fusedce does not import transformers.
    cls = globals().get("MetricsCallback")
    if cls is None:
        cls = globals()["MetricsCallback"] = _make_metrics_callback()
    return cls
