"""etcd outages: the rendezvous backend SIGKILLed and restarted (same port, same data
directory) while a job runs. Nothing that does not need etcd stops; what needs it waits
for it, up to ``--rdzv-conf outage_timeout``; past that, one clear line.

Each test has an etcd of its own (``etcd``), since the tests kill it. The first part
drives the membership protocol directly (members are threads with their own clients);
the second runs real 2-node jobs (two tp-run agents on 127.0.0.2/3, real gloo, real
SIGKILLs) in compatible and resilient mode, with and without a rank failure during the
outage, and compares the result with torchrun's failure-free run.
"""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from rendezvous.api import RendezvousError
from rendezvous.kv import KVError, KVUnavailable
from rendezvous.membership import CHANGE_FAILURE, CHANGE_LOST, Membership, Timeouts
from tests.etcd_server import EtcdServer
from tests.test_rendezvous import FAST, close_all, crash, join_all, wait_change
from tests.test_resilient import (
    RDZV_CONF,
    STEPS,
    _parked,
    _wait,
    all_held,
    entries,
    exits,
    finals,
    node_job,
)

HANG = 60.0


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    """An etcd of this test's own (the test kills and restarts it)."""
    directory = tmp_path / "etcd"
    directory.mkdir()
    with EtcdServer(directory) as server:
        yield server


def kv_for(etcd: EtcdServer):
    from rendezvous.etcd import EtcdKV

    return EtcdKV("127.0.0.1", etcd.port, timeout=5, connect_timeout=10)


def members(etcd: EtcdServer, n: int, **t) -> list[Membership]:
    rid = f"job-{uuid.uuid4().hex[:8]}"
    return [Membership(kv_for(etcd), "/tp-test", rid, n, n, f"127.0.0.{i + 1}",
                       Timeouts(**{**FAST, **t}), safety_poll=0.3) for i in range(n)]


def in_thread(fn) -> tuple[threading.Thread, dict]:
    """Run ``fn()`` in a thread; its result or exception lands in the dict."""
    out: dict = {}

    def go() -> None:
        try:
            out["result"] = fn()
        except Exception as e:  # noqa: BLE001 - inspected by the test
            out["error"] = e

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t, out


# ---------------------------------------------------------------- the etcd client


@pytest.mark.slow
def test_client_reports_an_outage_and_its_watch_survives_it(etcd):
    """While etcd is down a request raises KVUnavailable (not a refusal) and the
    client says since when; after the restart requests work again, and a watch made
    before the outage sees changes made after it."""
    kv, writer = kv_for(etcd), kv_for(etcd)
    seen = threading.Event()
    try:
        kv.put("/w/a", "1")
        cancel = kv.watch_prefix("/w/", seen.set)
        etcd.kill()
        with pytest.raises(KVUnavailable):
            kv.get("/w/a")
        assert kv.outage_since is not None
        etcd.restart()
        deadline = time.monotonic() + HANG
        while True:
            try:
                assert kv.get("/w/a")[0] == "1"
                break
            except KVUnavailable:
                assert time.monotonic() < deadline, "etcd did not come back"
                time.sleep(0.2)
        assert kv.outage_since is None
        time.sleep(2.0)  # the watch is armed again in the background
        seen.clear()
        writer.put("/w/b", "2")
        assert seen.wait(15), "the watch did not survive the restart"
        cancel()
    finally:
        kv.close()
        writer.close()


def test_refusals_are_not_outages(etcd):
    """An answer from etcd that says no (here: a put on a lease that does not exist)
    is a plain KVError: nothing waits for it to go away."""
    kv = kv_for(etcd)
    try:
        with pytest.raises(KVError) as info:
            kv.put("/r/a", "1", lease=123456789)
        assert not isinstance(info.value, KVUnavailable)
        assert kv.outage_since is None
    finally:
        kv.close()


@pytest.mark.slow
def test_restart_with_authentication(tmp_path):
    """With authentication on, the client keeps working across an etcd restart (it
    logs in again if etcd forgot its token)."""
    from rendezvous.etcd import EtcdKV

    directory = tmp_path / "etcd"
    directory.mkdir()
    with EtcdServer(directory, root_password="secret-pw") as server:
        kv = EtcdKV("127.0.0.1", server.port, timeout=5, connect_timeout=10,
                    user="root", password="secret-pw")
        try:
            kv.put("/a/k", "1")
            kv._client.metadata = (("token", "forgotten.1"),)  # as after a restart
            assert kv.get("/a/k")[0] == "1"
            server.kill()
            server.restart()
            deadline = time.monotonic() + HANG
            while True:
                try:
                    assert kv.get("/a/k")[0] == "1"
                    break
                except KVUnavailable:
                    assert time.monotonic() < deadline
                    time.sleep(0.2)
        finally:
            kv.close()


# ---------------------------------------------------------------- the protocol


@pytest.mark.slow
def test_outage_longer_than_the_lease_loses_nobody(etcd):
    """etcd down for three lease TTLs, then back: no member counts another lost (etcd
    gives every lease its full TTL again), the world is unchanged, and the monitors
    still see a real loss afterwards, through watches armed again (the monitor's own
    poll is 30 s, the wait here 15 s)."""
    ms = members(etcd, 2)
    try:
        join_all(ms)
        for m in ms:
            m.start_monitor()
        etcd.kill()
        time.sleep(3 * FAST["lease_ttl"])
        etcd.restart()
        time.sleep(3 * FAST["lease_ttl"])
        assert [m.world_change() for m in ms] == [None, None]
        # Nothing pokes fd either: compatible mode's agent selects on it without draining.
        assert select.select([m.fd for m in ms], [], [], 0)[0] == []
        assert ms[0].alive_members() == {m.id for m in ms}
        crash(ms[1])
        change = wait_change(ms[0], timeout=15)
        assert change.kind == CHANGE_LOST and ms[1].id in change.detail
    finally:
        close_all(ms)


@pytest.mark.slow
def test_join_waits_for_the_backend(etcd):
    """Members that join while etcd is down wait for it and form their world when it
    is back."""
    ms = members(etcd, 2)
    try:
        etcd.kill()
        threads = [in_thread(lambda m=m: m.join(1)) for m in ms]
        time.sleep(3.0)
        assert all(t.is_alive() for t, _ in threads)
        etcd.restart()
        for t, out in threads:
            t.join(HANG)
            assert not t.is_alive() and "error" not in out, out
        assert {len(out["result"].participants) for _, out in threads} == {2}
    finally:
        close_all(ms)


@pytest.mark.slow
def test_join_gives_up_after_outage_timeout(etcd):
    """etcd never comes back: the join ends with one error naming outage_timeout."""
    ms = members(etcd, 2, outage_timeout=2)
    try:
        join_all(ms)
        etcd.kill()
        t, out = in_thread(lambda: ms[0].join(1))
        t.join(HANG)
        assert not t.is_alive()
        error = out.get("error")
        assert isinstance(error, RendezvousError), out
        assert "outage_timeout=2s" in str(error) and "\n" not in str(error)
    finally:
        etcd.restart()
        close_all(ms)


@pytest.mark.slow
def test_failure_report_waits_for_the_backend(etcd):
    """A failure reported while etcd is down is not lost: the member's next join
    delivers it first, and the other member sees a counted failure with its detail."""
    ms = members(etcd, 2)
    try:
        join_all(ms)
        ms[1].start_monitor()
        etcd.kill()
        assert not ms[0].report_failure("rank 0 exited with 3")
        t, out = in_thread(lambda: ms[0].join(1))
        time.sleep(2.0)
        etcd.restart()
        change = wait_change(ms[1])
        assert change.kind == CHANGE_FAILURE and "rank 0 exited with 3" in change.detail
        join_all(ms[1:])
        t.join(HANG)
        assert "error" not in out, out
    finally:
        close_all(ms)


@pytest.mark.slow
def test_final_failure_report_is_delivered_on_close(etcd):
    """A member that stops (no restart left) during an outage waits in close() for
    etcd, so that the others hear of it, and stop too."""
    ms = members(etcd, 2)
    try:
        join_all(ms)
        ms[1].start_monitor()
        etcd.kill()
        ms[0].report_failure("crash loop", final=True)
        t, _ = in_thread(ms[0].close)
        time.sleep(2.0)
        assert t.is_alive()  # waiting for etcd
        etcd.restart()
        t.join(HANG)
        assert not t.is_alive()
        change = wait_change(ms[1])
        assert change.kind == CHANGE_FAILURE and "crash loop" in change.detail
        state, _ = ms[1].read_state()
        assert state is not None and state.final is True
    finally:
        close_all(ms)


def test_expired_lease_is_renewed_with_its_keys(etcd):
    """A member whose lease expired while etcd ran (cut off on its own for longer than
    the TTL; here: its lease revoked behind its back) takes a new lease and puts its
    liveness key and parked-spare count back under it; its own world is not broken."""
    ms = members(etcd, 2)
    other = kv_for(etcd)
    try:
        join_all(ms)
        ms[0].set_parked(2)
        old = ms[0].session.lease
        other.lease_revoke(old)
        deadline = time.monotonic() + HANG
        while ms[0].session.lease == old or ms[0].id not in ms[1].alive_members() or \
                ms[1].parked_counts().get(ms[0].id) != 2:
            assert time.monotonic() < deadline, "the lease was not renewed"
            time.sleep(0.1)
        assert ms[0].broken is None
        assert ms[0].check_world(ms[0].world) is None
    finally:
        other.close()
        close_all(ms)


@pytest.mark.slow
def test_a_frozen_c10d_host_loses_nobody(tmp_path):
    """The c10d store's host frozen (SIGSTOP: as a swapping or cut-off machine) for three
    lease TTLs: every member's requests block meanwhile and every heartbeat goes stale,
    but that is no evidence against anyone: once the host serves again nobody is counted
    lost and the world is unchanged; a real loss afterwards is still seen."""
    import sys

    from rendezvous.c10d import C10dKV
    from tests.etcd_server import free_port

    port = free_port()
    host = subprocess.Popen(
        [sys.executable, "-c", "import datetime, time\n"
         "from torch.distributed import TCPStore\n"
         f"s = TCPStore('127.0.0.1', {port}, is_master=True, wait_for_workers=False, "
         "timeout=datetime.timedelta(seconds=60))\n"
         "open(__import__('sys').argv[1], 'w').close()\n"
         "time.sleep(600)\n", str(tmp_path / "serving")],
        env={**os.environ, "TORCH_CPP_LOG_LEVEL": "FATAL"}, stdin=subprocess.DEVNULL)
    rid = f"job-{uuid.uuid4().hex[:8]}"
    ms: list[Membership] = []
    try:
        deadline = time.monotonic() + HANG
        while not (tmp_path / "serving").exists():
            assert time.monotonic() < deadline and host.poll() is None, "no TCPStore"
            time.sleep(0.1)
        ms = [Membership(C10dKV("127.0.0.1", port, is_host=False, timeout=10,
                                poll_interval=0.2),
                         "/tp-test", rid, 2, 2, f"127.0.0.{i + 1}", Timeouts(**FAST),
                         safety_poll=0.3) for i in range(2)]
        join_all(ms)
        for m in ms:
            m.start_monitor()
        # The resume comes from another process: a member blocked in list_keys holds
        # this process's GIL for as long as the host is stopped.
        resume = subprocess.Popen(["sh", "-c", f"sleep {3 * FAST['lease_ttl']}; "
                                   f"kill -CONT {host.pid}"], stdin=subprocess.DEVNULL)
        host.send_signal(signal.SIGSTOP)
        resume.wait()
        time.sleep(2 * FAST["lease_ttl"])
        assert [m.world_change() for m in ms] == [None, None]
        assert ms[0].alive_members() == {m.id for m in ms}
        crash(ms[1])
        change = wait_change(ms[0], timeout=30)
        assert change.kind == CHANGE_LOST and ms[1].id in change.detail
    finally:
        host.send_signal(signal.SIGCONT)
        close_all(ms)
        host.kill()
        host.wait()


def test_a_dead_c10d_host_is_not_waited_for(workdir):
    """c10d keeps its state in the hosting agent's memory: once that is gone nothing
    can come back, so its errors are refusals, not outages, and the members' worlds
    end as before (no waiting for outage_timeout)."""
    from rendezvous.c10d import C10dKV
    from tests.etcd_server import free_port

    port = free_port()
    host = C10dKV("127.0.0.1", port, is_host=True, timeout=10, poll_interval=0.2)
    rid = f"job-{uuid.uuid4().hex[:8]}"
    ms = [Membership(C10dKV("127.0.0.1", port, is_host=False, timeout=10, poll_interval=0.2),
                     "/tp-test", rid, 2, 2, f"127.0.0.{i + 1}", Timeouts(**FAST),
                     safety_poll=0.3) for i in range(2)]
    try:
        join_all(ms)
        for m in ms:
            m.start_monitor()
        host.close()
        for m in ms:
            change = wait_change(m, timeout=30)
            assert change.kind == CHANGE_LOST and "failed" in change.detail
        with pytest.raises(KVError) as info:
            ms[0].read_state()
        assert not isinstance(info.value, KVUnavailable)
    finally:
        close_all(ms)
        host.close()


# ---------------------------------------------------------------- real 2-node jobs


def first_pids(out: Path) -> dict[int, int]:
    """rank -> the pid that first trained it."""
    return {e[0][0]: pid for pid, e in entries(out).items() if e[0][1] == 0}


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("tp-run: error:")]


@pytest.mark.slow
# A 40 s outage is the same path as a 10 s one (both outlast the 3 s lease TTL, and the
# training ends during both), and a run with a rank failure rides out the outage too:
# the other combinations are in the matrix (pytest --matrix).
@pytest.mark.parametrize("outage", [10, pytest.param(40, marks=pytest.mark.matrix)])
@pytest.mark.parametrize("failure", [pytest.param(False, marks=pytest.mark.matrix), True],
                         ids=["no-failure", "rank-failure"])
@pytest.mark.parametrize("mode", ["compatible", "resilient"])
def test_job_rides_out_an_etcd_restart(workdir, test_env, reference, etcd, mode, failure,
                                       outage):
    """2 nodes x 2 ranks over etcd (lease TTL 3 s). Mid-run, etcd is SIGKILLed and
    restarted ``outage`` seconds later on the same port and data directory; training
    goes on meanwhile (and ends during the outage: the exit barrier waits for etcd).
    With ``failure``, rank 2 is SIGKILLed right after etcd: in resilient mode its
    node's spare takes it once the generation can be published (the survivors keep
    their processes); in compatible mode every node restarts its workers (counted,
    --max-restarts 1) once etcd is back. Every agent exits 0 and the result equals
    torchrun's failure-free run."""
    ride_out(workdir, test_env, reference, etcd, mode, failure, outage)


@pytest.mark.slow
def test_rank_failure_during_an_outage_longer_than_the_ranks_wait(workdir, test_env,
                                                                  reference, etcd):
    """Resilient, rank 2 SIGKILLed while etcd is down for 11 s: the other node's ranks
    wait for the new generation up to the worker's limit (TP_RUN_RECOVERY_WAIT_S, 60 s
    by default, shortened here to 4 s on both sides: the path is the same, the lease TTL
    is 3 s), then fail with an error, both at the same step. That is the outage's doing,
    not a crash loop: once etcd is back they are replaced too (by spares, one spawned
    anew), the state comes from rank 3, and the job ends with torchrun's result."""
    env = {**test_env, "TP_RUN_RECOVERY_WAIT_S": "4"}
    ride_out(workdir, env, reference, etcd, "resilient", True, 11, keep_pids=False)


def ride_out(workdir: Path, test_env: dict[str, str], reference: str, etcd: EtcdServer,
             mode: str, failure: bool, outage: float, keep_pids: bool = True) -> None:
    """The scenario of test_job_rides_out_an_etcd_restart; ``keep_pids``: the ranks that
    did not fail keep their processes (else only rank 2's node-mate, rank 3)."""
    resilient = mode == "resilient"
    args = ("--spares", "1") if resilient else ("--max-restarts", "1")
    script = ("--hold-at", "8", "--step-sleep", f"{outage / 20:g}")
    if not resilient:
        script += ("--no-resilient",)
    # LOGLEVEL=INFO: compatible mode's restarts are logged at INFO, as torchrun's.
    with node_job(workdir, {**test_env, "LOGLEVEL": "INFO"}, etcd) as (start, agents, out):
        for node in range(2):
            start(node, "--nnodes", "2", *args, script_args=script)
        _wait(lambda: all_held(out), "4 ranks train")
        if resilient:
            _wait(lambda: all(_parked(a) >= 1 for a in agents), "every node parks a spare")
        pids = first_pids(out)
        etcd.kill()
        down = time.monotonic()
        if failure:
            os.kill(pids[2], signal.SIGKILL)
        (out / "release").touch()
        time.sleep(max(0.0, down + outage - time.monotonic()))
        etcd.restart()
        results = exits(agents)
    for rc, err in results:
        assert rc == 0, err[-4000:]
        assert not error_lines(err), err[-4000:]
    final = finals(out)
    assert {r["checksum"] for r in final} == {reference}
    assert all(r["step"] == STEPS for r in final)
    errs = "".join(err for _, err in results)
    if resilient:
        for rank in range(4):
            if failure and rank == 2:
                assert final[2]["pid"] != pids[2]
            elif keep_pids or rank == 3:
                assert final[rank]["pid"] == pids[rank], (rank, final, pids)
        # Rank 2, alone or with ranks that gave up waiting for its generation.
        lines = [line for line in errs.splitlines() if line.startswith("tp-run: failure:")]
        assert any(re.match(r"tp-run: failure: rank\(s\) \[([0-9, ]*, )?2\b", line)
                   for line in lines) == failure, lines
    else:
        assert errs.count("will restart worker group") == (2 if failure else 0), errs[-4000:]
    assert "lease expired" not in errs


@pytest.mark.slow
# compatible: its restart's rendezvous gives up on the backend as a join does
# (test_join_gives_up_after_outage_timeout, in-process): in the matrix.
@pytest.mark.parametrize("mode", [pytest.param("compatible", marks=pytest.mark.matrix),
                                  "resilient"])
def test_rank_failure_while_etcd_stays_down_no_node_exits_0(workdir, test_env, etcd, mode):
    """2 nodes x 1 rank. etcd is SIGKILLed for good, then rank 1 is SIGKILLed: its
    recovery (resilient: the generation for its spare; compatible: the restart)
    needs etcd; so does the other node's, once its rank has given up on the dead
    peer (its wait for a generation shortened to 8 s: TP_RUN_RECOVERY_WAIT_S). After
    outage_timeout (15 s) each node stops with one error line and exits 1: no node takes
    a failure it could not recover for a success."""
    conf = RDZV_CONF + ",outage_timeout=15"
    args = ("--spares", "1") if mode == "resilient" else ("--max-restarts", "1")
    script = ("--hold-at", "8") + (() if mode == "resilient" else ("--no-resilient",))
    env = {**test_env, "TP_RUN_RECOVERY_WAIT_S": "8"}
    with node_job(workdir, env, etcd) as (start, agents, out):
        for node in range(2):
            start(node, "--nnodes", "2", "--nproc-per-node", "1", *args, conf=conf,
                  script_args=script)
        _wait(lambda: all((out / f"held_{r}").exists() for r in range(2)), "2 ranks train")
        if mode == "resilient":
            _wait(lambda: all(_parked(a) >= 1 for a in agents), "every node parks a spare")
        pids = first_pids(out)
        etcd.kill()
        os.kill(pids[1], signal.SIGKILL)
        (out / "release").touch()
        results = exits(agents)
    for rc, err in results:
        assert rc == 1, err[-4000:]
        lines = error_lines(err)
        assert len(lines) == 1 and "outage_timeout=15s" in lines[0], err[-4000:]


@pytest.mark.slow
def test_training_that_ends_while_etcd_stays_down(workdir, test_env, reference, etcd):
    """Resilient, etcd SIGKILLed for good mid-run and no failure: training goes on and
    ends; the exit barrier cannot be passed through etcd, so after outage_timeout each
    node lets its finished ranks exit (every rank took part in the last step) with one
    warning, and the job ends as a success with torchrun's result, instead of idling
    for ever."""
    conf = RDZV_CONF + ",outage_timeout=10"
    with node_job(workdir, test_env, etcd) as (start, agents, out):
        for node in range(2):
            start(node, "--nnodes", "2", "--spares", "1", conf=conf,
                  script_args=("--hold-at", "8", "--step-sleep", "0.2"))
        _wait(lambda: all_held(out), "4 ranks train")
        etcd.kill()
        (out / "release").touch()
        results = exits(agents)
    for rc, err in results:
        assert rc == 0, err[-4000:]
        assert "they exit without waiting for the other nodes" in err
    final = finals(out)
    assert {r["checksum"] for r in final} == {reference}
