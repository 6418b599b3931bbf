"""A real S3-compatible server on the loopback for the tests: moto's server mode, in a subprocess.

The session starts it before its Ray cluster and puts its endpoint and dummy
credentials in the environment (``AWS_ENDPOINT_URL``, the AWS SDKs' standard
variable, which pyarrow reads), so every process of the cluster, simulated
nodes and subprocess drivers included, reaches it as they would reach S3.
Nothing is mocked in the client: pyarrow's S3 filesystem speaks HTTP to it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid

import pytest

BUCKET = "gnnray-tests"
# Storage kinds a test runs over: tmp_path, or a fresh prefix of the bucket (the ``storage_path`` fixture).
STORAGE_KINDS = pytest.mark.parametrize("storage_path", ["file", "s3"], indirect=True)


class S3Server:
    """moto's S3 server on ``127.0.0.1`` and a free port, started at once; :meth:`wait` until it answers.
    ``check_credentials``: it refuses keys it does not know (all of them: it knows none), as S3 would."""

    def __init__(self, check_credentials: bool = False):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{port}"
        self._dir = tempfile.TemporaryDirectory(prefix="gnnray-moto-")  # its recordings (:meth:`recording`)
        self._process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], cwd=self._dir.name,
            env=dict(os.environ, MOTO_RECORDER_FILEPATH=os.path.join(self._dir.name, "recording"),
                     **({"INITIAL_NO_AUTH_ACTION_COUNT": "0"} if check_credentials else {})),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._ready = False

    def environment(self) -> dict:
        """What every process needs to reach the server as S3 (and not look for an instance's role)."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "testing",
                "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_EC2_METADATA_DISABLED": "true"}

    def wait(self, timeout_s: float = 60.0, bucket: bool = True) -> "S3Server":
        """Wait until the server answers, then make the tests' bucket (once, with ``bucket``)."""
        if self._ready:
            return self
        deadline = time.monotonic() + timeout_s
        while True:
            assert self._process.poll() is None, f"moto's server exited with {self._process.returncode}"
            try:
                urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=5)
                break
            except OSError:
                assert time.monotonic() < deadline, f"moto's server did not answer within {timeout_s:.0f} s"
                time.sleep(0.1)
        if not bucket:
            return self
        import pyarrow.fs

        pyarrow.fs.S3FileSystem(endpoint_override=self.endpoint, allow_bucket_creation=True,
                                access_key="testing", secret_key="testing", region="us-east-1").create_dir(BUCKET)
        self._ready = True
        return self

    def fresh_prefix(self, name: str = "t") -> str:
        """A URI under the bucket that no other test uses."""
        self.wait()
        return f"s3://{BUCKET}/{name}-{uuid.uuid4().hex[:8]}"

    @contextlib.contextmanager
    def recording(self):
        """The requests the server received within the block (moto's recorder): a list of dicts with
        ``method``, ``url`` and ``headers``, filled when the block ends."""
        import json

        def call(action: str) -> bytes:
            request = urllib.request.Request(f"{self.endpoint}/moto-api/recorder/{action}", data=b"",
                                             method="GET" if action.startswith("download") else "POST")
            return urllib.request.urlopen(request, timeout=30).read()

        self.wait()
        requests: list = []
        call("reset-recording")
        call("start-recording")
        try:
            yield requests
        finally:
            call("stop-recording")
            requests += [json.loads(line) for line in call("download-recording").decode().splitlines()]

    def stop(self) -> None:
        self._process.terminate()
        try:
            self._process.wait(timeout=3)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._dir.cleanup()


def start_for_session() -> S3Server:
    """The server, its environment set in this process (for what it starts later: the cluster, drivers)."""
    server = S3Server()
    os.environ.update(server.environment())
    return server
