"""Reading a dataset: rows (every column) with where each came from, and the checks of its prompts.

Formats by path (docs/TASKS.md): a ``save_to_disk`` directory (a ``DatasetDict``'s ``train``
split, or its only one; ``test``/``validation`` is the held-out set unless ``--eval-data``);
``*.parquet``/``*.csv``/``*.tsv`` through ``datasets``; ``org/name[:config]`` from the Hub;
anything else JSON lines, read line by line so an error names the line (a ``*.json`` array too).
Every error is a one-line ``ValueError`` naming the file and row (``file:LINE:`` or
``file: row I:``)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any

from mllm_rl.progress import waiting

HELDOUT_SPLITS = ("test", "validation")


@dataclasses.dataclass(frozen=True)
class Table:
    path: Path
    rows: tuple[dict[str, Any], ...]
    lines: tuple[int, ...] | None  # JSON lines: the line of each row
    columns: tuple[str, ...] | None  # columnar formats: every row has these keys
    heldout: Table | None = None  # a DatasetDict's test/validation split
    split: str | None = None  # the DatasetDict split these rows are

    def where(self, i: int) -> str:
        if self.lines is not None:
            return f"{self.path}:{self.lines[i]}"
        split = f" [{self.split}]" if self.split else ""
        return f"{self.path}{split}: row {i}"


_CACHE: dict[tuple[str, str, int, int], Table] = {}


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(:[\w.-]+)?$")  # org/name[:config]
LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet", ".pq", ".csv", ".tsv")


def is_hub_id(path: str | Path) -> bool:
    """``org/name`` or ``org/name:config`` that is no local path and has no data file's suffix."""
    s = str(path)
    return (
        bool(HUB_ID.match(s)) and not Path(s).expanduser().exists() and not s.lower().endswith(LOCAL_SUFFIXES)
    )


def read_table(path: str | Path, flag: str = "--task-data") -> Table:
    """The rows of ``path`` (see the module doc); read once per process and file version."""
    if is_hub_id(path):
        key = (str(path), flag, 0, 0)
        if key not in _CACHE:
            with waiting(f"loading {path} from the Hugging Face Hub"):
                _CACHE[key] = _hub(str(path), flag)
        return _CACHE[key]
    p = Path(path).expanduser()
    if not p.exists():
        raise ValueError(f"{flag} {path}: not a file")
    p = p.resolve()
    st = p.stat()
    key = (str(p), flag, st.st_mtime_ns, st.st_size)
    if key not in _CACHE:
        if len(_CACHE) >= 4:  # a run reads --data and --eval-data (before it starts, then in it)
            _CACHE.pop(next(iter(_CACHE)))
        with waiting(f"reading {p.name}"):
            _CACHE[key] = _read(p, flag)
    return _CACHE[key]


def _read(p: Path, flag: str) -> Table:
    if p.is_dir():
        return _saved(p, flag)
    suffix = p.suffix.lower()
    if suffix in (".parquet", ".pq", ".csv", ".tsv"):
        return _columnar(p, flag, suffix)
    return _json_lines(p, flag)


def _json_lines(p: Path, flag: str) -> Table:
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{flag} {p}: {e}") from None
    except OSError as e:
        raise ValueError(f"{flag} {p}: cannot read ({e.strerror or e})") from None
    if p.suffix.lower() == ".json" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}:{e.lineno}: not valid JSON ({e.msg})") from None
        for i, row in enumerate(rows):
            if not isinstance(row, dict):
                raise ValueError(f"{p}: row {i}: expected a JSON object, got {type(row).__name__}")
        return Table(p, tuple(rows), None, None)
    rows, lines = [], []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}:{n}: expected a JSON object ({e.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{p}:{n}: expected a JSON object, got {type(row).__name__}")
        rows.append(row)
        lines.append(n)
    return Table(p, tuple(rows), tuple(lines), None)


class _Quiet:
    """``datasets`` without progress bars or loggers below CRITICAL, so a refusal is one line."""

    def __enter__(self) -> Any:
        import datasets

        self.level = datasets.logging.get_verbosity()
        self.bars = datasets.utils.are_progress_bars_disabled()
        datasets.disable_progress_bars()
        datasets.logging.set_verbosity(datasets.logging.CRITICAL)
        return datasets

    def __exit__(self, *exc: Any) -> None:
        import datasets

        datasets.logging.set_verbosity(self.level)
        if not self.bars:
            datasets.enable_progress_bars()


def _columnar(p: Path, flag: str, suffix: str) -> Table:
    import tempfile

    kind = {".pq": "parquet", ".tsv": "csv"}.get(suffix, suffix[1:])
    with _Quiet() as datasets, tempfile.TemporaryDirectory(prefix="mllm_rl-data-") as cache:
        try:
            if kind == "parquet":
                ds = datasets.Dataset.from_parquet(str(p), cache_dir=cache, keep_in_memory=True)
            else:
                extra = {"sep": "\t"} if suffix == ".tsv" else {}
                ds = datasets.Dataset.from_csv(str(p), cache_dir=cache, keep_in_memory=True, **extra)
        except Exception as e:  # noqa: BLE001 -- pyarrow/pandas raise many kinds; one line says which
            raise ValueError(f"{flag} {p}: not readable as {kind}: {_first_line(e)}") from None
    return Table(p, tuple(ds.to_list()), None, tuple(ds.column_names))


def _saved(p: Path, flag: str) -> Table:
    if not ((p / "dataset_info.json").is_file() or (p / "dataset_dict.json").is_file()):
        raise ValueError(
            f"{flag} {p}: a directory, but not a dataset saved with datasets' save_to_disk "
            f"(no dataset_info.json or dataset_dict.json)"
        )
    with _Quiet() as datasets:
        try:
            obj = datasets.load_from_disk(str(p), keep_in_memory=True)
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"{flag} {p}: not readable as a saved dataset: {_first_line(e)}") from None
        return _from_dataset(obj, p, flag)


def _hub(spec: str, flag: str) -> Table:
    """``org/name[:config]`` through ``datasets.load_dataset`` (its own download bars on a terminal;
    ``HF_DATASETS_OFFLINE=1`` reads its cache only)."""
    import datasets

    from mllm_rl.progress import progress_enabled

    name, _, config = spec.partition(":")
    quiet = _Quiet() if not progress_enabled() else contextlib.nullcontext(datasets)
    with quiet:
        try:
            obj = datasets.load_dataset(name, config or None)
        except Exception as e:  # noqa: BLE001 -- offline, unknown id, gated, a bad config: one line each
            raise ValueError(
                f"{flag} {spec}: no such local file or directory, and the Hugging Face Hub did not give "
                f"the dataset: {_first_line(e)}"
            ) from None
        return _from_dataset(obj, Path(spec), flag)


def _from_dataset(obj: Any, p: Path, flag: str) -> Table:
    """A ``Dataset``'s rows, or a ``DatasetDict``'s ``train`` split (or its only one) with its
    ``test``/``validation`` split as the held-out set."""
    import datasets

    if isinstance(obj, datasets.DatasetDict):
        names = list(obj)
        train = "train" if "train" in obj else (names[0] if len(names) == 1 else None)
        if train is None:
            raise ValueError(f"{flag} {p}: a DatasetDict with splits {', '.join(names)} and none named train")
        held = next((s for s in HELDOUT_SPLITS if s in obj and s != train), None)
        heldout = None
        if held is not None:
            h = obj[held]
            heldout = Table(p, tuple(h.to_list()), None, tuple(h.column_names), split=held)
        t = obj[train]
        return Table(p, tuple(t.to_list()), None, tuple(t.column_names), heldout, split=train)
    return Table(p, tuple(obj.to_list()), None, tuple(obj.column_names))


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


# -- the checks of a row -------------------------------------------------------------------------
def is_messages(v: Any) -> bool:
    """A chat prompt: a non-empty list of ``{"role": str, "content": str}``."""
    return (
        isinstance(v, list)
        and len(v) > 0
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in v
        )
    )


def _null(v: Any) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def _kind(v: Any) -> str:
    if _null(v):
        return "null"
    shown = repr(v)
    return f"{type(v).__name__} {shown if len(shown) <= 40 else shown[:37] + '...'}"


def check_columns(table: Table, prompt_key: str, answer_key: str) -> None:
    """A columnar table has the columns (``ValueError`` naming the file and the columns it has)."""
    if table.columns is None:
        return
    for key, flag in ((prompt_key, "--prompt-key"), (answer_key, "--answer-key")):
        if key and key not in table.columns:
            split = f" [{table.split}]" if table.split else ""
            raise ValueError(
                f"{table.path}{split}: no column {key!r} ({flag}); columns: {', '.join(table.columns) or 'none'}"
            )


def prompt_of(table: Table, i: int, prompt_key: str) -> Any:
    """Row ``i``'s prompt: non-empty text or chat messages (``ValueError`` naming file and row)."""
    row = table.rows[i]
    if prompt_key not in row:
        raise ValueError(
            f"{table.where(i)}: no {prompt_key!r} (--prompt-key); the row has: {', '.join(row) or 'nothing'}"
        )
    p = row[prompt_key]
    if isinstance(p, str):
        if not p.strip():
            raise ValueError(f"{table.where(i)}: the prompt ({prompt_key!r}) is empty")
        return p
    if is_messages(p):
        return p
    raise ValueError(
        f"{table.where(i)}: the prompt ({prompt_key!r}) is {_kind(p)}, not text (a string, or a list "
        f"of {{role, content}} messages)"
    )


def answer_of(table: Table, i: int, answer_key: str) -> str:
    """Row ``i``'s answer as text (``""`` when ``answer_key`` is empty: no answer column)."""
    if not answer_key:
        return ""
    row = table.rows[i]
    if answer_key not in row:
        raise ValueError(
            f"{table.where(i)}: no {answer_key!r} (--answer-key; '' for none); the row has: "
            f"{', '.join(row) or 'nothing'}"
        )
    a = row[answer_key]
    if _null(a):
        raise ValueError(f"{table.where(i)}: the answer ({answer_key!r}) is null")
    return a if isinstance(a, str) else json.dumps(a) if isinstance(a, (list, dict)) else str(a)
