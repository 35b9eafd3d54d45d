"""Socket set-up shared by the broker, the producer's publisher and the consumer SDK (no domain logic).

Endpoints. A broker has three endpoints: ``producers`` (ROUTER; publishers' DEALERs connect), ``consumers``
(ROUTER; consumers' DEALERs connect) and ``stats`` (REP). A broker *address* names all three:

- a directory path (a run dir) -> ``ipc://DIR/producers.sock``, ``.../consumers.sock``, ``.../stats.sock``;
- ``ipc://DIR/producers.sock`` (or ``consumers.sock`` / ``stats.sock``) -> the three sockets of DIR;
- ``tcp://HOST:PORT`` -> producers on PORT, consumers on PORT+1, stats on PORT+2 (CURVE required).

``MIA_STREAM_BROKER`` holds the address producers and consumers use when none is given; without it the
default run dir is ``$MIA_STREAM_RUN_DIR`` or ``/tmp/mia_stream-$UID`` (created 0700; socket files 0600).

CURVE. ``mia-stream keys DIR`` writes a key dir with roles (docs/security.md)::

    DIR/broker.key, DIR/broker.key_secret      the broker's pair (peers need only broker.key)
    DIR/clients/NAME.key, NAME.key_secret      one pair per client (default: producer, consumer, analyzer)
    DIR/roles/producers/NAME.key               may connect to the producers endpoint and publish streams
    DIR/roles/consumers/NAME.key               may connect to the consumers and stats endpoints and subscribe
    DIR/roles/analyzers/NAME.key               may publish ``analysis`` (producers endpoint) and subscribe
    DIR/steer/NAME.key                         may send steering commands (consumers endpoint)
    DIR/authorized/NAME.key                    every client above (what a broker without roles reads)

A key dir without ``roles/`` (``mia-stream keys --clients ...``, or one made before roles) keeps its meaning: every
key in ``authorized/`` may connect to every endpoint and publish any kind (``analysis`` included); only steering
takes a key in ``steer/``.

``MIA_STREAM_KEYS`` (a key dir) and ``MIA_STREAM_KEY_NAME`` (a client name) are the defaults of peers.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import zmq

from mia_stream import settings
from mia_stream.errors import TransportError

ENV_BROKER = "MIA_STREAM_BROKER"
ENV_RUN_DIR = "MIA_STREAM_RUN_DIR"
ENV_KEYS = "MIA_STREAM_KEYS"
ENV_KEY_NAME = "MIA_STREAM_KEY_NAME"
_ROLES = ("producers", "consumers", "stats")
_MAX_IPC_PATH = 100  # sun_path is 108 bytes on Linux; keep a margin

ZAP_DOMAIN = "mia_stream"  # one domain for every endpoint (a key dir without roles)
ROLES = ("producers", "consumers", "analyzers")  # key dirs under DIR/roles/ (steering: DIR/steer/)
# with roles, each endpoint has its own ZAP domain, and these roles' keys may connect to it
ENDPOINT_ROLES = {"producers": ("producers", "analyzers"), "consumers": ("consumers", "analyzers", "steer"),
                  "stats": ("producers", "consumers", "analyzers", "steer")}
HEARTBEAT_S = 0.5  # application heartbeat interval of every peer
RECONNECT_IVL_MS = 100
RECONNECT_IVL_MAX_MS = 1000
TCP_KEEPALIVE_IDLE_S, TCP_KEEPALIVE_INTVL_S, TCP_KEEPALIVE_CNT = 5, 1, 3  # a dead tcp peer is noticed in ~8 s


# ---------------------------------------------------------------------------------------------- endpoints

@dataclass(frozen=True)
class BrokerEndpoints:
    producers: str
    consumers: str
    stats: str

    @property
    def is_tcp(self) -> bool:
        return any(e.startswith("tcp://") for e in (self.producers, self.consumers, self.stats))


def default_run_dir() -> Path:
    """``$MIA_STREAM_RUN_DIR`` or ``/tmp/mia_stream-$UID``, created with mode 0700."""
    path = settings.get_path(ENV_RUN_DIR) or Path(f"/tmp/mia_stream-{os.getuid()}")
    return ensure_run_dir(path)


def ensure_run_dir(path: str | os.PathLike) -> Path:
    path = Path(path)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid():
        raise TransportError(f"run dir {path} belongs to uid {st.st_uid}, not to this user; refusing to use it")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(path, 0o700)
    return path


def endpoints_for(address: str | os.PathLike | None = None) -> BrokerEndpoints:
    """The three endpoints of a broker address (see the module docstring); None = env / default."""
    if address is None:
        address = settings.get_address(ENV_BROKER) or str(default_run_dir())
    address = str(address)
    if address.startswith("tcp://"):
        host, _, port = address[len("tcp://"):].rpartition(":")
        try:
            base = int(port)
        except ValueError:
            raise TransportError(f"tcp broker address needs a numeric port: {address!r}") from None
        return BrokerEndpoints(*(f"tcp://{host}:{base + i}" for i in range(3)))
    if address.startswith("ipc://"):
        path = Path(address[len("ipc://"):])
        run_dir = path.parent if path.name in {f"{r}.sock" for r in _ROLES} else path
    elif "://" in address:
        raise TransportError(f"unsupported broker address {address!r}: use a run dir, ipc:// or tcp://")
    else:
        run_dir = Path(address)
    eps = BrokerEndpoints(*(f"ipc://{run_dir / (r + '.sock')}" for r in _ROLES))
    for ep in (eps.producers, eps.consumers, eps.stats):
        if len(ep) - len("ipc://") > _MAX_IPC_PATH:
            raise TransportError(f"ipc path too long for a unix socket ({len(ep)} chars): {ep}; use a shorter run dir")
    return eps


def ipc_path(endpoint: str) -> Path | None:
    return Path(endpoint[len("ipc://"):]) if endpoint.startswith("ipc://") else None


# ---------------------------------------------------------------------------------------------- CURVE keys

@dataclass(frozen=True)
class ServerKeys:
    """The broker's CURVE pair and who may connect / steer (z85 public keys)."""

    public: bytes
    secret: bytes
    authorized_dir: Path
    steer_public_keys: frozenset[bytes]
    # role ("producers", "consumers", "analyzers", "steer") -> its z85 public keys; None: no roles (one allow-list)
    roles: dict[str, frozenset[bytes]] | None = None
    names: dict[bytes, str] | None = None  # z85 public key -> its file's name (e.g. stamped on analysis messages)

    def ids(self, role: str) -> set[str] | None:
        """The CURVE User-Ids (z85 strs) of a role; None without roles (every authorised key has every role)."""
        if self.roles is None:
            return None
        return {k.decode("ascii") for k in self.roles.get(role, ())}

    def zap_domain(self, endpoint_role: str) -> str:
        return ZAP_DOMAIN if self.roles is None else f"{ZAP_DOMAIN}.{endpoint_role}"


@dataclass(frozen=True)
class ClientKeys:
    public: bytes
    secret: bytes
    server_public: bytes


def _read_key(path: Path, secret: bool) -> bytes:
    import zmq.auth

    try:
        public, secret_key = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as e:
        raise TransportError(f"cannot read CURVE key {path}: {e}") from None
    if secret and not secret_key:
        raise TransportError(f"{path} holds no secret key")
    return secret_key if secret else public


def load_server_keys(key_dir: str | os.PathLike) -> ServerKeys:
    d = Path(key_dir)
    public = _read_key(d / "broker.key_secret", secret=False)
    secret = _read_key(d / "broker.key_secret", secret=True)
    authorized = d / "authorized"
    if not authorized.is_dir():
        raise TransportError(f"key dir {d} has no authorized/ dir of client public keys")
    names: dict[bytes, str] = {}

    def keys_in(sub: Path) -> frozenset[bytes]:
        out = set()
        for p in sorted(sub.glob("*.key")):
            key = _read_key(p, secret=False)
            names.setdefault(key, p.stem)
            out.add(key)
        return frozenset(out)

    steer = keys_in(d / "steer")
    roles = None
    if (d / "roles").is_dir():
        roles = {role: keys_in(d / "roles" / role) for role in ROLES}
        roles["steer"] = steer
    return ServerKeys(public, secret, authorized, steer, roles, names)


def load_client_keys(key_dir: str | os.PathLike, name: str | None = None) -> ClientKeys:
    d = Path(key_dir)
    name = name or settings.get_text(ENV_KEY_NAME) or "consumer"
    secret_file = d / "clients" / f"{name}.key_secret"
    return ClientKeys(_read_key(secret_file, False), _read_key(secret_file, True),
                      _read_key(d / "broker.key", secret=False))


def resolve_client_keys(keys: Any, default_name: str) -> ClientKeys | None:
    """``keys`` may be ClientKeys, a key dir, or None (then ``$MIA_STREAM_KEYS`` if set)."""
    if isinstance(keys, ClientKeys):
        return keys
    if keys is None:
        keys = settings.get_path(ENV_KEYS)
        if not keys:
            return None
    return load_client_keys(keys, settings.get_text(ENV_KEY_NAME) or default_name)


def create_keys(key_dir: str | os.PathLike, clients=("producer", "consumer"), steer=("consumer",),
                roles: dict[str, Sequence[str]] | None = None) -> Path:
    """Create a key dir (see the module docstring); existing keys are overwritten. ``roles``: role -> client
    names (a dir with roles; ``clients`` is then every name in them); None: every client may connect anywhere."""
    import zmq.auth

    d = Path(key_dir)
    if roles is not None:
        clients = list(dict.fromkeys(n for names in roles.values() for n in names))
    for sub in ("", "clients", "authorized", "steer", *((f"roles/{r}" for r in ROLES) if roles is not None else ())):
        (d / sub).mkdir(mode=0o700, parents=True, exist_ok=True)
    zmq.auth.create_certificates(str(d), "broker")
    for name in clients:
        zmq.auth.create_certificates(str(d / "clients"), name)
        shutil.copy(d / "clients" / f"{name}.key", d / "authorized" / f"{name}.key")
        if name in steer:
            shutil.copy(d / "clients" / f"{name}.key", d / "steer" / f"{name}.key")
        for role, names in (roles or {}).items():
            if name in names and role in ROLES:
                shutil.copy(d / "clients" / f"{name}.key", d / "roles" / role / f"{name}.key")
    for p in d.rglob("*.key_secret"):
        os.chmod(p, 0o600)
    return d


def keys_main(argv: list[str]) -> int:
    """``mia-stream keys DIR``: create the broker's and clients' CURVE key pairs for tcp endpoints."""
    ap = argparse.ArgumentParser(prog="mia-stream keys", description=keys_main.__doc__)
    ap.add_argument("dir", help="key dir to create")
    ap.add_argument("--producers", default="producer", help="comma-separated clients that may publish streams")
    ap.add_argument("--consumers", default="consumer", help="comma-separated clients that may subscribe")
    ap.add_argument("--analyzers", default="analyzer",
                    help="comma-separated clients that may publish analysis messages (and subscribe)")
    ap.add_argument("--steer", default="consumer", help="comma-separated clients allowed to steer")
    ap.add_argument("--clients", default=None,
                    help="without roles (the layout before roles): comma-separated clients, each of which may "
                         "connect to every endpoint and publish anything; only --steer clients may steer")
    args = ap.parse_args(argv)
    names = lambda text: [c for c in text.split(",") if c]  # noqa: E731
    steer = names(args.steer)
    if args.clients is not None:
        clients = names(args.clients)
        unknown = set(steer) - set(clients)
        if unknown:
            ap.error(f"--steer names clients not in --clients: {sorted(unknown)}")
        d = create_keys(args.dir, clients, steer)
        print(f"wrote CURVE keys to {d}: broker, clients {clients} (no roles), steering allowed for {steer}")
        return 0
    roles = {"producers": names(args.producers), "consumers": names(args.consumers),
             "analyzers": names(args.analyzers)}
    d = create_keys(args.dir, steer=steer, roles={**roles, "steer": steer})
    print(f"wrote CURVE keys to {d}: broker; " + "; ".join(f"{r}: {v}" for r, v in roles.items())
          + f"; steering: {steer}")
    return 0


class _RoleKeys:
    """ZAP credentials of one endpoint with roles: the keys of the roles that may connect there."""

    def __init__(self, allowed: frozenset[bytes]):
        self.allowed = allowed

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.allowed


def start_authenticator(ctx: zmq.Context, keys: ServerKeys):
    """A ZAP handler on ``ctx``: without roles it admits every CURVE client whose public key is in
    ``authorized/``; with roles, each endpoint (its own ZAP domain) only the roles of ``ENDPOINT_ROLES``."""
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(ctx)
    auth.start()
    if keys.roles is None:
        auth.configure_curve(domain=ZAP_DOMAIN, location=str(keys.authorized_dir))
        return auth
    for endpoint, roles in ENDPOINT_ROLES.items():
        allowed = frozenset(k for r in roles for k in keys.roles.get(r, ()))
        auth.configure_curve_callback(domain=keys.zap_domain(endpoint), credentials_provider=_RoleKeys(allowed))
    return auth


# ---------------------------------------------------------------------------------------------- sockets

def configure(sock: zmq.Socket, *, sndhwm: int = 1000, rcvhwm: int = 1000, max_message_bytes: int | None = None,
              router_mandatory: bool = False, immediate: bool = False) -> None:
    """Options every bus socket gets: no linger, bounded HWMs, quick reconnects, TCP keepalive.

    No ZMTP heartbeats (``ZMQ_HEARTBEAT_IVL``): in libzmq 4.3.x their timer can run the engine's output path
    after an I/O error and abort the whole process (``Assertion failed: !_io_error
    (stream_engine_base.cpp:310)``, libzmq issues 3937 and 4364). That killed a vLLM engine under
    back-pressure on the H200. Dead peers are found by the application heartbeats (``HEARTBEAT_S``) and, on
    tcp, half-open connections by the kernel's keepalive, which lets zmq reconnect.
    """
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, sndhwm)
    sock.setsockopt(zmq.RCVHWM, rcvhwm)
    sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
    sock.setsockopt(zmq.HEARTBEAT_IVL, 0)
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, TCP_KEEPALIVE_IDLE_S)
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, TCP_KEEPALIVE_INTVL_S)
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, TCP_KEEPALIVE_CNT)
    if max_message_bytes:
        sock.setsockopt(zmq.MAXMSGSIZE, int(max_message_bytes))
    if router_mandatory:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    if immediate:
        sock.setsockopt(zmq.IMMEDIATE, 1)


def require_curve_for_tcp(endpoint: str, has_keys: bool, side: str) -> None:
    if endpoint.startswith("tcp://") and not has_keys:
        raise TransportError(
            f"refusing to {side} {endpoint} without CURVE keys: tcp endpoints must be encrypted and "
            f"authenticated (create keys with `mia-stream keys DIR`, pass them or set {ENV_KEYS})")


def bind(sock: zmq.Socket, endpoint: str, keys: ServerKeys | None, role: str = "") -> None:
    """Bind as a CURVE server when ``keys`` are given (``role``: which endpoint, "producers" | "consumers" |
    "stats": its ZAP domain when the keys have roles); tcp without keys is refused; ipc files get 0600."""
    require_curve_for_tcp(endpoint, keys is not None, "bind")
    if keys is not None:
        sock.curve_server = True
        sock.curve_publickey = keys.public
        sock.curve_secretkey = keys.secret
        sock.zap_domain = (keys.zap_domain(role) if role else ZAP_DOMAIN).encode()
    path = ipc_path(endpoint)
    if path is not None:
        ensure_run_dir(path.parent)
        if path.exists() or path.is_symlink():
            if _listening(path):  # unlinking a live broker's socket would split the bus silently
                raise TransportError(f"cannot bind {endpoint}: address in use (a live broker listens there; "
                                     "stop it first or choose another run dir)")
            path.unlink()  # a stale socket of a dead broker
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as e:
        raise TransportError(f"cannot bind {endpoint}: {e}") from None
    if path is not None:
        os.chmod(path, 0o600)


def _listening(path: Path) -> bool:
    """Whether a process accepts connections on the unix socket ``path`` (ECONNREFUSED: a stale file)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        probe.close()


def connect(sock: zmq.Socket, endpoint: str, keys: ClientKeys | None) -> None:
    """Connect as a CURVE client when ``keys`` are given; tcp without keys is refused."""
    require_curve_for_tcp(endpoint, keys is not None, "connect to")
    if keys is not None:
        sock.curve_serverkey = keys.server_public
        sock.curve_publickey = keys.public
        sock.curve_secretkey = keys.secret
    try:
        sock.connect(endpoint)
    except zmq.ZMQError as e:
        raise TransportError(f"cannot connect to {endpoint}: {e}") from None


def frames_nbytes(frames: list) -> int:
    """Total bytes of a multipart message (bytes, zmq.Frame or any buffer)."""
    total = 0
    for f in frames:
        total += len(f) if isinstance(f, (bytes, zmq.Frame)) else memoryview(f).nbytes
    return total


# ---------------------------------------------------------------------------------------------- hot path
# The hot paths call the Cython socket methods directly with int flags: pyzmq's send_multipart /
# recv_multipart wrappers (per-part type checks, enum flag arithmetic, a getsockopt(RCVMORE) per part)
# cost 2-4x more per message than libzmq itself.
NOBLOCK, SNDMORE = int(zmq.NOBLOCK), int(zmq.SNDMORE)
zsend, zrecv = zmq.backend.Socket.send, zmq.backend.Socket.recv


def recv_parts(sock: zmq.Socket) -> list:
    """One multipart message as zmq.Frames, NOBLOCK (raises zmq.Again when there is none)."""
    f = zrecv(sock, NOBLOCK, False)
    parts = [f]
    while f.more:
        f = zrecv(sock, NOBLOCK, False)
        parts.append(f)
    return parts


BATCH_MESSAGES = 64  # a sender's batch holds at most this many messages ...
BATCH_BYTES = 1 << 20  # ... and this many bytes; a message of this size or more goes alone


def batch_span(queue, max_messages: int, room: int | None = None) -> tuple[int, int]:
    """(count, bytes) of the messages at the front of ``queue`` (items ``(frames, nbytes, ...)``) that go as one
    zmq message: at most ``max_messages`` and ``BATCH_BYTES``; ``room`` (a credit window's free bytes): no
    further message is added once the ones taken fill it."""
    total, count = queue[0][1], 1
    if total < BATCH_BYTES:
        limit = min(len(queue), max_messages)
        while count < limit:
            n = queue[count][1]
            if total + n > BATCH_BYTES or (room is not None and total >= room):
                break
            total += n
            count += 1
    return count, total


def send_frame_lists(sock: zmq.Socket, head: list, frame_lists: list) -> None:
    """``head`` then every frame of every list in ``frame_lists`` as one multipart message, NOBLOCK,
    zero-copy (a batch: the caller puts its envelope in ``head``). zmq takes or refuses (``zmq.Again``) the
    whole message at its first part."""
    more = NOBLOCK | SNDMORE
    for f in head:
        zsend(sock, f, more, False)
    last_list = len(frame_lists) - 1
    for i, frames in enumerate(frame_lists):
        last = len(frames) - 1 if i == last_list else -1
        for j, f in enumerate(frames):
            zsend(sock, f, NOBLOCK if j == last else more, False)


def send_parts(sock: zmq.Socket, identity: bytes, frames: list) -> None:
    """``[identity, *frames]`` NOBLOCK, zero-copy; zmq checks HWM/ROUTER_MANDATORY on the first part only."""
    zsend(sock, identity, NOBLOCK | SNDMORE, False)
    last = len(frames) - 1
    for i, f in enumerate(frames):
        zsend(sock, f, NOBLOCK if i == last else NOBLOCK | SNDMORE, False)
