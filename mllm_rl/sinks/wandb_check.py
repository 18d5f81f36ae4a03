"""W&B preflight: can ``--wandb MODE`` work, before a run directory or a W&B run exists?

Both questions go to wandb itself, so its rules (env variables, netrc, settings files, proxies)
stay its own: ``wandb.login(prompt=False, verify=False)`` finds the key as ``wandb.init`` will,
without network; ``wandb.Api()`` verifies it with the server in a daemon thread abandoned after
``timeout_s``, so a dead network cannot hold a run."""

from __future__ import annotations

import math
import os
import threading
from typing import Any

MODES = ("disabled", "offline", "online")
FALLBACKS = ("offline", "error")
FIX = "run wandb login, set WANDB_API_KEY, or pass --wandb offline"  # no backticks: a docs/ERRORS.md cell


def check_wandb(
    mode: str, fallback: str, timeout_s: float, *, run_dir: str | os.PathLike[str] | None = None
) -> tuple[str, list[str]]:
    """Check ``--wandb mode``; return ``(effective mode, warning lines)``; one-line messages.

    ``disabled`` needs no wandb; ``offline`` needs it importable (``ValueError``). ``online``: no
    usable credential is a ``ValueError`` whatever ``fallback`` says (a setup to fix, not an
    outage); a server that does not verify the key within ``timeout_s`` gives ``("offline",
    [warning])`` with ``fallback="offline"``, else ``RuntimeError``. ``run_dir`` goes in the sync hint."""
    if mode not in MODES:
        raise ValueError(f"--wandb {mode!r}: use disabled, offline or online")
    if fallback not in FALLBACKS:
        raise ValueError(f"--wandb-fallback {fallback!r}: use offline or error")
    if not (isinstance(timeout_s, int | float) and math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"--wandb-timeout must be > 0 seconds, got {timeout_s}")
    if mode == "disabled":
        return mode, []
    try:
        import wandb
    except ImportError:
        raise ValueError(
            f"--wandb {mode}: the wandb package is not installed (pip install wandb, or --wandb disabled)"
        ) from None
    if mode == "offline":
        return mode, []
    url = logged_in(wandb)
    reason = verify(wandb, timeout_s)
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


def logged_in(wandb: Any) -> str:
    """Log the session in from the credentials wandb finds (no network, no prompt); return the
    server's URL. ``ValueError`` (one line, ``--wandb online: ...``) when there is none to use."""
    os.environ.setdefault("WANDB_SILENT", "true")  # no "Loaded credentials" or logged-in lines
    try:
        found = wandb.login(prompt=False, verify=False)
    except Exception as e:  # AuthenticationError: a malformed key; ValidationError: a bad setting
        if callable(errors := getattr(e, "errors", None)):  # pydantic's: which setting, and why
            err = errors()[0]
            where = ".".join(map(str, err["loc"]))
            raise ValueError(
                f"--wandb online: wandb setting {where} {err.get('input')!r} is not valid ({err['msg']})"
            ) from None
        raise ValueError(f"--wandb online: {_one_line(e)}; {FIX}") from None
    url = str(wandb.sdk.wandb_setup.singleton().settings.base_url).rstrip("/")
    if not found:
        raise ValueError(f"--wandb online: no W&B API key for {url}; {FIX}")
    return url


def verify(wandb: Any, timeout_s: float) -> str | None:
    """``None`` if the server accepted the session's credentials within ``timeout_s``, else why
    not (one short phrase; ``no answer`` when the time ran out)."""
    result: list[str | None] = []

    def run() -> None:
        try:
            wandb.Api(timeout=max(1, math.ceil(timeout_s)))
            result.append(None)
        except Exception as e:  # every failure is a reason
            result.append(_one_line(e))

    thread = threading.Thread(target=run, name="wandb-check-verify", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not result:  # left running: tearing wandb down now could wait on the same dead network
        return "no answer"
    wandb.teardown()  # no session, credentials or wandb service left behind
    return result[0]


def _one_line(e: BaseException) -> str:
    """The first line of ``e``'s message (its type's name when it has none), at most 300 chars."""
    text = str(e).strip()
    first = text.splitlines()[0].rstrip(".") if text and text != "<no message>" else ""
    return (first or type(e).__name__)[:300]
