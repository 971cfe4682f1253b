"""Documents forged under a live job's etcd prefix (issue 25): anyone who can write to an
etcd without auth can write there. A malformed document is one error line and is left
out, or stops the job loudly; it never crashes an agent (the unit side, every document
kind and bound: tests/test_bounded_json.py).
"""

from __future__ import annotations

import time

import pytest

from tests.conftest import TP_RUN, run_launcher
from tests.test_etcd_outages import kv_for
from tests.test_resilient import (
    _parked,
    _status,
    _wait,
    all_held,
    exits,
    node_job,
)

DEEP = "[" * 100_000  # a RecursionError for a JSON parser without a depth bound
NESTED = '{"a": ' * 20 + "1" + "}" * 20  # small, but deeper than the bound (16)


@pytest.mark.slow
def test_forged_documents_in_a_live_jobs_etcd(workdir, test_env, etcd_server):
    """Two nodes over etcd. Forged status documents of made-up nodes (nested 100,000
    deep, nested 20 deep, not an object; etcd itself refuses requests over 1.5 MiB),
    read by each agent for ``tp-run status``: one error line per forged node, the agent
    answers and goes on. Then the rendezvous state itself is forged (nested): the job
    stops loudly, every agent with an error line and a non-zero exit, no traceback.
    (The agents used to crash on both: RecursionError.)"""
    with node_job(workdir, test_env, etcd_server) as (start, agents, out):
        for node in range(2):
            start(node, "--nnodes", "2", "--spares", "1")
        _wait(lambda: all_held(out) and all(_parked(a) >= 1 for a in agents),
              "4 ranks hold, every node parks a spare")
        run_id = _status(agents[0]).run_id
        kv = kv_for(etcd_server)
        forged = {"deep": DEEP, "nested": NESTED, "list": "[1, 2]"}
        for name, doc in forged.items():
            kv.put(f"/tp-run/{run_id}/status/{name}", doc)
        for _ in range(2):  # the second time: no new line
            for agent in agents:
                status = run_launcher(TP_RUN, ["status", "--agent-pid", str(agent.pid)],
                                      test_env, workdir)
                assert status.returncode == 0 and "world size 4" in status.stdout, \
                    status.stdout + status.stderr
        kv.put(f"/tp-run/{run_id}/state", DEEP)
        results = exits(agents)
    for rc, err in results:
        assert rc != 0 and "Traceback" not in err, err[-4000:]
        malformed = [line for line in err.splitlines() if "status document is malformed" in line]
        assert len(malformed) == len(forged), malformed
        assert all(any(f"'{n}'" in line for line in malformed) for n in forged), malformed
        assert "worker group stopped: the rendezvous backend failed: the job's state " \
            "document is malformed (malformed rendezvous state: nested deeper than 16)" in err, \
            err[-4000:]
    assert not list(out.glob("final_*.json"))
