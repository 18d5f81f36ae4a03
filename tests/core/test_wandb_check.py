"""``mllm_rl.sinks.wandb_sink.check_wandb`` and the W&B sink's online start-up: no traceback, no
long silent wait, an offline fallback or a one-line error.

No network here: the W&B server is ``FakeWandbServer`` (a local HTTP server answering wandb's
``viewer`` query, or refusing the key), a closed port, or a socket that never answers. Every test
runs with HOME, NETRC, the wandb config directory and the working directory in a temporary
directory and without W&B or proxy variables, so the user's own ``~/.netrc`` or
``WANDB_API_KEY`` can neither help nor hurt; wandb's session is torn down after each test.
"""

from __future__ import annotations

import base64
import http.server
import json
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

from mllm_rl.sinks import wandb_sink
from mllm_rl.sinks.wandb_sink import check_wandb

KEY = "k" * 40  # the shape of a W&B API key (wandb checks 40+ word characters)
SLACK_S = 5.0  # liveness bound over timeout_s: interpreter, thread and wandb start-up, not a speed target


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "home"
    home.mkdir()
    for var in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL", "WANDB_MODE", "WANDB_DIR",
                "http_proxy", "https_proxy", "all_proxy", "no_proxy",
                "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY"):  # fmt: skip
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("NETRC", str(home / "netrc-absent"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(home / "wandb-config"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.chdir(tmp_path)
    yield home
    if wandb := sys.modules.get("wandb"):  # wandb keeps the session's settings and credentials
        wandb.teardown()


def closed_port() -> int:
    """A local port nothing listens on (bound, then closed)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def no_probe(monkeypatch) -> None:
    def fail(*a, **k):
        raise AssertionError("the server was asked")

    monkeypatch.setattr(wandb_sink, "verify", fail)


def timed(fn, *args, **kwargs):
    t0 = time.monotonic()
    try:
        return fn(*args, **kwargs), time.monotonic() - t0
    except Exception as e:
        return e, time.monotonic() - t0


class FakeWandbServer:
    """A local stand-in for a W&B server: answers every POST with a ``viewer`` (or 401 when
    ``refuse``); ``paths`` and ``keys`` list the requested paths and the API keys sent."""

    def __init__(self, refuse: bool = False) -> None:
        paths: list[str] = []
        keys: list[str] = []
        self.paths, self.keys = paths, keys

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                paths.append(self.path)
                auth = self.headers.get("Authorization", "")
                if auth.startswith("Basic "):
                    keys.append(base64.b64decode(auth[6:]).decode().partition(":")[2])
                body = (
                    b""
                    if refuse
                    else json.dumps({"data": {"viewer": {"id": "1", "username": "fake"}}}).encode()
                )
                self.send_response(401 if refuse else 200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    s = FakeWandbServer()
    yield s
    s.close()


# ---- argument and offline checks ----


@pytest.mark.parametrize("mode", ["disabled", "offline"])
def test_disabled_and_offline_pass_through_without_probing(mode, monkeypatch):
    no_probe(monkeypatch)
    assert check_wandb(mode, "offline", 10) == (mode, [])
    assert check_wandb(mode, "error", 10) == (mode, [])


def test_missing_wandb_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes ``import wandb`` raise ImportError
    assert check_wandb("disabled", "offline", 10) == ("disabled", [])
    for mode in ("offline", "online"):
        with pytest.raises(ValueError) as e:
            check_wandb(mode, "offline", 10)
        assert str(e.value) == (
            f"--wandb {mode}: the wandb package is not installed (pip install wandb, or --wandb disabled)"
        )


@pytest.mark.parametrize("args,flag", [
    (("cloud", "offline", 10), "--wandb 'cloud'"),
    (("online", "retry", 10), "--wandb-fallback 'retry'"),
    (("online", "offline", 0), "--wandb-timeout"),
    (("online", "offline", float("nan")), "--wandb-timeout"),
])  # fmt: skip
def test_bad_arguments(args, flag, monkeypatch):
    no_probe(monkeypatch)
    with pytest.raises(ValueError, match=flag):
        check_wandb(*args)


# ---- credentials (no network) ----


def test_no_key_refuses_online_without_touching_the_network(monkeypatch):
    no_probe(monkeypatch)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    for fallback in ("offline", "error"):  # a missing key is a setup to fix, not an outage
        with pytest.raises(ValueError) as e:
            check_wandb("online", fallback, 10)
        msg = str(e.value)
        assert msg.startswith("--wandb online: no W&B API key for http://127.0.0.1:9; ")  # names the server
        assert "\n" not in msg
        for fix in ("wandb login", "WANDB_API_KEY", "--wandb offline"):
            assert fix in msg, (fix, msg)


def test_bad_key_format_is_refused_before_probing(monkeypatch):
    no_probe(monkeypatch)
    monkeypatch.setenv("WANDB_API_KEY", "short")
    with pytest.raises(ValueError, match=r"^--wandb online: WANDB_API_KEY invalid: .*40.*; run wandb login"):
        check_wandb("online", "offline", 10)


def test_bad_base_url_is_refused(monkeypatch):
    no_probe(monkeypatch)
    monkeypatch.setenv("WANDB_API_KEY", KEY)
    monkeypatch.setenv("WANDB_BASE_URL", "api.example.com")
    with pytest.raises(ValueError) as e:
        check_wandb("online", "offline", 10)
    msg = str(e.value)
    assert msg.startswith("--wandb online: wandb setting base_url 'api.example.com' is not valid (")
    assert "\n" not in msg


@pytest.mark.parametrize("where", ["NETRC", "HOME"])
def test_key_in_netrc_is_found(where, server, monkeypatch, isolated):
    """The netrc entry for the server's ``host:port`` (not another host's) is the key sent."""
    monkeypatch.setenv("WANDB_BASE_URL", server.url)
    netrc = isolated / ("my-netrc" if where == "NETRC" else ".netrc")
    netrc.write_text(f"machine other.example.com login user password {'o' * 40}\n"
                     f"machine {server.url.removeprefix('http://')}\n  login user\n  password {KEY}\n")  # fmt: skip
    netrc.chmod(0o600)
    if where == "NETRC":
        monkeypatch.setenv("NETRC", str(netrc))
    else:
        monkeypatch.delenv("NETRC")
    assert check_wandb("online", "error", 10) == ("online", [])
    assert "/graphql" in server.paths and set(server.keys) == {KEY}


def test_netrc_entry_for_another_host_is_no_key(monkeypatch, isolated):
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    netrc = isolated / "my-netrc"
    netrc.write_text(f"machine api.wandb.ai login user password {KEY}\n")
    monkeypatch.setenv("NETRC", str(netrc))
    no_probe(monkeypatch)
    with pytest.raises(ValueError, match=r"^--wandb online: no W&B API key for http://127\.0\.0\.1:9; "):
        check_wandb("online", "offline", 10)


def test_settings_file_base_url_and_env_precedence(server, monkeypatch, isolated):
    """``base_url`` from wandb's settings file, ``WANDB_BASE_URL`` over it (wandb's order)."""
    monkeypatch.setenv("WANDB_API_KEY", KEY)
    cfg = isolated / "wandb-config"
    cfg.mkdir()
    (cfg / "settings").write_text(f"[default]\nbase_url = {server.url}\n")
    assert check_wandb("online", "error", 10) == ("online", [])
    assert "/graphql" in server.paths
    closed = f"http://127.0.0.1:{closed_port()}"
    monkeypatch.setenv("WANDB_BASE_URL", closed + "/")
    mode, warnings = check_wandb("online", "offline", 1)
    assert mode == "offline" and f"{closed} unreachable (" in warnings[0]


# ---- reachability ----


def test_unreachable_server_falls_back_offline(monkeypatch):
    url = f"http://127.0.0.1:{closed_port()}"
    monkeypatch.setenv("WANDB_API_KEY", KEY)
    monkeypatch.setenv("WANDB_BASE_URL", url)
    (mode, warnings), took = timed(check_wandb, "online", "offline", 1, run_dir="runs/r1")
    assert mode == "offline" and len(warnings) == 1
    assert warnings[0].startswith(f"warning: --wandb online: {url} unreachable (")
    assert warnings[0].endswith(
        ") within 1 s; logging offline (sync later: wandb sync runs/r1/wandb/offline-run-*)"
    )
    assert took < 1 + SLACK_S


def test_unreachable_server_with_fallback_error_raises(monkeypatch):
    url = f"http://127.0.0.1:{closed_port()}"
    monkeypatch.setenv("WANDB_API_KEY", KEY)
    monkeypatch.setenv("WANDB_BASE_URL", url)
    err, took = timed(check_wandb, "online", "error", 1)
    assert isinstance(err, RuntimeError), err
    msg = str(err)
    assert (
        msg.startswith(f"--wandb online: {url} unreachable (")
        and "within 1 s (--wandb-fallback error)" in msg
    )
    assert "\n" not in msg and "--wandb offline" in msg
    assert took < 1 + SLACK_S


def test_a_server_that_never_answers_is_bounded(monkeypatch):
    """Connect succeeds (the kernel accepts into the backlog), no byte ever comes back."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    try:
        url = f"http://127.0.0.1:{server.getsockname()[1]}"
        monkeypatch.setenv("WANDB_API_KEY", KEY)
        monkeypatch.setenv("WANDB_BASE_URL", url)
        (mode, warnings), took = timed(check_wandb, "online", "offline", 1)
    finally:
        server.close()
    assert mode == "offline"
    assert f"{url} unreachable (no answer) within 1 s" in warnings[0]
    assert took < 1 + SLACK_S


def test_a_hanging_wandb_call_is_bounded(monkeypatch):
    """Whatever hangs inside wandb (a name lookup has no timeout of its own) is abandoned at
    timeout_s: the verification runs in a thread that is not waited for."""
    wandb = pytest.importorskip("wandb")
    monkeypatch.setattr(wandb, "Api", lambda **k: time.sleep(30))
    monkeypatch.setenv("WANDB_API_KEY", KEY)
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.invalid")
    (mode, warnings), took = timed(check_wandb, "online", "offline", 1)
    assert mode == "offline"
    assert "https://wandb.invalid unreachable (no answer) within 1 s" in warnings[0]
    assert took < 1 + SLACK_S


def test_a_reachable_server_stays_online(server, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", KEY)
    monkeypatch.setenv("WANDB_BASE_URL", server.url)
    assert check_wandb("online", "error", 10) == ("online", [])
    assert "/graphql" in server.paths and set(server.keys) == {KEY}


def test_a_refused_key_is_not_online(monkeypatch):
    fake = FakeWandbServer(refuse=True)
    try:
        monkeypatch.setenv("WANDB_API_KEY", KEY)
        monkeypatch.setenv("WANDB_BASE_URL", fake.url)
        with pytest.raises(
            RuntimeError, match=rf"^--wandb online: {fake.url} unreachable \(.+\) within 10 s"
        ):
            check_wandb("online", "error", 10)
    finally:
        fake.close()
    assert "/graphql" in fake.paths


def test_the_proxy_is_used(server, monkeypatch):
    """HTTP_PROXY set: wandb goes through it (here the proxy answers for an unresolvable host)."""
    monkeypatch.setenv("WANDB_API_KEY", KEY)
    monkeypatch.setenv("WANDB_BASE_URL", "http://wandb.invalid:8080")
    monkeypatch.setenv("HTTP_PROXY", server.url)
    assert check_wandb("online", "error", 10) == ("online", [])
    assert "http://wandb.invalid:8080/graphql" in server.paths


# ---- the sink's online start-up ----


class _Recorder:
    """Wraps ``wandb.init``: records (mode, settings) and makes online inits raise ``error``."""

    def __init__(self, wandb, error: Exception) -> None:
        self.real, self.error, self.calls = wandb.init, error, []

    def __call__(self, **kwargs):
        self.calls.append((kwargs["mode"], kwargs["settings"]))
        if kwargs["mode"] == "online":
            raise self.error
        return self.real(**kwargs)


def test_sink_online_init_failure_with_fallback_error_is_one_line(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    from mllm_rl.sinks.wandb_sink import WandbSink

    monkeypatch.setenv("WANDB_API_KEY", KEY)
    rec = _Recorder(
        wandb, wandb.errors.CommError("Timed out while retrying\nConsider increasing init_timeout")
    )
    monkeypatch.setattr(wandb, "init", rec)
    with pytest.raises(RuntimeError) as e:
        WandbSink("online", tmp_path, "wb-err", fallback="error", init_timeout=2)
    msg = str(e.value)
    assert msg.startswith("--wandb online: wandb.init failed after ")
    assert "(limit 2 s): CommError: Timed out while retrying; --wandb offline" in msg and "\n" not in msg
    assert [m for m, _ in rec.calls] == ["online"]  # no offline run made
    assert rec.calls[0][1].init_timeout == 2.0  # the bound reached wandb


def test_sink_without_key_falls_back_offline_without_trying_online(tmp_path, monkeypatch, capsys):
    wandb = pytest.importorskip("wandb")
    from mllm_rl.sinks.wandb_sink import WandbSink

    rec = _Recorder(wandb, AssertionError("online init attempted without a key (wandb would prompt)"))
    monkeypatch.setattr(wandb, "init", rec)
    sink = WandbSink("online", tmp_path, "wb-nokey")
    try:
        assert sink.mode == "offline" and "no W&B API key" in sink.fallback_reason
        assert [m for m, _ in rec.calls] == ["offline"]
        lines = capsys.readouterr().err.strip().splitlines()
        assert lines == [f"warning: --wandb online: {sink.fallback_reason}; logging offline "
                         f"(sync later: wandb sync {sink.offline_dir})"]  # fmt: skip
        assert Path(sink.offline_dir).name.startswith("offline-run-")
    finally:
        sink.close()


def test_sink_online_init_timeout_falls_back_offline_for_real(tmp_path, monkeypatch, capfd):
    """The real wandb, a closed port: wandb.init retries until its init_timeout, then the offline
    run takes over under the same run id (a fresh wandb service: the failed run's id is taken)."""
    pytest.importorskip("wandb")
    from mllm_rl.sinks.wandb_file import read_history
    from mllm_rl.sinks.wandb_sink import WandbSink

    monkeypatch.setenv("WANDB_API_KEY", KEY)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{closed_port()}")
    t0 = time.monotonic()
    sink = WandbSink("online", tmp_path, "wb-fallback", init_timeout=2)
    took = time.monotonic() - t0
    try:
        assert sink.mode == "offline"
        assert sink.fallback_reason.startswith("wandb.init failed after ")
        sink.log_metrics(1, {"reward": 0.5})
    finally:
        sink.close()
    assert took < 2 + 20  # the init bound plus two wandb service start-ups: liveness, not speed
    err = [ln for ln in capfd.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("warning: --wandb online: wandb.init failed after "), err
    assert "Traceback" not in "\n".join(err)
    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-wb-fallback.wandb")
    assert [r["train/reward"] for r in read_history(run_file)] == [0.5]


def test_sink_rejects_a_bad_fallback(tmp_path):
    pytest.importorskip("wandb")
    from mllm_rl.sinks.wandb_sink import WandbSink

    with pytest.raises(ValueError, match="--wandb-fallback 'retry'"):
        WandbSink("online", tmp_path, "wb-bad", fallback="retry")
