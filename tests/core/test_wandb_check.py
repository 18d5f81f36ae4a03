"""``mllm_rl.sinks.wandb_check.check_wandb`` and the W&B sink's online start-up: no traceback, no
long silent wait, an offline fallback or a one-line error.

No network here: the "server" is a closed port, a socket that never answers, a slow name lookup
(patched) or a local HTTP server. Every test runs with HOME, NETRC, the wandb config directory and
the working directory in a temporary directory and without W&B or proxy variables, so the user's
own ``~/.netrc`` or ``WANDB_API_KEY`` can neither help nor hurt.
"""

from __future__ import annotations

import http.server
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

from mllm_rl.sinks import wandb_check
from mllm_rl.sinks.wandb_check import check_wandb, find_credentials

KEY = "k" * 40  # the shape of a W&B API key (wandb checks 40+ word characters)
SLACK_S = 5.0  # liveness bound over timeout_s: interpreter and thread start-up, not a speed target


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
    monkeypatch.chdir(tmp_path)
    return home


def closed_port() -> int:
    """A local port nothing listens on (bound, then closed)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def no_probe(monkeypatch) -> None:
    def fail(*a, **k):
        raise AssertionError("the server was probed")

    monkeypatch.setattr(wandb_check, "probe", fail)


def timed(fn, *args, **kwargs):
    t0 = time.monotonic()
    try:
        return fn(*args, **kwargs), time.monotonic() - t0
    except Exception as e:
        return e, time.monotonic() - t0


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


def test_no_key_refuses_online_without_touching_the_network(monkeypatch, isolated):
    no_probe(monkeypatch)
    for fallback in ("offline", "error"):  # a missing key is a setup to fix, not an outage
        with pytest.raises(ValueError) as e:
            check_wandb("online", fallback, 10)
        msg = str(e.value)
        assert msg.startswith("--wandb online: no W&B API key for ")
        assert "\n" not in msg
        for fix in ("wandb login", "WANDB_API_KEY", "--wandb offline"):
            assert fix in msg, (fix, msg)
        assert str(isolated / "netrc-absent") in msg  # says where it looked


def test_bad_key_format_is_refused_before_probing(monkeypatch):
    pytest.importorskip("wandb.sdk.lib.wbauth.validation")
    no_probe(monkeypatch)
    monkeypatch.setenv("WANDB_API_KEY", "short")
    with pytest.raises(
        ValueError, match=r"^--wandb online: the API key in WANDB_API_KEY is not valid \(.*40"
    ):
        check_wandb("online", "offline", 10)


def test_bad_base_url_is_refused(monkeypatch):
    no_probe(monkeypatch)
    monkeypatch.setenv("WANDB_API_KEY", KEY)
    monkeypatch.setenv("WANDB_BASE_URL", "api.example.com")
    with pytest.raises(ValueError, match=r"^--wandb online: WANDB_BASE_URL 'api.example.com' is not an http"):
        check_wandb("online", "offline", 10)


@pytest.mark.parametrize("where", ["NETRC", "HOME"])
def test_key_in_netrc_is_found(where, monkeypatch, isolated):
    port = closed_port()
    url = f"http://127.0.0.1:{port}"
    monkeypatch.setenv("WANDB_BASE_URL", url)
    netrc = isolated / ("my-netrc" if where == "NETRC" else ".netrc")
    netrc.write_text(f"machine other.example.com login user password {'o' * 40}\n"
                     f"machine 127.0.0.1:{port}\n  login user\n  password {KEY}\n")  # fmt: skip
    netrc.chmod(0o600)
    if where == "NETRC":
        monkeypatch.setenv("NETRC", str(netrc))
    else:
        monkeypatch.delenv("NETRC")
    creds = find_credentials(url)
    assert (creds.source, creds.api_key) == (str(netrc), KEY)
    mode, warnings = check_wandb("online", "offline", 3)  # found: probed (not refused), port closed
    assert mode == "offline" and len(warnings) == 1


def test_netrc_entry_for_another_host_is_no_key(monkeypatch, isolated):
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    netrc = isolated / "my-netrc"
    netrc.write_text(f"machine api.wandb.ai login user password {KEY}\n")
    monkeypatch.setenv("NETRC", str(netrc))
    no_probe(monkeypatch)
    with pytest.raises(ValueError, match=r"no entry for 127\.0\.0\.1:9 in .*my-netrc"):
        check_wandb("online", "offline", 10)


def test_settings_file_base_url_and_env_precedence(monkeypatch, isolated):
    """``base_url`` from wandb's settings file, ``WANDB_BASE_URL`` over it (wandb's order)."""
    cfg = isolated / "wandb-config"
    cfg.mkdir()
    (cfg / "settings").write_text("[default]\nbase_url = http://127.0.0.1:7\n")
    assert wandb_check.base_url() == "http://127.0.0.1:7"
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:8/")
    assert wandb_check.base_url() == "http://127.0.0.1:8"


@pytest.mark.parametrize("url", [None, "http://127.0.0.1:4321", "https://wandb.example.com"])
def test_agrees_with_wandbs_own_netrc_lookup(url, monkeypatch, isolated):
    """Our lookup finds the key wandb itself would read (for its default server too)."""
    wbnetrc = pytest.importorskip("wandb.sdk.lib.wbauth.wbnetrc")
    netrc = isolated / "my-netrc"
    netrc.write_text(f"machine api.wandb.ai login user password {'a' * 40}\n"
                     f"machine 127.0.0.1:4321 login user password {'b' * 40}\n"
                     f"machine wandb.example.com login user password {'c' * 40}\n")  # fmt: skip
    monkeypatch.setenv("NETRC", str(netrc))
    if url:
        monkeypatch.setenv("WANDB_BASE_URL", url)
    resolved = wandb_check.base_url()
    theirs = wbnetrc.read_netrc_auth(host=resolved)
    assert theirs is not None
    assert find_credentials(resolved).api_key == theirs


# ---- reachability ----


def test_unreachable_server_falls_back_offline(monkeypatch):
    url = f"http://127.0.0.1:{closed_port()}"
    monkeypatch.setenv("WANDB_API_KEY", KEY)
    monkeypatch.setenv("WANDB_BASE_URL", url)
    result, took = timed(check_wandb, "online", "offline", 3, run_dir="runs/r1")
    assert result == ("offline", [
        f"warning: --wandb online: {url} unreachable (connection refused) within 3 s; "
        "logging offline (sync later: wandb sync runs/r1/wandb/offline-run-*)"
    ])  # fmt: skip
    assert took < 3 + SLACK_S


def test_unreachable_server_with_fallback_error_raises(monkeypatch):
    url = f"http://127.0.0.1:{closed_port()}"
    monkeypatch.setenv("WANDB_API_KEY", KEY)
    monkeypatch.setenv("WANDB_BASE_URL", url)
    err, took = timed(check_wandb, "online", "error", 3)
    assert isinstance(err, RuntimeError), err
    msg = str(err)
    assert msg.startswith(f"--wandb online: {url} unreachable (connection refused) within 3 s")
    assert "\n" not in msg and "--wandb offline" in msg
    assert took < 3 + SLACK_S


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
    assert f"{url} unreachable (" in warnings[0] and "within 1 s" in warnings[0]
    assert took < 1 + SLACK_S


def test_a_hanging_name_lookup_is_bounded(monkeypatch):
    """getaddrinfo has no timeout of its own: the probe's thread is abandoned at timeout_s."""
    real = socket.getaddrinfo

    def slow(host, *a, **k):
        if host == "wandb.invalid":
            time.sleep(30)
        return real(host, *a, **k)

    monkeypatch.setattr(socket, "getaddrinfo", slow)
    monkeypatch.setenv("WANDB_API_KEY", KEY)
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.invalid")
    (mode, warnings), took = timed(check_wandb, "online", "offline", 1)
    assert mode == "offline"
    assert "https://wandb.invalid unreachable (no answer) within 1 s" in warnings[0]
    assert took < 1 + SLACK_S


class _Server:
    """A local HTTP server answering 404 to everything; ``paths`` lists the requested paths."""

    def __init__(self) -> None:
        paths: list[str] = []
        self.paths = paths

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                paths.append(self.path)
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()

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
    s = _Server()
    yield s
    s.close()


def test_a_reachable_server_stays_online(server, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", KEY)
    monkeypatch.setenv("WANDB_BASE_URL", server.url)
    assert check_wandb("online", "error", 5) == ("online", [])
    assert server.paths == ["/healthz"]  # any HTTP answer counts, a 404 included


def test_the_proxy_is_used(server, monkeypatch):
    """HTTP_PROXY set: the probe goes through it (here the proxy answers for an unresolvable host)."""
    monkeypatch.setenv("WANDB_API_KEY", KEY)
    monkeypatch.setenv("WANDB_BASE_URL", "http://wandb.invalid:8080")
    monkeypatch.setenv("HTTP_PROXY", server.url)
    assert check_wandb("online", "error", 5) == ("online", [])
    assert server.paths == ["http://wandb.invalid:8080/healthz"]


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
