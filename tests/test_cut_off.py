"""rendezvous.lease.LeaseSession.cut_off_at: when a member knew itself cut off.

A cut network makes etcd requests hang, not fail: the keep-alive thread is blocked in a
request. Real threads and a short TTL (1.2 s, keep-alive every 0.1 s) over the in-memory
KV, whose keep-alive is made to hang as a cut link would.
"""

from __future__ import annotations

import threading
import time

from rendezvous.lease import LeaseSession
from tests.memkv import MemKV, MemStore

TTL, INTERVAL = 1.2, 0.1


class CutKV(MemKV):
    """A client whose keep-alives hang while ``cut`` is set."""

    def __init__(self, store: MemStore) -> None:
        super().__init__(store)
        self.link_up = threading.Event()
        self.link_up.set()

    def lease_keepalive(self, lease):
        self.link_up.wait()
        return super().lease_keepalive(lease)


def test_a_hanging_keep_alive_counts_as_cut_off_and_its_late_answer_too():
    kv = CutKV(MemStore())
    session = LeaseSession(kv, TTL, INTERVAL, 3, 60.0, lambda: None)
    session.put("alive/me", "1")
    try:
        time.sleep(3 * INTERVAL)
        assert session.cut_off_at() < 0  # answered every time: never cut off
        kv.link_up.clear()
        cut = time.monotonic()
        time.sleep(TTL - INTERVAL - 0.4)
        assert session.cut_off_at() < 0  # not overdue yet: another lease cannot be gone
        time.sleep(0.6)
        assert session.cut_off_at() >= cut  # overdue: others' leases may have expired
        kv.link_up.set()
        back = time.monotonic()
        time.sleep(3 * INTERVAL)
        # The late answer is remembered: the grace counts from it, not from now.
        at = session.cut_off_at()
        assert back - 0.05 <= at <= back + 1.0  # (slack for a loaded machine)
        time.sleep(2 * INTERVAL)
        assert session.cut_off_at() == at
    finally:
        session.stop()
        kv.link_up.set()
