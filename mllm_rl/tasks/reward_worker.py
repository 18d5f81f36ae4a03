"""The reward worker: ``main([IN_FD, OUT_FD, STATUS_FD])`` in a subprocess of ``reward.RewardRunner``.

It imports the reward (``module:function`` or ``file.py:function``) and answers one message per
sample, so the run can stop a hung call and survive a crash. Messages (pickled): ``("load", spec,
sys_path)`` -> ``("loaded", batched)`` | ``("failed", reason)``; ``("score", prompts, completions,
rows)`` -> per sample ``("value", i, float)`` | ``("raised", i, reason)`` | ``("bad", i, returned)``
(``i`` -1: the whole batch), then ``("done",)``. ``print`` goes to stderr; SIGINT is ignored.
A keeper process writes the worker's exit code to ``STATUS_FD``, because sglang-jax's SIGCHLD
handler reaps children before the run's own ``wait`` sees a status."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import numbers
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Any

PER_SAMPLE = ("prompt", "completion", "row")
BATCHED = ("prompts", "completions", "rows")


class LoadError(Exception):
    """The reward cannot be loaded or called as documented (one line)."""


def split_spec(spec: str) -> tuple[str, str]:
    """``module:function`` / ``path/to/file.py:function`` -> ``(target, function)``."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name or not name.replace("_", "a").replace(".", "a").isalnum():
        raise LoadError(f"{spec!r}: expected module:function or path/to/file.py:function (docs/TASKS.md)")
    return target, name


def is_file_spec(target: str) -> bool:
    return target.endswith(".py") or "/" in target or os.sep in target


def absolute_spec(spec: str, base: Path | None = None) -> str:
    """``spec`` with a file path made absolute (against ``base``, else the cwd): a resume loads it."""
    try:
        target, name = split_spec(spec)
    except LoadError:
        return spec
    if not is_file_spec(target):
        return spec
    path = Path(target).expanduser()
    if not path.is_absolute() and base is not None:
        path = base / path
    return f"{path.resolve()}:{name}"


def load(spec: str) -> Any:
    """The function ``spec`` names (``LoadError`` saying why not)."""
    target, name = split_spec(spec)
    if is_file_spec(target):
        path = Path(target).expanduser()
        if not path.is_file():
            raise LoadError(f"{path}: no such file")
        mod_name = f"mllm_rl_reward_{abs(hash(str(path.resolve())))}"
        module_spec = importlib.util.spec_from_file_location(mod_name, path)
        if module_spec is None or module_spec.loader is None:
            raise LoadError(f"{path}: not a Python file")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[mod_name] = module
        try:
            module_spec.loader.exec_module(module)
        except Exception as e:  # noqa: BLE001 -- the user's module: say what it raised
            raise LoadError(f"importing {path} raised {describe(e)}") from None
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise LoadError(str(e)) from None
        except Exception as e:  # noqa: BLE001
            raise LoadError(f"importing {target} raised {describe(e)}") from None
    obj: Any = module
    for part in name.split("."):
        if not hasattr(obj, part):
            raise LoadError(f"{target} has no attribute {name!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise LoadError(f"{spec} is a {type(obj).__name__}, not a function")
    args = BATCHED if getattr(obj, "batched", False) else PER_SAMPLE
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return obj  # a builtin without a signature: the first call says
    try:
        sig.bind(*args)
    except TypeError:
        shown = str(sig) if len(str(sig)) <= 60 else str(sig)[:57] + "...)"
        raise LoadError(
            f"{name}{shown} cannot be called as ({', '.join(args)})"
            + ("" if args is BATCHED else "; a batched function sets .batched = True")
        ) from None
    return obj


def describe(e: BaseException) -> str:
    """``Type: message (file:line)`` on one line: the innermost frame of the traceback."""
    text = " ".join(f"{type(e).__name__}: {e}".split())
    tb = traceback.extract_tb(e.__traceback__)
    if tb:
        last = tb[-1]
        text += f" ({Path(last.filename).name}:{last.lineno})"
    return text[:500]


def as_number(v: Any) -> tuple[float | None, str]:
    """``(value, "")`` for a finite real number (bools count as 0/1), else ``(None, why)``."""
    numpy_scalar = (
        getattr(v, "shape", None) == () and getattr(getattr(v, "dtype", None), "kind", "x") in "biuf"
    )
    if isinstance(v, numbers.Real) or numpy_scalar:  # numpy's bool is not a numbers.Real
        f = float(v)
        if math.isfinite(f):
            return f, ""
        return None, f"returned {f}"
    shown = repr(v)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return None, f"returned {shown} ({type(v).__name__}), not a number"


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass


def _score(fn: Any, batched: bool, prompts: list, completions: list, rows: list, send: Any) -> None:
    if batched:
        try:
            values = list(fn(prompts, completions, rows))
        except Exception as e:  # noqa: BLE001
            send(("raised", -1, describe(e)))
            return
        if len(values) != len(prompts):
            send(("raised", -1, f"returned {len(values)} values for {len(prompts)} samples"))
            return
    for i in range(len(prompts)):
        if batched:
            v = values[i]
        else:
            try:
                v = fn(prompts[i], completions[i], rows[i])
            except Exception as e:  # noqa: BLE001
                send(("raised", i, describe(e)))
                return
        value, why = as_number(v)
        if value is None:
            send(("bad", i, why))
            return
        send(("value", i, value))


def _keep(in_fd: int, out_fd: int, status_fd: int) -> None:
    """Fork; return in the child (the worker); the parent stays the worker's keeper until it dies,
    writes its exit code to ``status_fd`` and exits."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # SIG_IGN, kept across exec, would reap it unseen
    keeper = os.getpid()
    pid = os.fork()
    if pid == 0:
        os.close(status_fd)  # the keeper's end only: its death is the end of that pipe
        _die_with_parent()
        if os.getppid() != keeper:  # the keeper died before the line above
            os._exit(1)
        return
    os.close(in_fd)  # the worker's pipes are the worker's: its death is their end
    os.close(out_fd)
    waiting = [True]

    def stop_worker(signum: int, frame: Any) -> None:
        if waiting[0]:
            os.kill(pid, signal.SIGKILL)

    signal.signal(signal.SIGUSR1, stop_worker)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})
    _, status = os.waitpid(pid, 0)
    waiting[0] = False
    try:
        os.write(status_fd, f"{os.waitstatus_to_exitcode(status)}\n".encode())
    except OSError:  # the run closed its end: it stopped the worker and does not ask
        pass
    os._exit(0)


def main(argv: list[str]) -> int:
    from multiprocessing.connection import Connection

    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if len(argv) > 2:
        _keep(int(argv[0]), int(argv[1]), int(argv[2]))
    sys.dont_write_bytecode = True  # no __pycache__ next to a reward file
    os.dup2(2, 1)  # print() in a reward goes to stderr; the protocol has pipes of its own
    inp = Connection(int(argv[0]), writable=False)
    out = Connection(int(argv[1]), readable=False)
    fn, batched = None, False
    while True:
        try:
            msg = inp.recv()
        except (EOFError, OSError):  # the run ended
            return 0
        if msg[0] == "load":
            sys.path[:] = [p for p in msg[2] if p] + [p for p in sys.path if p not in msg[2]]
            try:
                fn = load(msg[1])
            except LoadError as e:
                out.send(("failed", str(e)))
                continue
            batched = bool(getattr(fn, "batched", False))
            out.send(("loaded", batched))
        elif msg[0] == "score":
            _score(fn, batched, msg[1], msg[2], msg[3], out.send)
            out.send(("done",))
        else:
            out.send(("failed", f"unknown message {msg[0]!r}"))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
