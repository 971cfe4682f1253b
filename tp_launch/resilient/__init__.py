"""Resilient mode's worker API: a script opts in with a State, a loop and ``run``.

    from tp_launch import resilient

    state = resilient.State(model=model, optimizer=opt)   # what must survive

    def train(state):
        ddp = DDP(state.model)
        for step in state.steps(total):                   # one committed iteration each
            ...

    resilient.run(train, state)                           # train(state) resumes where
                                                          # the last commit left off

See :mod:`tp_launch.resilient.state` for what an iteration is and what is rolled back,
:mod:`tp_launch.resilient.runtime` for the protocol, and the README for a full example
and its diff against a plain DDP script.
"""

from tp_launch.resilient.ddp import ordered_allreduce_hook
from tp_launch.resilient.runtime import parked_spares, run
from tp_launch.resilient.state import Generation, GenerationChanged, ResilientUsageError, State

__all__ = ["Generation", "GenerationChanged", "ResilientUsageError", "State",
           "ordered_allreduce_hook", "parked_spares", "run"]
