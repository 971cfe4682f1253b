"""Resilient mode's worker API: a script opts in with a State and ``run``.

    from tp_launch import resilient

    state = resilient.State(model=model, optimizer=opt)   # what must survive
    resilient.run(train, state)                           # train(state) resumes at state.step

See :mod:`tp_launch.resilient.runtime` for the protocol and the README for a full
example and its diff against a plain DDP script.
"""

from tp_launch.resilient.ddp import ordered_allreduce_hook
from tp_launch.resilient.runtime import parked_spares, run
from tp_launch.resilient.state import GenerationChanged, State

__all__ = ["GenerationChanged", "State", "ordered_allreduce_hook", "parked_spares", "run"]
