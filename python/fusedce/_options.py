"""A call's options as objects mirroring the core's (include/fusedce), each built once per call
from the public keywords and handed down whole:

* ``Options``: the loss's options (fusedce::Options without its flags);
* ``LinearOptions``: the linear form's (fusedce::LinearOptions);
* ``LogprobOptions``: the log-probabilities' (fusedce::LogprobOptions);
* ``VocabParallel``: a vocabulary-parallel call as asked for (the process group, vocab_start and
  vocab_total as passed), and ``ShardSpec``: this rank's block once the layout rules of
  fusedce.distributed have resolved it (fusedce::ShardSpec);
* ``Call``: the whole call (its name, the objects above, its flags): what the router
  (fusedce._router), ``distributed.agreed_call`` and the autograd functions take.

``Options.checked`` (and the other ``checked``) check each value with a message that names the
argument: what the core cannot see (Python types; a value that float32, the core's type, cannot
hold). ``op_args()`` gives each as the ops take it: scalar arguments in the order of their
schema (``FUSEDCE_CE_ARGS`` in torch/options.h is ``OPTION_NAMES``; tests/python/test_options.py
compares the two on every registered op). The core checks the ranges again
(src/common/validate.cpp) for its other callers.

``options_in(op, args)`` finds the options again in an op's arguments, for the fake kernels and
the autograd formulas, which the dispatcher hands the arguments in schema order.
"""

import dataclasses
from typing import Optional, Tuple

import torch

from . import _library
from ._checks import _INF, _real, _representable, ignore_index_of

REDUCTIONS = ("none", "sum", "mean")


@dataclasses.dataclass(frozen=True)
class Options:
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


@dataclasses.dataclass(frozen=True)
class LinearOptions:
    """The linear form's options, as fusedce::LinearOptions holds them: shift_seq_len (rows per
    sequence of the causal shift; 0 = none), chunk_budget_bytes (0 = the core's default),
    low_memory, skip_ignored. Build it with :meth:`checked`."""

    shift_seq_len: int = 0
    chunk_budget_bytes: int = 0
    low_memory: bool = False
    skip_ignored: bool = False

    @classmethod
    def checked(cls, where, hidden, *, shift=False, chunk_budget_bytes=None, low_memory=False,
                skip_ignored=False):
        """The linear options of a call of `where` over `hidden` (..., S, H): shift=True is a
        sequence of S rows (all rows for (N, H) or (H,) hidden); chunk_budget_bytes None (the
        core's default) or a positive int the core's size_t holds (not a bool)."""
        if chunk_budget_bytes is not None and not (isinstance(chunk_budget_bytes, int)
                                                   and not isinstance(chunk_budget_bytes, bool)
                                                   and 0 < chunk_budget_bytes < 2**63):
            raise ValueError(f"{where}: chunk_budget_bytes must be None (the default) or a positive int "
                             f"below 2**63, got {chunk_budget_bytes!r}")
        seq_len = (hidden.shape[-2] if hidden.dim() >= 2 else 1) if shift else 0
        key = (int(seq_len), int(chunk_budget_bytes or 0), bool(low_memory), bool(skip_ignored))
        known = _LINEAR.get(key)  # the same values every call of a training loop
        if known is None:
            known = cls(*key)
            if len(_LINEAR) >= _CHECKED_MAX:
                _LINEAR.clear()
            _LINEAR[key] = known
        return known

    def op_args(self):
        """The four op arguments of the lce_* ops, in schema order."""
        return (self.shift_seq_len, self.chunk_budget_bytes, self.low_memory, self.skip_ignored)


@dataclasses.dataclass(frozen=True)
class LogprobOptions:
    """The log-probabilities' options, as fusedce::LogprobOptions holds them (fields in the ops'
    schema order). Build it with :meth:`checked`."""

    temperature: float = 1.0
    ignore_index: int = -100
    distribution_stats: bool = False

    @classmethod
    def checked(cls, where, *, temperature=1.0, ignore_index=-100, distribution_stats=False):
        t = _real(temperature, "temperature", where)
        if not 0.0 < t < _INF:
            raise ValueError(f"{where}: temperature must be finite and > 0, got {temperature!r}")
        _representable(t, "temperature", where, "use a value in [1.2e-38, 3.4e38]")
        _representable(1.0 / t, "1 / temperature", where, "use a value in [3e-38, 8e37]")
        return cls(t, ignore_index_of(ignore_index, where), bool(distribution_stats))

    def op_args(self):
        return (self.temperature, self.ignore_index, self.distribution_stats)


@dataclasses.dataclass(frozen=True)
class VocabParallel:
    """A vocabulary-parallel call as asked for: the process group whose ranks split the
    vocabulary, vocab_start and vocab_total as passed (None: by the layout rules of
    fusedce.distributed), the order of the group's ranks along the vocabulary when it is not
    rank order (a DTensor's, from its mesh), and what the vocabulary-parallel form was asked for
    by, for errors. group None: a single device."""

    group: object = None
    vocab_start: object = None
    vocab_total: object = None
    order: Optional[Tuple[int, ...]] = None
    source: str = "process_group"

    @classmethod
    def of(cls, process_group, vocab_start, vocab_total):
        """The spec of a call's keywords (SINGLE_DEVICE, one object, when none is given)."""
        if process_group is None and vocab_start is None and vocab_total is None:
            return SINGLE_DEVICE
        return cls(process_group, vocab_start, vocab_total)

    @property
    def rule(self):
        """Which row of fusedce.distributed's layout table applies (any values, checked or not)."""
        if self.vocab_start is None:
            return 0 if self.vocab_total is None else 1
        return 2 if self.vocab_total is not None else 3

    def given(self):
        """The name of the first keyword the caller passed, or None."""
        for name in ("process_group", "vocab_start", "vocab_total"):
            if getattr(self, "group" if name == "process_group" else name) is not None:
                return name
        return None

    def check_single(self, where, what=""):
        """vocab_start and vocab_total mean nothing without a process group."""
        if self.group is None and (self.vocab_start is not None or self.vocab_total is not None):
            raise ValueError(f"{where}: vocab_start and vocab_total are only used with a "
                             f"process_group{what}")


SINGLE_DEVICE = VocabParallel()


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """This rank's block of the vocabulary, as fusedce::ShardSpec holds it (its first column and
    V), with the columns it holds and the layout rule (VocabParallel.rule), which the gather's
    check of the tiling reads. A single device holds the whole vocabulary (rule None)."""

    vocab_start: int
    vocab_total: int
    local_vocab: int
    rule: Optional[int] = None

    @classmethod
    def whole(cls, vocab):
        return cls(0, vocab, vocab)

    def op_args(self):
        return (self.vocab_start, self.vocab_total)


@dataclasses.dataclass(frozen=True)
class Call:
    """One call of a front end, as its keywords decided it: its name (which its errors start
    with), the options of its kind (Options or LogprobOptions), the linear options (None for a
    form over logits), the vocabulary-parallel spec, and its flags (each False unless the front
    end has it)."""

    where: str
    options: object
    linear: Optional[LinearOptions] = None
    # No default object here or in of(): torch.compile (dynamo of torch 2.11) cannot wrap
    # an object that arrives as a function's default value.
    parallel: VocabParallel = None
    return_metrics: bool = False
    check_targets: bool = False
    inplace_backward: bool = False
    strict: bool = False
    keep_logits: object = False  # linear_logprobs: None (decided per call by logit_room), True or False
    return_entropy: bool = False

    @classmethod
    def of(cls, where, options, linear=None, parallel=None, return_metrics=False,
           check_targets=False, inplace_backward=False, strict=False, keep_logits=False,
           return_entropy=False):
        """The Call of these objects and flags, the same object again for the same ones (every
        call of a training loop builds the same one): found by the identities of options, linear
        and parallel and the flags' values, and checked to hold those very objects."""
        if parallel is None:
            parallel = SINGLE_DEVICE
        if torch.compiler.is_compiling():  # traced once per graph; dynamo cannot trace id()
            return cls(where, options, linear, parallel, return_metrics, check_targets, inplace_backward,
                       strict, keep_logits, return_entropy)
        key = (where, id(options), id(linear), id(parallel), return_metrics, check_targets,
               inplace_backward, strict, keep_logits, return_entropy)
        known = _CALLS.get(key)
        if (known is not None and known.options is options and known.linear is linear
                and known.parallel is parallel):
            return known
        call = cls(where, options, linear, parallel, return_metrics, check_targets, inplace_backward,
                   strict, keep_logits, return_entropy)
        if len(_CALLS) >= _CHECKED_MAX:
            _CALLS.clear()
        _CALLS[key] = call
        return call


# The memories of LinearOptions.checked and Call.of, bounded as Options.checked's is.
_LINEAR = {}
_CALLS = {}


# checked()'s memory of valid options: (values, their types) -> Options. Bounded, so that a
# program sweeping an option over many values does not grow it without end.
_CHECKED = {}
_CHECKED_MAX = 256
_SIMPLE = frozenset((int, float, str, type(None)))

OPTION_NAMES = tuple(field.name for field in dataclasses.fields(Options))
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
    """(args before the options, Options, args after them) of an op's arguments `args`, whose
    options start at index `at` (options_position of its schema)."""
    return (args[:at], Options(*args[at:at + NUM_OPTIONS]), args[at + NUM_OPTIONS:])


LINEAR_NAMES = tuple(field.name for field in dataclasses.fields(LinearOptions))


def linear_options_in(at, args):
    """(args before the options, Options, LinearOptions, args after both) of the arguments `args`
    of an lce op, whose options start at `at`."""
    before, options, after = options_in(at, args)
    return before, options, LinearOptions(*after[:len(LINEAR_NAMES)]), after[len(LINEAR_NAMES):]


def _argument_groups():
    """The runs of schema arguments a fake kernel takes as one object, with the object's maker:
    the six options (Options), an lce op's four linear options (LinearOptions), vocab_start and
    vocab_total (a ShardSpec without its local size), and a log-probability op's options
    (LogprobOptions). Longer runs first."""
    return (
        (OPTION_NAMES, Options),
        (LINEAR_NAMES, LinearOptions),
        (("vocab_start", "vocab_total"), lambda start, total: ShardSpec(start, total, None)),
        (tuple(field.name for field in dataclasses.fields(LogprobOptions)), LogprobOptions),
    )


def _grouping(names):
    """[(start, length, maker)] of the argument groups in an op's argument `names`, left to right."""
    found, i = [], 0
    while i < len(names):
        for group, maker in _argument_groups():
            if tuple(names[i:i + len(group)]) == group:
                found.append((i, len(group), maker))
                i += len(group)
                break
        else:
            i += 1
    return found


def register_fake(name):
    """``torch.library.register_fake`` of the op `name` for a fake kernel written with one
    parameter per argument group of its schema (_argument_groups: ``options`` an Options,
    ``linear`` a LinearOptions, ``shard`` a ShardSpec, a LogprobOptions) in place of the
    group's scalars: the function registered takes the schema's arguments and hands the kernel
    the objects."""
    schema = getattr(_library.ops(), name).default._schema
    groups = _grouping([a.name for a in schema.arguments])

    def register(fake):
        def spread(*args):
            packed, at = [], 0
            for start, length, maker in groups:
                packed += args[at:start]
                packed.append(maker(*args[start:start + length]))
                at = start + length
            return fake(*packed, *args[at:])

        spread.__name__, spread.__qualname__, spread.__doc__ = fake.__name__, fake.__qualname__, fake.__doc__
        torch.library.register_fake(_library.qualified(name), spread)
        return fake

    return register
