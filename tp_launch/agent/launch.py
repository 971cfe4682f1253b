"""``tp-run``'s agent entry point: pick the agent the flags ask for and run it.

:func:`run_agent` sets ``OMP_NUM_THREADS`` as torchrun does, starts the process guardian
(:mod:`tp_launch.procs.guardian`) and the signal watch, forms the rendezvous handler and
runs the compatible agent (:class:`~tp_launch.agent.node_agent.NodeAgent`) or, with
``--spares``, the resilient one (:class:`~tp_launch.agent.resilient_agent.ResilientAgent`).
It lives apart from both agents so that neither imports the other's module to be chosen.
"""

from __future__ import annotations

import logging
import os
import sys

from rendezvous import RendezvousError, create_handler
from tp_launch.agent.node_agent import NodeAgent, SignalReceived, SignalWatch
from tp_launch.agent.resilient_agent import ResilientAgent
from tp_launch.config import ConfigError, LaunchConfig
from tp_launch.control_files import control_dirs, remove_stale
from tp_launch.procs.guardian import GUARDIAN
from tp_launch.procs.logs import LogLayout, temp_log_dirs
from tp_launch.procs.worker import ignore_in_workers

logger = logging.getLogger(__name__)

OMP_WARNING = (
    "\n*****************************************\n"
    "Setting OMP_NUM_THREADS environment variable for each process to be "
    "1 in default, to avoid your system being overloaded, "
    "please further tune the variable for optimal performance in "
    "your application as needed. \n"
    "*****************************************"
)


def run_agent(config: LaunchConfig) -> int:
    """Run the agent for ``config``; setup errors become one line and exit 2."""
    if "OMP_NUM_THREADS" not in os.environ and config.nproc_per_node > 1:
        logger.warning(OMP_WARNING)
        os.environ["OMP_NUM_THREADS"] = "1"
    GUARDIAN.start()  # forks: before any thread exists
    notices = [config.preempt_signal] if config.on_preempt != "ignore" else []
    ignore_in_workers(notices)  # a scheduler may signal every process: the agent acts
    watch = SignalWatch(config.signals_to_handle, notices)
    try:
        code = _run_agent(config, watch)
    finally:
        signalled = bool(watch.pending)
        watch.close()
        GUARDIAN.stop()
    if signalled:
        # Everything is stopped and cleaned up: leave now. Python's own teardown of an
        # agent that imported torch (to host a store) takes seconds more.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _run_agent(config: LaunchConfig, watch: SignalWatch) -> int:
    layout: LogLayout | None = None
    # What an agent of this user that was SIGKILLed left (it removes its own otherwise).
    for path in remove_stale([*control_dirs(), *temp_log_dirs()]):
        logger.info("removed %s, left by a tp-run agent that is gone", path)
    try:
        layout = LogLayout(config, config.run_id)  # an unusable --log-dir: exit 2 up front
        with watch.interruptible():  # reaching the rendezvous service can take a while
            rdzv = create_handler(config)
        agent = ResilientAgent if config.spares > 0 else NodeAgent
        return agent(config, rdzv, layout).run(watch)
    except SignalReceived as e:
        print(f"tp-run: stopped by {e.sig.name}", file=sys.stderr)
        return 1
    except (RendezvousError, ConfigError) as e:
        print(f"tp-run: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, ConfigError) else 1
    finally:
        if layout is not None:
            layout.close()  # the temporary log dir goes, whatever the outcome
