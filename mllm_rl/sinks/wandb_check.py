"""W&B preflight: can ``--wandb MODE`` work, before a run directory or a W&B run exists?

``check_wandb(mode, fallback, timeout_s)`` is the whole contract (see its docstring). It never
calls ``wandb.init``, never imports jax or torch, and imports ``wandb`` only inside functions.

How the credentials and the server address are found mirrors the installed wandb (0.31:
``wandb/sdk/lib/wbauth/authenticate.py::_use_system_auth``, ``wbauth/wbnetrc.py``,
``wandb/sdk/wandb_setup.py::_load_settings``), without network and without printing:

- server: ``WANDB_BASE_URL``, else ``base_url`` in the ``[default]`` section of the workspace
  settings file (``$WANDB_DIR``/cwd ``/wandb/settings``, or ``.wandb/settings`` when that directory
  exists) over the global one (``$WANDB_CONFIG_DIR/settings``, else ``~/.config/wandb/settings``),
  else wandb's ``DEFAULT_BASE_URL`` (``https://api.wandb.ai`` where the installed wandb has none);
- key: ``WANDB_API_KEY``; or ``WANDB_IDENTITY_TOKEN_FILE``; or the netrc file (``$NETRC``, else
  ``~/.netrc``, else ``~/_netrc``; what ``wandb login`` writes) entry whose machine is the server's
  ``host[:port]`` (or, for a CoreWeave Forge address, the W&B host behind it); or ``api_key`` in a
  settings file. ``WANDB_MODE`` is not consulted: ``wandb.init(mode=...)``, which the W&B sink
  always passes, overrides it.

The reachability probe is one HTTP(S) request (``GET /healthz``; any HTTP answer, whatever its
status, counts as reachable) through the proxy of ``HTTPS_PROXY``/``HTTP_PROXY`` when one applies,
run in a daemon thread so that name lookup, connect, TLS and the answer together take at most
``timeout_s``. TLS certificates are not verified here (reachability only; wandb verifies).
"""

from __future__ import annotations

import base64
import configparser
import http.client
import math
import netrc
import os
import socket
import ssl
import threading
import urllib.request
from pathlib import Path
from typing import NamedTuple
from urllib.parse import unquote, urlsplit

MODES = ("disabled", "offline", "online")
FALLBACKS = ("offline", "error")
LEGACY_BASE_URL = "https://api.wandb.ai"
FIX = "run wandb login, set WANDB_API_KEY, or pass --wandb offline"  # no backticks: a docs/ERRORS.md cell


class Credentials(NamedTuple):
    """Where a W&B credential was found (``source`` ``None``: nowhere) and where was looked."""

    source: str | None  # "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", a netrc or settings file path
    api_key: str | None  # None for an identity token file
    looked: list[str]  # one phrase per place looked in, for the message when nothing was found


def check_wandb(
    mode: str, fallback: str, timeout_s: float, *, run_dir: str | os.PathLike[str] | None = None
) -> tuple[str, list[str]]:
    """Check ``--wandb mode`` before anything starts; return ``(effective mode, warning lines)``.

    - ``mode``: ``"disabled"``, ``"offline"`` or ``"online"``; ``fallback``: ``"offline"`` or
      ``"error"`` (what an unreachable server does); ``timeout_s`` > 0: the probe's bound.
    - ``disabled`` -> ``("disabled", [])`` (wandb need not be installed).
    - ``offline`` -> ``("offline", [])`` once ``wandb`` imports; else ``ValueError``.
    - ``online``: without network, ``wandb`` imports, the server address is a valid http(s) URL and
      a credential exists for it (``ValueError`` naming ``--wandb online`` and the fix otherwise;
      always, whatever ``fallback`` says: that is a setup to fix, not an outage). Then one probe of
      the server bounded by ``timeout_s``: reachable -> ``("online", [])``; unreachable and
      ``fallback == "offline"`` -> ``("offline", ["warning: --wandb online: URL unreachable (REASON)
      within T s; logging offline (sync later: wandb sync DIR)"])``; unreachable and
      ``fallback == "error"`` -> ``RuntimeError`` naming the URL.
    - ``run_dir`` (optional): the run directory, to name the offline run in the sync hint
      (``RUN_DIR/wandb/offline-run-*``).

    Every message is one line. Never calls ``wandb.init``; returns or raises within
    ``timeout_s`` plus the time the local checks take (file reads and ``import wandb``).
    """
    if mode not in MODES:
        raise ValueError(f"--wandb {mode!r}: use disabled, offline or online")
    if fallback not in FALLBACKS:
        raise ValueError(f"--wandb-fallback {fallback!r}: use offline or error")
    if not (isinstance(timeout_s, int | float) and math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"--wandb-timeout must be > 0 seconds, got {timeout_s}")
    if mode == "disabled":
        return mode, []
    _require_wandb(mode)
    if mode == "offline":
        return mode, []
    url = base_url()
    creds = find_credentials(url)
    if creds.source is None:
        raise ValueError(f"--wandb online: no W&B API key for {url} ({'; '.join(creds.looked)}); {FIX}")
    if creds.api_key is not None and (problem := _key_problem(creds.api_key)):
        raise ValueError(f"--wandb online: the API key in {creds.source} is not valid ({problem}); {FIX}")
    reason = probe(url, timeout_s)
    if reason is None:
        return "online", []
    t = f"{timeout_s:g}"
    if fallback == "error":
        raise RuntimeError(
            f"--wandb online: {url} unreachable ({reason}) within {t} s (--wandb-fallback error); "
            "--wandb offline logs locally (upload later with wandb sync)"
        )
    return "offline", [
        f"warning: --wandb online: {url} unreachable ({reason}) within {t} s; "
        f"logging offline (sync later: wandb sync {offline_glob(run_dir)})"
    ]


def offline_glob(run_dir: str | os.PathLike[str] | None) -> str:
    """Where the offline W&B run of ``run_dir`` lands (``RUN_DIR/...`` when not known)."""
    return f"{run_dir if run_dir is not None else 'RUN_DIR'}/wandb/offline-run-*"


def _require_wandb(mode: str) -> None:
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise ValueError(
            f"--wandb {mode}: the wandb package is not installed (pip install wandb, or --wandb disabled)"
        ) from None


def _default_base_url() -> str:
    try:
        from wandb.sdk.lib.urls import DEFAULT_BASE_URL
    except ImportError:  # wandb < 0.31 keeps the default elsewhere: api.wandb.ai
        return LEGACY_BASE_URL
    return str(DEFAULT_BASE_URL)


def settings_files() -> list[Path]:
    """The settings files wandb reads, global first (a later one overrides an earlier one)."""
    config_dir = os.environ.get("WANDB_CONFIG_DIR")
    glob = Path(config_dir).expanduser() if config_dir else Path("~", ".config", "wandb").expanduser()
    root = Path(os.environ.get("WANDB_DIR") or os.getcwd()).expanduser()
    local = root / (".wandb" if (root / ".wandb").exists() else "wandb") / "settings"
    return [glob / "settings", local]


def _settings_value(key: str) -> tuple[str, Path] | None:
    """``key`` of the ``[default]`` section of the settings files (the last file that has it)."""
    found = None
    for path in settings_files():
        parser = configparser.ConfigParser()
        try:
            if not path.is_file():
                continue
            parser.read(path)
            value = parser.get("default", key, fallback=None)
        except (OSError, configparser.Error):  # wandb warns and treats the file as empty
            continue
        if value:
            found = (value, path)
    return found


def base_url() -> str:
    """The W&B server wandb would use (``ValueError`` if it is not an http(s) URL)."""
    url = os.environ.get("WANDB_BASE_URL")
    where = "WANDB_BASE_URL"
    if not url and (setting := _settings_value("base_url")):
        url, where = setting[0], f"base_url in {setting[1]}"
    if not url:
        return _default_base_url().rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--wandb online: {where} {url!r} is not an http(s) URL")
    try:
        parts.port  # noqa: B018  (raises on a port that is not a number)
    except ValueError:
        raise ValueError(f"--wandb online: {where} {url!r} has an invalid port") from None
    return url.rstrip("/")


def netrc_path() -> Path:
    """The netrc file wandb reads and ``wandb login`` writes (wandb's ``_get_netrc_file_path``)."""
    if path := os.environ.get("NETRC"):
        return Path(path).expanduser()
    unix, windows = Path("~/.netrc").expanduser(), Path("~/_netrc").expanduser()
    if unix.exists():
        return unix
    if windows.exists():
        return windows
    return windows if os.name == "nt" else unix


def _netrc_machines(url: str) -> list[str]:
    """The machine names wandb looks up for ``url``: its ``host[:port]``, then the W&B host
    behind a CoreWeave Forge address."""
    machines = [urlsplit(url).netloc]
    try:
        from wandb.sdk.lib import urls

        upstream = urls.forge_upstream_url(urls.normalize_forge_base_url(url))
    except (ImportError, AttributeError, ValueError):
        upstream = url
    if (netloc := urlsplit(upstream).netloc) not in machines:
        machines.append(netloc)
    return machines


def find_credentials(url: str) -> Credentials:
    """The credential wandb would use for the server ``url``, found without network."""
    looked: list[str] = []
    if key := os.environ.get("WANDB_API_KEY"):
        return Credentials("WANDB_API_KEY", key, looked)
    looked.append("WANDB_API_KEY is not set")
    if os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return Credentials("WANDB_IDENTITY_TOKEN_FILE", None, looked)
    path, machines = netrc_path(), _netrc_machines(url)
    try:
        entries = netrc.netrc(str(path))
    except FileNotFoundError:
        looked.append(f"no netrc file at {path}")
    except (netrc.NetrcParseError, OSError) as e:
        looked.append(f"{path} unreadable: {e}")
    else:
        for machine in machines:
            entry = entries.authenticators(machine)
            if entry and entry[2]:
                return Credentials(str(path), entry[2], looked)
        looked.append(f"no entry for {' or '.join(machines)} in {path}")
    if setting := _settings_value("api_key"):
        return Credentials(str(setting[1]), setting[0], looked)
    return Credentials(None, None, looked)


def _key_problem(key: str) -> str | None:
    """What wandb's own format check says about ``key`` (``None``: fine, or no such check)."""
    try:
        from wandb.sdk.lib.wbauth.validation import check_api_key
    except ImportError:
        return None
    problem = check_api_key(key)
    return problem.rstrip(".") if problem else None


def _proxy_for(url: str) -> str | None:
    """The proxy URL wandb's HTTP client would use for ``url`` (``*_PROXY``, ``NO_PROXY``)."""
    parts = urlsplit(url)
    proxy = urllib.request.getproxies().get(parts.scheme)
    if not proxy or urllib.request.proxy_bypass(parts.hostname or ""):
        return None
    return proxy if "://" in proxy else f"http://{proxy}"


def _reason(e: BaseException) -> str:
    if isinstance(e, socket.gaierror):
        return f"name lookup failed: {e.strerror or e}"
    if isinstance(e, ConnectionRefusedError):
        return "connection refused"
    if isinstance(e, TimeoutError):
        return "timed out"
    if isinstance(e, ssl.SSLError):
        return f"TLS: {e.reason or e}"
    if isinstance(e, http.client.HTTPException):
        return f"not an HTTP answer: {type(e).__name__}"
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return f"{type(e).__name__}: {e}".splitlines()[0]


def _request(url: str, timeout_s: float) -> None:
    """One ``GET /healthz`` to ``url`` (through its proxy); returns once any HTTP answer came."""
    parts = urlsplit(url)
    https = parts.scheme == "https"
    port = parts.port or (443 if https else 80)
    context = ssl.create_default_context()
    context.check_hostname = False  # reachability only: wandb itself verifies the certificate
    context.verify_mode = ssl.CERT_NONE
    headers = {"Host": parts.netloc, "User-Agent": "mllm_rl-wandb-check", "Connection": "close"}
    path = (parts.path.rstrip("/") or "") + "/healthz"
    proxy = _proxy_for(url)
    conn: http.client.HTTPConnection
    if proxy is None:
        conn = (
            http.client.HTTPSConnection(parts.hostname, port, timeout=timeout_s, context=context)
            if https
            else http.client.HTTPConnection(parts.hostname, port, timeout=timeout_s)
        )
    else:
        p = urlsplit(proxy)
        if p.scheme == "https":  # TLS to the proxy itself: that the proxy answers is all we check
            conn = http.client.HTTPSConnection(p.hostname, p.port or 443, timeout=timeout_s, context=context)
            try:
                conn.connect()
            finally:
                conn.close()
            return
        auth = {}
        if p.username:
            token = base64.b64encode(f"{unquote(p.username)}:{unquote(p.password or '')}".encode()).decode()
            auth = {"Proxy-Authorization": f"Basic {token}"}
        if https:  # CONNECT through the proxy, then TLS to the server
            conn = http.client.HTTPSConnection(p.hostname, p.port or 80, timeout=timeout_s, context=context)
            conn.set_tunnel(parts.hostname, port, headers=auth)
        else:
            conn = http.client.HTTPConnection(p.hostname, p.port or 80, timeout=timeout_s)
            headers.update(auth)
            path = f"{parts.scheme}://{parts.netloc}{path}"
    try:
        conn.request("GET", path, headers=headers)
        conn.getresponse().close()
    finally:
        conn.close()


def probe(url: str, timeout_s: float) -> str | None:
    """``None`` if the server at ``url`` gave an HTTP answer within ``timeout_s``, else why not
    (one short phrase). Name lookup included: the request runs in a daemon thread that is left
    behind, not waited for, when it overruns."""
    result: list[str | None] = []

    def run() -> None:
        try:
            _request(url, timeout_s)
            result.append(None)
        except Exception as e:  # every failure is a reason
            result.append(_reason(e))

    thread = threading.Thread(target=run, name="wandb-check-probe", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not result:
        return "no answer"
    return result[0]
