"""The KV interface's declared parts (rendezvous.kv), without a backend process."""

from __future__ import annotations

from typing import Any, Callable

import pytest

from rendezvous.kv import KV, CountingKV

pytestmark = pytest.mark.unit


class _Stub(KV):
    """Only what the interface itself answers; every request is an error."""

    def __init__(self, hosting: bool | None = None) -> None:
        self._hosting = hosting

    @property
    def hosting(self) -> bool:
        return super().hosting if self._hosting is None else self._hosting

    def get(self, key: str) -> tuple[str | None, Any]:
        raise AssertionError

    def cas(self, key: str, version: Any, value: str) -> bool:
        raise AssertionError

    def put(self, key: str, value: str, lease: Any = None) -> None:
        raise AssertionError

    def get_prefix(self, prefix: str) -> dict[str, str]:
        raise AssertionError

    def lease_grant(self, ttl: float) -> Any:
        raise AssertionError

    def lease_keepalive(self, lease: Any) -> bool:
        raise AssertionError

    def lease_revoke(self, lease: Any) -> None:
        raise AssertionError

    def watch_prefix(self, prefix: str, callback: Callable[[], None]) -> Callable[[], None]:
        raise AssertionError

    def close(self) -> None:
        pass


def test_hosting_is_declared_and_forwarded():
    assert _Stub().hosting is False  # a separate service (etcd) by default
    assert CountingKV(_Stub(hosting=True)).hosting is True
    assert CountingKV(_Stub()).hosting is False
