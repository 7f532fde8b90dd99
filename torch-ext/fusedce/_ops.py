"""The ops of this build, under the namespace that is this build's own (the Kernels Hub
convention: ``ops`` and ``add_op_namespace_prefix``)."""

from ._fusedce import _library

ops = _library.ops()


def add_op_namespace_prefix(op_name):
    """The op's qualified name, "<this build's namespace>::<op_name>"."""
    return _library.qualified(op_name)
