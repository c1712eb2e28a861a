"""A loopback TCP proxy that passes a server's answers on a few bytes at a time: a tier that is up but
trickles (a saturated link, a server swapping), for the broken-tier benchmark. Requests pass at full speed."""

from __future__ import annotations

import socket
import threading
import time

CHUNK_BYTES = 8
CHUNK_DELAY_SECONDS = 0.05  # 160 bytes a second: an entry of a few kilobytes takes longer than op_timeout


class TrickleProxy:
    """Listens on a free loopback port (`port`) and connects each client to `target_port`."""

    def __init__(self, target_port: int, chunk: int = CHUNK_BYTES, delay: float = CHUNK_DELAY_SECONDS) -> None:
        self.target_port = target_port
        self.chunk = chunk
        self.delay = delay
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
                server = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                return
            threading.Thread(target=self._pump, args=(client, server, 65536, 0.0), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, self.chunk, self.delay), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, chunk: int, delay: float) -> None:
        try:
            while not self._closed.is_set() and (data := source.recv(chunk)):
                sink.sendall(data)
                if delay:
                    time.sleep(delay)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                end.close()

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
