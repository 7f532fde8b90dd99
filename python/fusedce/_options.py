"""The cross-entropy options as one object.

``CeOptions.checked`` builds it from the user's keywords once, before any work, and checks each
value with a message that names the argument; ``op_args()`` gives them as the ops take them: six
scalar arguments in the order of their schema (``FUSEDCE_CE_ARGS`` in torch/options.h, which is
``OPTION_NAMES``; tests/python/test_options.py compares the two on every registered op). The
core checks the same ranges again (src/common/validate.cpp) for its other callers.

``options_in(op, args)`` finds them again in an op's arguments, for the fake kernels and the
autograd formulas, which the dispatcher hands the arguments in schema order.
"""

import dataclasses

import torch

from . import _library
from ._checks import _INF, _real, _representable, ignore_index_of

REDUCTIONS = ("none", "sum", "mean")


@dataclasses.dataclass(frozen=True)
class CeOptions:
    """ignore_index, reduction, label_smoothing, logit_scale, softcap (0 = off), z_loss, as the
    kernels take them (fields in the ops' schema order). Build it with :meth:`checked`; the plain
    constructor takes values as they are (options read back from an op's arguments)."""

    ignore_index: int = -100
    reduction: str = "mean"
    label_smoothing: float = 0.0
    logit_scale: float = 1.0
    softcap: float = 0.0
    z_loss: float = 0.0

    @classmethod
    def checked(cls, where, *, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                logit_scale=1.0, softcap=None, z_loss=0.0):
        """The options of a call of `where` (the name its errors start with), each checked to mean,
        once in the kernels' float32, what was asked for (softcap None = off).

        label_smoothing is narrowed to float32 without a check beyond its range, as PyTorch's own
        kernels narrow it (a float32 loss scales its smoothing term by the float32 value); the
        other three are fusedce's own options, and a value that float32 cannot hold to its
        precision is refused rather than turned into a different option (a softcap of 1e-50
        would become 0, off).

        Options already checked are looked up instead (every call of a training loop passes the
        same ones): the key holds each value's type beside it, so that 0, 0.0 and False, equal
        as dict keys, stay apart, and only plain int, float, str and None values are kept."""
        key = (ignore_index, reduction, label_smoothing, logit_scale, softcap, z_loss)
        types = tuple(map(type, key))
        known = _CHECKED.get((key, types)) if _SIMPLE.issuperset(types) else None
        if known is not None:
            return known
        options = cls._check(where, ignore_index, reduction, label_smoothing, logit_scale, softcap,
                             z_loss)
        if _SIMPLE.issuperset(types) and len(_CHECKED) < _CHECKED_MAX:
            _CHECKED[(key, types)] = options
        return options

    @classmethod
    def _check(cls, where, ignore_index, reduction, label_smoothing, logit_scale, softcap, z_loss):
        if reduction not in REDUCTIONS:
            raise ValueError(f"{where}: reduction must be 'none', 'sum' or 'mean', got {reduction!r}")
        ignore_index = ignore_index_of(ignore_index, where)
        label_smoothing = _real(label_smoothing, "label_smoothing", where)
        if not 0.0 <= label_smoothing <= 1.0:
            raise ValueError(f"{where}: label_smoothing must be in [0, 1], got {label_smoothing!r}")
        logit_scale = _real(logit_scale, "logit_scale", where)
        if not (-_INF < logit_scale < _INF and logit_scale != 0.0):
            raise ValueError(f"{where}: logit_scale must be finite and non-zero, got {logit_scale!r}")
        _representable(logit_scale, "logit_scale", where, "use a magnitude in [1.2e-38, 3.4e38]")
        if softcap is None:
            softcap = 0.0
        else:
            softcap = _real(softcap, "softcap", where)
            if not 0.0 < softcap < _INF:
                raise ValueError(f"{where}: softcap must be None (off) or finite and > 0, got {softcap!r}")
            _representable(softcap, "softcap", where, "use a value in [1.2e-38, 3.4e38], or None (off)")
            # The kernels evaluate tanh(x * (logit_scale / softcap)) with that ratio in float32
            # (taken here in double: the same up to float32's rounding of the two).
            _representable(logit_scale / softcap, "logit_scale / softcap", where,
                           f"logit_scale={logit_scale!r} and softcap={softcap!r} are too far apart")
        z_loss = _real(z_loss, "z_loss", where)
        if not 0.0 <= z_loss < _INF:
            raise ValueError(f"{where}: z_loss must be finite and >= 0, got {z_loss!r}")
        _representable(z_loss, "z_loss", where, "use 0 (off) or a value in [1.2e-38, 3.4e38]")
        return cls(ignore_index, reduction, label_smoothing, logit_scale, softcap, z_loss)

    def op_args(self):
        """The six op arguments, in schema order."""
        return (self.ignore_index, self.reduction, self.label_smoothing, self.logit_scale,
                self.softcap, self.z_loss)


# checked()'s memory of valid options: (values, their types) -> CeOptions. Bounded, so that a
# program sweeping an option over many values does not grow it without end.
_CHECKED = {}
_CHECKED_MAX = 256
_SIMPLE = frozenset((int, float, str, type(None)))

OPTION_NAMES = tuple(field.name for field in dataclasses.fields(CeOptions))
NUM_OPTIONS = len(OPTION_NAMES)


def options_position(schema):
    """Where the options start in an op's schema (a torch FunctionSchema), or None when it has
    none. Found by their names, which tests/python/test_options.py checks for every op."""
    names = [a.name for a in schema.arguments]
    for i in range(len(names) - NUM_OPTIONS + 1):
        if tuple(names[i:i + NUM_OPTIONS]) == OPTION_NAMES:
            return i
    return None


def options_in(at, args):
    """(args before the options, CeOptions, args after them) of an op's arguments `args`, whose
    options start at index `at` (options_position of its schema)."""
    return (args[:at], CeOptions(*args[at:at + NUM_OPTIONS]), args[at + NUM_OPTIONS:])


def register_fake(name):
    """``torch.library.register_fake`` of the op `name` for a fake kernel written with one
    ``options`` parameter (a CeOptions) where the schema has the six: the function registered
    takes the schema's arguments and hands the kernel the options in one."""
    at = options_position(getattr(_library.ops(), name).default._schema)

    def register(fake):
        def spread(*args):
            before, options, after = options_in(at, args)
            return fake(*before, options, *after)

        spread.__name__, spread.__qualname__, spread.__doc__ = fake.__name__, fake.__qualname__, fake.__doc__
        torch.library.register_fake(_library.qualified(name), spread)
        return fake

    return register
