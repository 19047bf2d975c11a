"""Serving from several processes (hosts) as one SPMD program.

`jax.distributed` joins the processes, so the mesh spans the devices of all of them, and every
process runs the same jitted step on its own devices. Only process 0, the leader, runs the HTTP
server and the scheduler. Before each device call its runner sends the call's host inputs (the
step's arrays, the large ones as their changes to the step before's; the page copies) to the
other processes, the followers, which replay the calls in the same order, as a multi-process
program requires.

The channel is a ZeroMQ ROUTER socket on the leader, bound to the coordinator's address at its
port + 1 (never to all interfaces), with one DEALER per follower. Messages are the typed frames
of `jaxserve.device_calls`, never pickle. With keys (`--distributed-key-dir`, made by
`jaxserve keys DIR --num-processes N`) the channel is CURVE-encrypted and
authenticated both ways: the leader admits only the listed followers' public keys, and a follower
talks only to the holder of process 0's key. Without keys (`--insecure-distributed`) anyone who
reaches the port could read the users' prompts and drive the followers.

A follower first sends a fingerprint of the engine it built (config, weights' shapes, mesh,
buckets); the leader refuses one that differs, naming the fields, rather than let it hang inside
a collective. A follower that goes away cannot be replaced: the step would wait for it forever.
The leader learns it at once (its connection closes; heartbeats catch a silent peer), fails
every request and exits. A follower whose leader goes away exits too.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import logging
import pathlib
import socket
import sys
import threading
import time
from collections.abc import Callable

import jax
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from jaxserve.config import EngineConfig, parse_mesh
from jaxserve.device_calls import (
    DeviceCall, Hello, Inbox, Outbox, ProtocolError, Refused, Stop, Welcome, differences)

log = logging.getLogger(__name__)

HEARTBEAT_MS = 1000            # ZMTP pings; a peer silent for HEARTBEAT_TIMEOUT_MS is dropped
HEARTBEAT_TIMEOUT_MS = 10_000
_HANDSHAKE_FAILURES = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                       | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
_EVENTS = zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILURES | zmq.EVENT_MONITOR_STOPPED
KEYS_HELP = "make them with `jaxserve keys DIR --num-processes N` and copy DIR to every host"


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
    """The channel's address: the coordinator's host (as an IP address) and its port + 1."""
    host, port = coordinator_address.rsplit(":", 1)
    return socket.gethostbyname(host.strip("[]")), int(port) + 1


# ---- keys ------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Keys:
    """CURVE keys (Z85 bytes): this process's pair, the leader's public key and the followers'."""

    public: bytes
    secret: bytes
    leader: bytes
    followers: dict[bytes, int]   # public key -> process id


def make_keys(directory: str | pathlib.Path, num_processes: int) -> list[pathlib.Path]:
    """A key pair per process: DIR/process-I.key (public) and DIR/process-I.key_secret."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    made = []
    for i in range(num_processes):
        public, secret = zmq.auth.create_certificates(directory, f"process-{i}")
        pathlib.Path(secret).chmod(0o600)
        made += [pathlib.Path(public), pathlib.Path(secret)]
    return made


def load_keys(directory: str | pathlib.Path, process_id: int, num_processes: int) -> Keys:
    """This process's key pair and the others' public keys from `directory`."""
    directory = pathlib.Path(directory)

    def read(name: str, secret: bool = False) -> tuple[bytes, bytes | None]:
        path = directory / name
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: {KEYS_HELP}")
        public, secret_key = zmq.auth.load_certificate(path)
        if secret and secret_key is None:
            raise ValueError(f"{path} holds no secret key: {KEYS_HELP}")
        return public, secret_key

    public, secret = read(f"process-{process_id}.key_secret", secret=True)
    followers = {read(f"process-{i}.key")[0]: i for i in range(1, num_processes)}
    return Keys(public, secret, read("process-0.key")[0], followers)


# ---- the leader ------------------------------------------------------------------------------

class Leader:
    """Process 0's side: sends every device call to the followers; `on_lost(message)` is called
    (from a watcher thread) when one goes away."""

    def __init__(self, address: tuple[str, int], num_followers: int, on_lost: Callable[[str], None],
                 keys: Keys | None):
        self.num_followers = num_followers
        self.on_lost = on_lost
        self.keys = keys
        self._context = zmq.Context()
        self._auth = None
        self._socket = self._context.socket(zmq.ROUTER)
        _set_common_options(self._socket)
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)   # a send to a gone follower raises, not drops
        self._socket.setsockopt(zmq.RCVHWM, 64)   # followers only say Hello: what else comes is never read
        if keys is not None:
            self._auth = ThreadAuthenticator(self._context, log=log.getChild("zap"))
            self._auth.start()
            self._auth.configure_curve_callback("*", _ListedKeys(keys.followers))
            self._socket.curve_server = True
            self._socket.curve_publickey, self._socket.curve_secretkey = keys.public, keys.secret
        self._monitor = self._socket.get_monitor_socket(_EVENTS)
        self._socket.bind(f"tcp://{address[0]}:{address[1]}")
        self._outbox = Outbox()
        self._followers: dict[int, bytes] = {}    # process id -> ZeroMQ routing id
        self._fds: dict[int, int] = {}            # connection fd -> process id
        self._closing = False
        self._watcher = threading.Thread(target=self._watch, daemon=True, name="jaxserve-followers")
        self._watcher.start()

    def wait_for_followers(self, timeout: float, fingerprint: dict[str, str]) -> None:
        """Admits every follower whose engine has `fingerprint`; raises on one that differs (it is
        told why), and TimeoutError unless all came within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        inboxes: dict[bytes, Inbox] = {}
        while len(self._followers) < self.num_followers:
            left_ms = max(0, int((deadline - time.monotonic()) * 1000))
            if not self._socket.poll(left_ms):
                raise TimeoutError(f"{len(self._followers)} of {self.num_followers} follower processes "
                                   f"connected within {timeout:.0f} s")
            frames = self._socket.recv_multipart(copy=False)
            routing_id = frames[0].bytes
            try:
                if len(frames) != 2:
                    raise ProtocolError(f"a message of {len(frames) - 1} frames")
                hello = inboxes.setdefault(routing_id, Inbox()).read(frames[1].bytes)
                process_id = self._admit(hello, frames[1], fingerprint)
            except ProtocolError as error:
                log.warning("refused a process on the control channel: %s", error)
                self._send(routing_id, Outbox().frame(Refused(str(error))))
                continue
            except EngineMismatchError as error:
                self._send(routing_id, Outbox().frame(Refused(str(error))))
                raise
            self._followers[process_id] = routing_id
            self._fds[frames[1].get(zmq.SRCFD)] = process_id
        welcome = self._outbox.frame(Welcome())
        for routing_id in self._followers.values():
            self._send(routing_id, welcome)
        log.info("all %d follower processes joined%s", self.num_followers,
                 " (CURVE-authenticated)" if self.keys else " (UNAUTHENTICATED channel)")

    def _admit(self, hello, frame: zmq.Frame, fingerprint: dict[str, str]) -> int:
        """The process id of a valid Hello; raises ProtocolError or EngineMismatchError."""
        if not isinstance(hello, Hello):
            raise ProtocolError(f"{type(hello).__name__} where a Hello was due")
        process_id = hello.process_id
        if not 1 <= process_id <= self.num_followers or process_id in self._followers:
            raise ProtocolError(f"process id {process_id} is not a free follower id in [1, {self.num_followers}]")
        if self.keys is not None:
            key = frame.get("User-Id").encode()   # the Z85 public key the CURVE handshake proved
            if self.keys.followers.get(key) != process_id:
                raise ProtocolError(f"process id {process_id} came with the key of process "
                                    f"{self.keys.followers.get(key)}")
        mismatch = differences(fingerprint, hello.fingerprint)
        if mismatch:
            raise EngineMismatchError(f"follower process {process_id} built another engine than process 0 "
                                      f"(process 0's != process {process_id}'s): {'; '.join(mismatch)}")
        return process_id

    def _watch(self) -> None:
        while True:
            try:
                event = recv_monitor_message(self._monitor)
            except zmq.ZMQError:
                return
            if event["event"] == zmq.EVENT_MONITOR_STOPPED:
                return
            if event["event"] & _HANDSHAKE_FAILURES:
                log.warning("refused a connection to the control channel: %s (not a listed key, or no CURVE)",
                            zmq.Event(event["event"]).name)
            elif event["event"] == zmq.EVENT_DISCONNECTED and event["value"] in self._fds and not self._closing:
                self.on_lost(f"follower process {self._fds[event['value']]} went away; no step can run without it")

    def send(self, call: DeviceCall) -> None:
        data = self._outbox.frame(call)
        for process_id, routing_id in self._followers.items():
            try:
                self._send(routing_id, data)
            except zmq.ZMQError as error:
                raise FollowerLostError(f"follower process {process_id}: {error}") from error

    def _send(self, routing_id: bytes, data: bytes) -> None:
        self._socket.send_multipart([routing_id, data])

    def close(self) -> None:
        """Tells the followers to exit."""
        self._closing = True
        try:
            self.send(Stop())
        except FollowerLostError:
            pass
        self._socket.disable_monitor()
        self._watcher.join(5)
        self._monitor.close(linger=0)
        self._socket.close(linger=2000)   # lets the Stop reach them
        if self._auth is not None:
            self._auth.stop()
        self._context.term()


class EngineMismatchError(RuntimeError):
    """A follower built an engine that differs from process 0's."""


class _ListedKeys:
    """The ZAP check: only the followers' public keys may connect."""

    def __init__(self, keys: dict[bytes, int]):
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


def _set_common_options(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.SNDHWM, 0)   # never drop a device call: every one must be replayed
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.LINGER, 0)


# ---- a follower ------------------------------------------------------------------------------

def follow(replay: Callable[[DeviceCall], None], address: tuple[str, int], process_id: int, timeout: float,
           fingerprint: dict[str, str], keys: Keys | None) -> int:
    """A follower's loop: joins the leader with `fingerprint`, then replays its device calls until
    told to stop (0); 1 if the leader refuses it, goes away, or fails the handshake."""
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    _set_common_options(sock)
    if keys is not None:
        sock.curve_serverkey = keys.leader
        sock.curve_publickey, sock.curve_secretkey = keys.public, keys.secret
    monitor = sock.get_monitor_socket(_EVENTS)
    sock.connect(f"tcp://{address[0]}:{address[1]}")
    sock.send(Outbox().frame(Hello(process_id, fingerprint)))
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)
    inbox, deadline = Inbox(), time.monotonic() + timeout
    joined = False

    def handle(message) -> int | None:   # an exit status, or None to go on
        nonlocal joined
        if isinstance(message, Refused):
            log.error("the leader refused this process: %s", message.reason)
            return 1
        if isinstance(message, Stop):
            return 0
        if isinstance(message, Welcome):
            joined = True
            log.info("process %d following the leader at %s:%d", process_id, *address)
        elif not joined:
            raise ProtocolError(f"{type(message).__name__} before the leader's Welcome")
        else:
            replay(message)
        return None

    try:
        while True:
            wait_ms = None if joined else max(0, int((deadline - time.monotonic()) * 1000))
            ready = dict(poller.poll(wait_ms))
            if not ready:
                raise TimeoutError(f"the leader at {address[0]}:{address[1]} did not admit this process within "
                                   f"{timeout:.0f} s")
            if sock in ready:
                try:
                    status = handle(inbox.read(sock.recv()))
                except ProtocolError as error:   # never acted on: this process cannot follow any more
                    log.error("the leader's channel sent what this process cannot follow: %s", error)
                    return 1
            else:
                status = _leader_event(recv_monitor_message(monitor), address, keys)
                while status == 1 and sock.poll(0):   # first what the leader sent before it went: its Stop
                    status = handle(inbox.read(sock.recv())) or 1
            if status is not None:
                return status
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)
        context.term()


def _leader_event(event: dict, address: tuple[str, int], keys: Keys | None) -> int | None:
    """A follower's exit status for a monitor event on its connection to the leader (None: go on)."""
    if event["event"] & _HANDSHAKE_FAILURES:
        log.error("the control channel to %s:%d failed its handshake (%s): %s", *address,
                  zmq.Event(event["event"]).name,
                  "the leader lacks process-0's key, or this process's key is not listed" if keys
                  else "the leader may want CURVE keys (--distributed-key-dir)")
        return 1
    if event["event"] == zmq.EVENT_DISCONNECTED:
        log.error("the leader (process 0) went away; exiting")
        return 1
    return None


# ---- the fingerprint -------------------------------------------------------------------------

_HOST_FIELDS = ("process_id", "model", "distributed_key_dir")   # may differ from host to host


def fingerprint(config: EngineConfig, params, buckets, kv_shape, values_digest: str) -> dict[str, str]:
    """What every process must agree on: the config (but for host-local fields), the weights'
    shapes and dtypes and a sample of their values (`values_digest`: loader.sampled_digest), the
    compiled buckets and the KV pool's shape."""
    fields = {f"config.{f.name}": repr(getattr(config, f.name)) for f in dataclasses.fields(config)
              if f.name not in _HOST_FIELDS}
    shapes = [(jax.tree_util.keystr(path), leaf.shape, str(leaf.dtype))
              for path, leaf in jax.tree_util.tree_leaves_with_path(params)]
    weights = hashlib.sha256(repr(shapes).encode()).hexdigest()[:16]
    return {**fields, "weights": f"{len(shapes)} arrays, digest {weights}, values {values_digest or 'not sampled'}",
            "buckets": repr(list(buckets)),
            "kv_pages": repr(tuple(kv_shape))}


def main(argv: list[str] | None = None, prog: str = "python -m jaxserve.distributed") -> int:
    parser = argparse.ArgumentParser(prog=prog,
                                     description="Tools for serving from several processes.")
    commands = parser.add_subparsers(dest="command", required=True)
    keys = commands.add_parser("keys", help="make a CURVE key pair per process for --distributed-key-dir")
    keys.add_argument("directory")
    keys.add_argument("--num-processes", type=int, required=True)
    args = parser.parse_args(argv)
    if args.num_processes < 2:
        parser.error(f"--num-processes={args.num_processes} must be >= 2")
    for path in make_keys(args.directory, args.num_processes):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
