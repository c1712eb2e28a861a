"""A loopback TCP proxy in front of a Redis that passes the server's replies on a few bytes at a time: a tier
that is up but trickles (a saturated link, a server swapping). Requests pass at once; every socket read of a
reply gets data well within the socket timeout, so only a deadline on the whole operation ends it. Used by
the broken-tier benchmark and the hostile-tier tests."""

from __future__ import annotations

import contextlib
import socket
import threading
import time


class TrickleProxy:
    """Listens on a free loopback port (`url`) and connects each client to `upstream`; while `slow`, every reply
    is passed on `chunk` bytes every `interval` seconds."""

    def __init__(self, upstream: tuple[str, int], chunk: int = 64, interval: float = 0.1, slow: bool = False):
        self.upstream, self.chunk, self.interval = upstream, chunk, interval
        self.slow = slow
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"redis://127.0.0.1:{self.listener.getsockname()[1]}/0"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                downstream, _ = self.listener.accept()
            except OSError:
                return  # closed
            upstream = socket.create_connection(self.upstream)
            threading.Thread(target=self._pump, args=(downstream, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, downstream, True), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, replies: bool) -> None:
        try:
            while data := source.recv(65536):
                while data:
                    if replies and self.slow:
                        time.sleep(self.interval)
                        piece, data = data[: self.chunk], data[self.chunk :]
                    else:
                        piece, data = data, b""
                    sink.sendall(piece)
        except OSError:
            pass
        finally:  # one side closed: close both, so the other pump ends too
            for end in (source, sink):
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)
                end.close()

    def close(self) -> None:
        self.listener.close()
