"""Real object-store servers for the object-storage tests, each started on
127.0.0.1 in its own process and stopped by the test: moto's server mode
(`moto[server]`, the S3 API), `gcp-storage-emulator` (GCS's JSON API), and
a proxy in front of the S3 one that answers some requests with 503 or
slowly (a store that throttles)."""

import contextlib
import http.client
import http.server
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Dict
from typing import Iterator
from typing import Tuple

from keras_distribute.launch.processes import free_port

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "kd-test", "AWS_SECRET_ACCESS_KEY":
               "kd-test-secret", "AWS_DEFAULT_REGION": "us-east-1"}


def _wait_for(port: int, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server ended ({process.returncode})")
        try:
            socket.create_connection(("127.0.0.1", port), 0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("the server did not listen within 60 s")


@contextlib.contextmanager
def _running(process: subprocess.Popen, port: int) -> Iterator[str]:
    """Waits until `process` listens on `port`, yields its URL, and stops
    it (this test's own process, by its handle) however the test ends."""
    try:
        _wait_for(port, process)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.contextmanager
def s3_server() -> Iterator[str]:
    """Runs moto's S3 server on loopback; yields its endpoint URL."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
         str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env=dict(os.environ, **CREDENTIALS))
    with _running(process, port) as url:
        yield url


@contextlib.contextmanager
def gcs_server(bucket: str) -> Iterator[str]:
    """Runs a fake GCS server (`gcp-storage-emulator`, the JSON API gcsfs
    speaks) on loopback with `bucket`; yields its URL (what
    `STORAGE_EMULATOR_HOST` names)."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "gcp_storage_emulator", "start", "--host",
         "127.0.0.1", "--port", str(port), "--in-memory",
         "--default-bucket", bucket], stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    with _running(process, port) as url:
        yield url


def environment(endpoint: str) -> Dict[str, str]:
    """The variables a program sets to use the server (its standard ones)."""
    return dict(CREDENTIALS, AWS_ENDPOINT_URL=endpoint)


def make_bucket(endpoint: str, bucket: str) -> None:
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, **{
        "aws_access_key_id": CREDENTIALS["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        "region_name": CREDENTIALS["AWS_DEFAULT_REGION"]})
    try:
        client.create_bucket(Bucket=bucket)
    except client.exceptions.BucketAlreadyOwnedByYou:
        pass


class FlakyProxy:
    """Forwards HTTP to `endpoint`; answers every `fail_every`-th request
    with 503 SlowDown (what S3 says when it throttles) and delays each by
    `delay_s`. While `stall` is set, holds every request unanswered (for
    at most `STALL_LIMIT_S`: a store that stopped answering). Counts what
    it failed."""

    STALL_LIMIT_S = 30.0

    def __init__(self, endpoint: str, fail_every: int = 0,
                 delay_s: float = 0.0, drop_headers: Tuple[str, ...] = ()):
        host, port = endpoint.rsplit("/", 1)[1].split(":")
        self.target = (host, int(port))
        self.fail_every, self.delay_s = fail_every, delay_s
        # (headers not passed on: a server that ignores them)
        dropped = {"connection", "transfer-encoding", "content-length"} | {
            name.lower() for name in drop_headers}
        self.requests = self.failed = 0
        self.stall = threading.Event()
        self._lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _body(self) -> bytes:
                if "chunked" in self.headers.get("Transfer-Encoding", ""):
                    chunks = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0], 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n",
                                                                b""):
                                pass  # trailers
                            return b"".join(chunks)
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                length = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(length) if length else b""

            def _any(self):
                body = self._body()
                with proxy._lock:
                    proxy.requests += 1
                    fail = proxy.fail_every and (
                        proxy.requests % proxy.fail_every == 0)
                    proxy.failed += bool(fail)
                if proxy.delay_s:
                    time.sleep(proxy.delay_s)
                held = time.monotonic() + proxy.STALL_LIMIT_S
                while proxy.stall.is_set() and time.monotonic() < held:
                    time.sleep(0.05)
                if fail:
                    payload = (b"<?xml version=\"1.0\"?><Error><Code>SlowDown"
                               b"</Code><Message>Reduce your request rate."
                               b"</Message></Error>")
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                connection = http.client.HTTPConnection(*proxy.target,
                                                        timeout=60)
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in dropped}
                headers["Content-Length"] = str(len(body))
                connection.request(self.command, self.path, body=body,
                                   headers=headers)
                answer = connection.getresponse()
                data = answer.read()
                self.send_response(answer.status, answer.reason)
                for key, value in answer.getheaders():
                    if key.lower() not in ("transfer-encoding", "connection",
                                           "content-length"):
                        self.send_header(key, value)
                self.send_header("Content-Length", str(
                    answer.getheader("Content-Length", "0")
                    if self.command == "HEAD" else len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                connection.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                                      Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever,
                                        daemon=True)

    def __enter__(self) -> "FlakyProxy":
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.server.shutdown()
        self.server.server_close()
