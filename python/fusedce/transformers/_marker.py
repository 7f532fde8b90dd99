"""The marker: the empty ``(..., 0)`` tensor an armed lm_head returns in place of its logits
(_PendingLogits), which hands every operation on it to its call's record (_Pending), and the
exception by which that record declines the fused loss (_Decline)."""

import torch


class _Decline(Exception):
    """Raised inside an armed model call when the model does something with lm_head's output
    that the fused loss does not follow. Caught where the marker or the loss function sees it,
    it declines the call within itself (_Replay.decline); escaping the model's forward (a
    tensor-parallel head, a released gathered weight), it has _armed_call run the call again
    unarmed."""


_HARMLESS_ATTRIBUTES = {"device", "dtype", "requires_grad", "is_cuda", "layout"}


class _PendingLogits(torch.Tensor):
    """The empty stand-in for the logits that an armed lm_head returns. While its model call
    runs, every operation on it is recorded (_Pending.record) and yields a new marker; the
    causal-LM loss function takes the loss from it. Afterwards it behaves as a plain empty
    tensor."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        source = next((a for a in args if isinstance(a, _PendingLogits)), None)
        if source is None:
            source = next((a for a in kwargs.values() if isinstance(a, _PendingLogits)), None)
        pending = getattr(source, "_pending", None)
        if pending is None or pending.closed or pending.consumed:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        name = getattr(func, "__name__", repr(func))
        if name == "__get__":
            name = getattr(getattr(func, "__self__", None), "__name__", name)
            if name in _HARMLESS_ATTRIBUTES:
                with torch._C.DisableTorchFunctionSubclass():
                    return func(*args, **kwargs)
        if pending.declined is None:
            try:
                with torch._C.DisableTorchFunctionSubclass():
                    out = func(*args, **kwargs)
                if not isinstance(out, torch.Tensor):
                    # shape, size, numel, item, ...: the marker's answer is not the logits'
                    pending.fail(f"reads {name} of its logits")
                pending.record(func, args, kwargs, source)
            except _Decline as e:
                pending.decline(str(e))
            except Exception:
                pending.decline(f"applies {name} to its logits")
            else:
                marker = out.as_subclass(cls)
                marker._pending = pending
                marker._depth = len(pending.ops)
                pending.latest = marker
                return marker
        # Declined within the call: the operation on the real logits.
        args, kwargs = pending.realize(args), pending.realize(kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def consume(self, labels, vocab_size, shift_labels, num_items_in_batch):
        """(loss, None): the loss computed in lm_head, once the loss function's arguments and
        the operations since lm_head are checked to be those the fused loss assumed; or
        (None, logits): the call declined (now or earlier), and the loss function computes
        the loss of these real logits."""
        pending = getattr(self, "_pending", None)
        if pending is None or pending.closed or pending.consumed:
            raise RuntimeError("fusedce.transformers: logits from an earlier fused_linear call "
                               "were passed to a loss function")  # no call to fall back to
        if pending.declined is None:
            try:
                if self is not pending.latest:
                    pending.fail("passes an earlier version of its logits to its loss")
                return pending.finish(labels, vocab_size, shift_labels, num_items_in_batch), None
            except _Decline as e:
                pending.decline(str(e))
        return None, pending.materialize(self)

