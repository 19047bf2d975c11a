"""Serving from several processes (hosts) as one SPMD program.

`jax.distributed` joins the processes, so the mesh spans the devices of all of them, and every
process runs the same jitted step on its own devices. Only process 0, the leader, runs the HTTP
server and the scheduler. Before each device call its runner sends the call's host inputs (the
step's arrays, the page copies) to the other processes, the followers, over one TCP connection
each, at the coordinator's host and port + 1; each follower replays the calls in the same order,
as a multi-process program requires.

A follower that goes away cannot be replaced: the step would wait for it forever inside a
collective. The leader learns it at once (its connection closes), fails every request and exits.
A follower whose leader goes away exits too. Messages are pickled: the processes trust each other
(one deployment, one private network), as they already do by running one program together.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import socket
import struct
import threading
import time
from collections.abc import Callable

import jax

from jaxserve.config import EngineConfig, parse_mesh

log = logging.getLogger(__name__)

_HEADER = struct.Struct("!Q")   # message length
STOP = ("stop",)


class FollowerLostError(RuntimeError):
    """A follower process went away: no step can run any more."""


def initialize(config: EngineConfig) -> None:
    """Joins this process to the others (before JAX's backend starts). On CPU hosts, each process
    gets its share of the mesh as host devices, and collectives go over gloo."""
    data, model = parse_mesh(config.mesh)
    if jax.config.jax_platforms in (None, "", "cpu"):
        jax.config.update("jax_num_cpu_devices", data * model // config.num_processes)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(config.coordinator_address, config.num_processes, config.process_id)
    log.info("process %d of %d: %d local devices of %d (%s)", jax.process_index(), jax.process_count(),
             jax.local_device_count(), jax.device_count(), jax.default_backend())


def control_address(coordinator_address: str) -> tuple[str, int]:
    host, port = coordinator_address.rsplit(":", 1)
    return host, int(port) + 1


class Leader:
    """Process 0's side: sends every device call to the followers; `on_lost(message)` is called
    (from a watcher thread) when one goes away."""

    def __init__(self, address: tuple[str, int], num_followers: int, on_lost: Callable[[str], None]):
        self.num_followers = num_followers
        self.on_lost = on_lost
        self._server = socket.create_server(address)
        self._followers: list[tuple[int, socket.socket]] = []
        self._closing = False

    def wait_for_followers(self, timeout: float) -> None:
        """Accepts every follower (each says its process id), then watches their connections."""
        self._server.settimeout(timeout)
        while len(self._followers) < self.num_followers:
            try:
                connection, _ = self._server.accept()
            except TimeoutError as error:
                raise TimeoutError(f"{len(self._followers)} of {self.num_followers} follower processes "
                                   f"connected within {timeout:.0f} s") from error
            connection.settimeout(None)
            process_id = _HEADER.unpack(_receive_exactly(connection, _HEADER.size))[0]
            self._followers.append((process_id, connection))
            threading.Thread(target=self._watch, args=(process_id, connection), daemon=True,
                             name=f"jaxserve-follower-{process_id}").start()
        self._server.close()
        log.info("all %d follower processes connected", self.num_followers)

    def _watch(self, process_id: int, connection: socket.socket) -> None:
        try:
            closed = connection.recv(1) == b""   # followers never send: any return means it is gone
        except OSError:
            closed = True
        if closed and not self._closing:
            self.on_lost(f"follower process {process_id} went away; no step can run without it")

    def send(self, message: tuple) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for process_id, connection in self._followers:
            try:
                connection.sendall(_HEADER.pack(len(data)) + data)
            except OSError as error:
                raise FollowerLostError(f"follower process {process_id}: {error}") from error

    def close(self) -> None:
        """Tells the followers to exit."""
        self._closing = True
        try:
            self.send(STOP)
        except FollowerLostError:
            pass
        for _, connection in self._followers:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)   # wakes the watcher blocked on it
            connection.close()


def follow(replay: Callable[[tuple], None], address: tuple[str, int], process_id: int,
           timeout: float) -> int:
    """A follower's loop: replays the leader's device calls until told to stop (0) or the leader
    goes away (1)."""
    connection = _connect(address, timeout)
    connection.sendall(_HEADER.pack(process_id))
    log.info("process %d following the leader at %s:%d", process_id, *address)
    while True:
        try:
            size = _HEADER.unpack(_receive_exactly(connection, _HEADER.size))[0]
            message = pickle.loads(_receive_exactly(connection, size))
        except ConnectionError:
            log.error("the leader (process 0) went away; exiting")
            return 1
        if message == STOP:
            return 0
        replay(message)


def _connect(address: tuple[str, int], timeout: float) -> socket.socket:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return socket.create_connection(address, timeout=None)
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the leader at {address[0]}:{address[1]} did not answer within {timeout:.0f} s")
            time.sleep(0.5)


def _receive_exactly(connection: socket.socket, size: int) -> bytes:
    parts, left = [], size
    while left:
        part = connection.recv(min(left, 1 << 20))
        if not part:
            raise ConnectionError("connection closed")
        parts.append(part)
        left -= len(part)
    return b"".join(parts)
