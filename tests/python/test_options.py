"""The options' one order: the option objects (python/fusedce/_options.py: Options, LinearOptions,
LogprobOptions, ShardSpec) against the schemas the extension registered (FUSEDCE_CE_ARGS in
torch/options.h), so that the two cannot drift; and the one constructor that checks them."""

import pytest
import torch

import fusedce
from fusedce import _library
from fusedce._options import (LINEAR_NAMES, OPTION_NAMES, LinearOptions, LogprobOptions, Options, ShardSpec,
                              VocabParallel, linear_options_in, options_in, options_position)

# The schema types of the six, in order (int ignore_index, str reduction, float ...).
_TYPES = ("int", "str", "float", "float", "float", "float")


def _registered_ops():
    prefix = _library.namespace + "::"
    names = sorted({n[len(prefix):].split(".")[0] for n in torch._C._dispatch_get_all_op_names()
                    if n.startswith(prefix)})
    return [(name, getattr(_library.ops(), name).default._schema) for name in names]


def test_every_op_with_options_takes_them_in_the_python_order():
    with_options = []
    for name, schema in _registered_ops():
        names = [a.name for a in schema.arguments]
        if name.startswith(("ld_", "ldk_")):  # DistillOptions (test_distillation.py, test_distillation_vp.py)
            continue
        if "reduction" not in names:  # the log-probability ops and ce_rescale_ take none of them
            assert not set(OPTION_NAMES) - {"ignore_index"} & set(names), name
            continue
        at = options_position(schema)
        assert at is not None, f"{name}: the options are not {OPTION_NAMES} in a row: {names}"
        types = tuple(str(a.type) for a in schema.arguments[at:at + len(OPTION_NAMES)])
        assert types == _TYPES, f"{name}: {types}"
        assert names.count("ignore_index") == 1, name
        with_options.append(name)
    # every op of the cross-entropy families (a renamed argument would drop one from this list)
    assert with_options == sorted([
        "ce_fwd_bwd", "ce_fwd_bwd_", "ce_loss", "ce_shard_bwd", "ce_shard_merge", "ce_shard_stats", "lce_fwd",
        "lce_fwd_bwd", "lce_shard_bwd", "lce_shard_merge", "lce_shard_stats"])


def test_op_args_follow_the_field_order():
    o = Options(1, "sum", 0.25, 2.0, 30.0, 1e-4)
    assert o.op_args() == tuple(getattr(o, n) for n in OPTION_NAMES)
    before, back, after = options_in(3, ("x", "t", None, *o.op_args(), True))
    assert before == ("x", "t", None) and back == o and after == (True,)


def test_checked_gives_what_the_kernels_take():
    o = Options.checked("f", ignore_index=torch.tensor(3), reduction="none", label_smoothing=0.5,
                          logit_scale=2, softcap=None, z_loss=0)
    assert o.op_args() == (3, "none", 0.5, 2.0, 0.0, 0.0)
    assert all(type(v) is t for v, t in zip(o.op_args(), (int, str, float, float, float, float)))
    assert Options.checked("f") == Options()
    with pytest.raises(ValueError, match="f: reduction must be 'none', 'sum' or 'mean', got 'avg'"):
        Options.checked("f", reduction="avg")
    with pytest.raises(AttributeError):
        o.reduction = "sum"  # frozen: built and checked once


def test_the_core_checks_the_ranges_for_callers_of_the_ops():
    # The ops themselves (no Python check in front) get the core's messages, naming the argument.
    x, t = torch.randn(4, 7), torch.randint(0, 7, (4,))
    ops = _library.ops()
    for i, (bad, match) in enumerate([(1.5, "label_smoothing must be in"),
                                      (0.0, "logit_scale must be finite and non-zero"),
                                      (-1.0, "softcap must be finite and >= 0"),
                                      (-0.5, "z_loss must be finite and >= 0")]):
        args = [-100, "mean", 0.0, 1.0, 0.0, 0.0]
        args[2 + i] = bad
        with pytest.raises(ValueError, match=match):
            ops.ce_loss(x, t, None, *args, False)
    assert fusedce.cross_entropy(x, t).shape == ()


def test_checked_options_are_remembered_by_value_and_type():
    """checked() looks options it has seen up again; a value equal as a dict key but of another
    type (False for 0, True for 1) is still checked, and still refused."""
    first = Options.checked("t", label_smoothing=0.0, softcap=1)
    assert Options.checked("t", label_smoothing=0.0, softcap=1) is first
    assert Options.checked("t", label_smoothing=0, softcap=1.0) == first
    with pytest.raises(TypeError, match="softcap"):
        Options.checked("t", label_smoothing=0.0, softcap=True)
    with pytest.raises(TypeError, match="label_smoothing"):
        Options.checked("t", label_smoothing=False, softcap=1)
    with pytest.raises(ValueError, match="reduction"):
        Options.checked("t", reduction="Mean")


def _names(op):
    return [a.name for a in getattr(_library.ops(), op).default._schema.arguments]


def test_linear_options_follow_the_lce_schemas():
    # Every lce op, the shard steps included, takes the four right after the six.
    for op in ("lce_fwd", "lce_fwd_bwd", "lce_shard_stats", "lce_shard_merge", "lce_shard_bwd"):
        names = _names(op)
        at = options_position(getattr(_library.ops(), op).default._schema) + len(OPTION_NAMES)
        assert tuple(names[at:at + len(LINEAR_NAMES)]) == LINEAR_NAMES, op
    linear = LinearOptions(4, 1 << 20, True, False)
    assert linear.op_args() == tuple(getattr(linear, n) for n in LINEAR_NAMES)
    args = ("h", "w", None, "t", None, *Options().op_args(), *linear.op_args(), True)
    before, options, back, after = linear_options_in(5, args)
    assert before == args[:5] and options == Options() and back == linear and after == (True,)


def test_linear_options_checked():
    h = torch.zeros(2, 7, 3)
    assert LinearOptions.checked("f", h, shift=True, chunk_budget_bytes=64) == LinearOptions(7, 64)
    assert LinearOptions.checked("f", h[0], shift=True).shift_seq_len == 7
    assert LinearOptions.checked("f", h[0, 0], shift=True).shift_seq_len == 1
    assert LinearOptions.checked("f", h, low_memory=1, skip_ignored=1) == LinearOptions(0, 0, True, True)
    for bad in (0, -1, True, 1.0, 2**63):
        with pytest.raises(ValueError, match="f: chunk_budget_bytes must be None"):
            LinearOptions.checked("f", h, chunk_budget_bytes=bad)


def test_logprob_and_shard_objects_follow_the_lp_schemas():
    for op in ("lp_stats", "llp_stats", "lp_merge", "lp_distribution_stats", "lp_bwd", "llp_bwd", "lp_bwd_"):
        names = _names(op)
        at = names.index("vocab_start")
        assert names[at:at + 5] == ["vocab_start", "vocab_total", "temperature", "ignore_index",
                                    "distribution_stats"], op
    assert LogprobOptions.checked("f", temperature=2, ignore_index=3).op_args() == (2.0, 3, False)
    assert LogprobOptions.checked("f", distribution_stats=1).op_args() == (1.0, -100, True)
    assert ShardSpec(5, 20, 7, 2).op_args() == (5, 20)
    assert ShardSpec.whole(9) == ShardSpec(0, 9, 9, None)
    with pytest.raises(ValueError, match="f: temperature must be finite and > 0"):
        LogprobOptions.checked("f", temperature=0.0)


def test_vocab_parallel_rules_and_keywords():
    assert [VocabParallel("g", s, t).rule for s, t in ((None, None), (None, 9), (0, 9), (0, None))] == [0, 1, 2, 3]
    assert VocabParallel().given() is None
    assert VocabParallel(vocab_total=3).given() == "vocab_total"
    assert VocabParallel("g", 0).given() == "process_group"
    with pytest.raises(ValueError, match="f: vocab_start and vocab_total are only used with a process_group!"):
        VocabParallel(vocab_start=0).check_single("f", "!")
    VocabParallel("g", 0).check_single("f")


def test_call_and_linear_options_are_remembered_for_the_same_objects():
    """Call.of and LinearOptions.checked give the same object again for the same inputs (every
    call of a training loop), and a new one for any other option, flag or spec."""
    from fusedce._options import SINGLE_DEVICE, Call

    o, other = Options.checked("t"), Options.checked("t", reduction="sum")
    h = torch.zeros(2, 3, 4)
    lin = LinearOptions.checked("t", h, shift=True)
    assert LinearOptions.checked("t", h, shift=True) is lin
    assert LinearOptions.checked("t", h, shift=True, low_memory=True) == LinearOptions(3, 0, True, False)
    first = Call.of("t", o, lin, return_metrics=True)
    assert Call.of("t", o, lin, return_metrics=True) is first
    assert Call.of("t", o, lin) == Call("t", o, lin, SINGLE_DEVICE)
    assert Call.of("t", other, lin, return_metrics=True).options is other
    spec = VocabParallel("g", 0, 8)
    assert Call.of("t", o, lin, spec, return_metrics=True).parallel is spec
    assert Call.of("u", o, lin, return_metrics=True).where == "u"
    assert VocabParallel.of(None, None, None) is VocabParallel.of(None, None, None)
    assert VocabParallel.of(None, None, 8) == VocabParallel(None, None, 8)
