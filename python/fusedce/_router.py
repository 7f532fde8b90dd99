"""The one router of the front ends: a call runs on plain tensors here, as the vocabulary-parallel
call its process group agrees on (fusedce.distributed.agreed_call), or through its DTensor form
(fusedce.dtensor), which reads the group and the layout from the DTensors and comes back to the
same plain run on their local tensors."""

import functools

from . import distributed, dtensor


def route(where, run, tensors, parallel, *, target, device, dtensor_form):
    """``run(*tensors, parallel)``, the call on plain tensors with its VocabParallel spec:

    * ``dtensor_form(run, *tensors, parallel)`` when any of `tensors` is a DTensor (a front end
      without a DTensor form passes None);
    * with a process group, inside ``distributed.agreed_call``: an error that one rank finds
      before the call's first collective is raised on every rank (`target` and `device` are
      what the agreement needs of the call);
    * at once otherwise."""
    if dtensor_form is not None and not dtensor.plain(*tensors) and dtensor.any_dtensor(*tensors):
        return dtensor_form(run, *tensors, parallel)
    if parallel.group is not None:
        return distributed.agreed_call(where, parallel, target, device, functools.partial(run, *tensors, parallel))
    return run(*tensors, parallel)
