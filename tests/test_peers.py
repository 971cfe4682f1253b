"""tp_launch.resilient.peers: a thread blocked on a connection to a lost node is released.

Real sockets in this process (no peer process: the peer is a listening socket that
never answers, as a vanished host's would be from the blocked side's point of view).
"""

from __future__ import annotations

import socket
import threading

from tp_launch.resilient.peers import shut_connections_to


def _pair(addr: str) -> tuple[socket.socket, socket.socket, socket.socket]:
    """(listener, the client's end, the server's end) of a connection to ``addr``."""
    listener = socket.socket()
    listener.bind((addr, 0))
    listener.listen()
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    return listener, client, server


def test_a_blocked_receive_on_a_lost_peer_ends_and_others_stay():
    lost = _pair("127.0.0.3")
    kept = _pair("127.0.0.4")
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(lost[1].recv(10)), daemon=True)
    reader.start()
    reader.join(0.3)
    assert reader.is_alive()  # blocked: the peer sends nothing, closes nothing
    try:
        assert shut_connections_to(["127.0.0.3"]) == 1
        reader.join(5)
        assert not reader.is_alive() and got == [b""]  # the end of the stream
        # The owner's descriptor is still valid (a duplicate was shut), and the
        # connection to another address is untouched.
        assert lost[1].fileno() >= 0
        kept[1].sendall(b"x")
        assert kept[2].recv(1) == b"x"
        assert shut_connections_to(["no-such-host.invalid"]) == 0
    finally:
        for s in (*lost, *kept):
            s.close()
