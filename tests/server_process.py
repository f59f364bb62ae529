"""A server binary in its own process on loopback, for the tests of tiers that talk to one.

:class:`ServerProcess` is what the memcached, redis-server (or Valkey) and
``mooncake_master`` launchers share: a private directory for the server's files and
its log while the context lasts; a start that waits until every port it serves accepts
connections, on the same ports after a kill or a stop, as a server that crashes and
comes back does; and an end by its pid, SIGTERM, or SIGKILL as a crash, killed if it
does not exit in time. A subclass gives its command line, the ports to wait for and
its name.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar, TypeVar

from kvtier.bench.servers import wait_listening

__all__ = ["ServerProcess"]

# Servers start in milliseconds to seconds; a loaded machine may take many times that.
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
# Of a server's log, what a failed start's message quotes.
LOG_TAIL_CHARS = 2000

_Server = TypeVar("_Server", bound="ServerProcess")


class ServerProcess:
    """A server in its own process while the context lasts; started and stopped by pid."""

    #: How messages name the server; its log is ``<name>.log`` in its directory.
    name: ClassVar[str]

    def __init__(self) -> None:
        self._process: subprocess.Popen[bytes] | None = None
        self._directory: tempfile.TemporaryDirectory[str] | None = None

    # ------------------------------------------------------ for subclasses

    def _command(self) -> list[str]:
        """The command line that starts the server, on 127.0.0.1 only."""
        raise NotImplementedError

    def _ports(self) -> Sequence[int]:
        """The ports the server is ready once it accepts connections on."""
        raise NotImplementedError

    def _prepare(self) -> None:
        """Write what the server reads at start into its directory (nothing here)."""

    # --------------------------------------------------------------- shared

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    @property
    def log(self) -> Path:
        """Where the server's output goes."""
        return self._path(f"{self.name}.log")

    def _path(self, name: str) -> Path:
        assert self._directory is not None, f"the {self.name} server is not entered"
        return Path(self._directory.name) / name

    async def __aenter__(self: _Server) -> _Server:
        self._directory = tempfile.TemporaryDirectory(prefix=f"kvtier-{self.name}-")
        try:
            self._prepare()
            await self.start()
        except BaseException:
            self._directory.cleanup()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        try:
            await self.stop()
        finally:
            if self._directory is not None:
                self._directory.cleanup()

    async def start(self) -> None:
        """Start the server (on the ports it had before, after a kill or a stop) and
        wait until it accepts connections."""
        if self.running:
            return
        try:
            await asyncio.to_thread(self._launch)
        except BaseException:
            await self.stop()
            raise

    def _launch(self) -> None:
        with open(self.log, "ab") as output:
            self._process = subprocess.Popen(
                self._command(), stdin=subprocess.DEVNULL, stdout=output, stderr=output
            )
        try:
            for port in self._ports():
                wait_listening(port, START_TIMEOUT_S, lambda: self.running)
        except RuntimeError:
            said = self.log.read_text(errors="replace").strip()[-LOG_TAIL_CHARS:]
            raise RuntimeError(f"{self.name} exited while starting: {said}") from None

    def pause(self) -> None:
        """Stop the server's process (SIGSTOP): it holds its connections and answers
        nothing, as a server stuck or cut off does, until :meth:`resume`."""
        assert self._process is not None, f"the {self.name} server is not running"
        self._process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """Let a paused server run on (SIGCONT)."""
        if self._process is not None:
            self._process.send_signal(signal.SIGCONT)

    async def kill(self) -> None:
        """Kill the server (SIGKILL) as a crash would: what it held is gone with it."""
        await self._end(signal.SIGKILL)

    async def stop(self) -> None:
        """Terminate the server, killing it if it does not exit in time."""
        await self._end(signal.SIGTERM)

    async def _end(self, sig: signal.Signals) -> None:
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(sig)
        process.send_signal(signal.SIGCONT)  # a paused server acts on it too
        try:
            await asyncio.to_thread(process.wait, STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            await asyncio.to_thread(process.wait, STOP_TIMEOUT_S)
