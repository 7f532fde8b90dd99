"""The options' one order: CeOptions (python/fusedce/_options.py) against the schemas the extension
registered (FUSEDCE_CE_ARGS in torch/options.h), so that the two cannot drift; and the one
constructor that checks them."""

import pytest
import torch

import fusedce
from fusedce import _library
from fusedce._options import OPTION_NAMES, CeOptions, options_in, options_position

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
        "ce_bwd", "ce_bwd_out", "ce_fwd", "ce_fwd_bwd", "ce_fwd_bwd_inplace", "ce_fwd_bwd_out",
        "ce_fwd_out", "ce_loss", "ce_shard_bwd", "ce_shard_merge", "ce_shard_stats", "lce_fwd", "lce_fwd_bwd",
        "lce_fwd_bwd_out", "lce_fwd_out", "lce_shard_bwd", "lce_shard_stats"])


def test_op_args_follow_the_field_order():
    o = CeOptions(1, "sum", 0.25, 2.0, 30.0, 1e-4)
    assert o.op_args() == tuple(getattr(o, n) for n in OPTION_NAMES)
    before, back, after = options_in(3, ("x", "t", None, *o.op_args(), True))
    assert before == ("x", "t", None) and back == o and after == (True,)


def test_checked_gives_what_the_kernels_take():
    o = CeOptions.checked("f", ignore_index=torch.tensor(3), reduction="none", label_smoothing=0.5,
                          logit_scale=2, softcap=None, z_loss=0)
    assert o.op_args() == (3, "none", 0.5, 2.0, 0.0, 0.0)
    assert all(type(v) is t for v, t in zip(o.op_args(), (int, str, float, float, float, float)))
    assert CeOptions.checked("f") == CeOptions()
    with pytest.raises(ValueError, match="f: reduction must be 'none', 'sum' or 'mean', got 'avg'"):
        CeOptions.checked("f", reduction="avg")
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
            ops.ce_fwd(x, t, None, *args, False)
    assert fusedce.cross_entropy(x, t).shape == ()


def test_checked_options_are_remembered_by_value_and_type():
    """checked() looks options it has seen up again; a value equal as a dict key but of another
    type (False for 0, True for 1) is still checked, and still refused."""
    first = CeOptions.checked("t", label_smoothing=0.0, softcap=1)
    assert CeOptions.checked("t", label_smoothing=0.0, softcap=1) is first
    assert CeOptions.checked("t", label_smoothing=0, softcap=1.0) == first
    with pytest.raises(TypeError, match="softcap"):
        CeOptions.checked("t", label_smoothing=0.0, softcap=True)
    with pytest.raises(TypeError, match="label_smoothing"):
        CeOptions.checked("t", label_smoothing=False, softcap=1)
    with pytest.raises(ValueError, match="reduction"):
        CeOptions.checked("t", reduction="Mean")
