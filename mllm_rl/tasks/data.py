"""A task read from a dataset (``--data``): its rows as prompts, a held-out set, a reward by path.

Formats by path (docs/TASKS.md): a ``save_to_disk`` directory (a ``DatasetDict``'s ``train`` split
or its only one; ``test``/``validation`` is the held-out set unless ``--eval-data``); parquet, CSV
and TSV through ``datasets``; ``org/name[:config]`` from the Hub; anything else JSON lines (or a
``*.json`` array). Every error is one line naming the file and row (``file:LINE:``, ``file: row I:``).

Epoch ``e`` visits every training row once in ``default_rng([seed, e, DATA_STREAM])`` order, so a
step's prompts are a pure function of ``(seed, step)``. Held-out set: ``--eval-data``, else the
``test``/``validation`` split, else ``eval_prompts`` rows split off (at most a quarter, by a
seed-independent RNG so runs of different seeds are scored on the same rows), never trained on."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from mllm_rl.progress import waiting
from mllm_rl.tasks.reward import Scorer

HELDOUT_SPLITS = ("test", "validation")
DATA_STREAM = 7  # the training order's RNG stream
HOLDOUT_SEED = 20250101  # the held-out split's RNG (independent of --seed)
MAX_HELDOUT_FRACTION = 4  # a split-off held-out set is at most 1/4 of the rows


@dataclasses.dataclass(frozen=True)
class Example:
    """One prompt: text or a list of ``{role, content}`` messages; ``answer`` (``""`` without an
    answer column); ``row``: every column, what the reward gets; ``where``: ``file:line`` or
    ``file: row i`` (empty when generated); ``index``: the row's index in its file."""

    prompt: Any
    answer: str
    row: dict[str, Any] = dataclasses.field(default_factory=dict, hash=False)
    where: str = ""
    index: int | None = None


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


def is_hub_id(path: str | Path, base: Path = Path()) -> bool:
    """``org/name[:config]`` that is no path (relative to ``base``) and has no data file's suffix."""
    s = str(path)
    local = (base / Path(s).expanduser()).exists()
    return bool(HUB_ID.match(s)) and not local and not s.lower().endswith(LOCAL_SUFFIXES)


def read_table(path: str | Path, flag: str = "--task-data") -> Table:
    """The rows of ``path`` (see the module doc); read once per process and file version."""
    src: Any = str(path)
    key, what, read = (src, flag, 0, 0), f"loading {path} from the Hugging Face Hub", _hub
    if not is_hub_id(path):
        src = Path(path).expanduser()
        if not src.exists():
            raise ValueError(f"{flag} {path}: not a file")
        src = src.resolve()
        st = src.stat()
        key, what, read = (str(src), flag, st.st_mtime_ns, st.st_size), f"reading {src.name}", _read
    if key not in _CACHE:
        if len(_CACHE) >= 4:  # a run reads --data and --eval-data (before it starts, then in it)
            _CACHE.pop(next(iter(_CACHE)))
        with waiting(what):
            _CACHE[key] = read(src, flag)
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


@contextlib.contextmanager
def _quiet(on: bool = True) -> Iterator[Any]:
    """``datasets`` (``on``: without progress bars or loggers below CRITICAL, so a refusal is one line)."""
    import datasets

    level, bars = datasets.logging.get_verbosity(), datasets.utils.are_progress_bars_disabled()
    if on:
        datasets.disable_progress_bars()
        datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        yield datasets
    finally:
        datasets.logging.set_verbosity(level)
        if not bars:
            datasets.enable_progress_bars()


def _columnar(p: Path, flag: str, suffix: str) -> Table:
    import tempfile

    kind = {".pq": "parquet", ".tsv": "csv"}.get(suffix, suffix[1:])
    with _quiet() as datasets, tempfile.TemporaryDirectory(prefix="mllm_rl-data-") as cache:
        try:
            if kind == "parquet":
                ds = datasets.Dataset.from_parquet(str(p), cache_dir=cache, keep_in_memory=True)
            else:
                extra = {"sep": "\t"} if suffix == ".tsv" else {}
                ds = datasets.Dataset.from_csv(str(p), cache_dir=cache, keep_in_memory=True, **extra)
        except Exception as e:  # noqa: BLE001 -- pyarrow/pandas raise many kinds; one line says which
            raise ValueError(f"{flag} {p}: not readable as {kind}: {_first_line(e)}") from None
    return _from_dataset(ds, p, flag)


def _saved(p: Path, flag: str) -> Table:
    if not ((p / "dataset_info.json").is_file() or (p / "dataset_dict.json").is_file()):
        raise ValueError(
            f"{flag} {p}: a directory, but not a dataset saved with datasets' save_to_disk "
            f"(no dataset_info.json or dataset_dict.json)"
        )
    with _quiet() as datasets:
        try:
            obj = datasets.load_from_disk(str(p), keep_in_memory=True)
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"{flag} {p}: not readable as a saved dataset: {_first_line(e)}") from None
        return _from_dataset(obj, p, flag)


def _hub(spec: str, flag: str) -> Table:
    """``org/name[:config]`` through ``datasets.load_dataset`` (its own download bars on a terminal;
    ``HF_DATASETS_OFFLINE=1`` reads its cache only)."""
    from mllm_rl.progress import progress_enabled

    name, _, config = spec.partition(":")
    with _quiet(not progress_enabled()) as datasets:
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

    def table(ds: Any, heldout: Table | None = None, split: str | None = None) -> Table:
        return Table(p, tuple(ds.to_list()), None, tuple(ds.column_names), heldout, split)

    if not isinstance(obj, datasets.DatasetDict):
        return table(obj)
    names = list(obj)
    train = "train" if "train" in obj else (names[0] if len(names) == 1 else None)
    if train is None:
        raise ValueError(f"{flag} {p}: a DatasetDict with splits {', '.join(names)} and none named train")
    held = next((s for s in HELDOUT_SPLITS if s in obj and s != train), None)
    return table(obj[train], None if held is None else table(obj[held], split=held), train)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


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


def examples_of(
    table: Table,
    prompt_key: str,
    answer_key: str,
    make_prompt: Callable[[Any], Any] = lambda p: p,
    check_answer: Callable[[str, str], None] | None = None,
    limit: int | None = None,
) -> list[Example]:
    """The first ``limit`` rows (default: every row) as ``Example``s, each checked: a prompt that is
    non-empty text or chat messages, an answer (``""`` when ``answer_key`` is empty: no answer column)."""
    for key, flag in ((prompt_key, "--prompt-key"), (answer_key, "--answer-key")):
        if table.columns is not None and key and key not in table.columns:
            split = f" [{table.split}]" if table.split else ""
            raise ValueError(
                f"{table.path}{split}: no column {key!r} ({flag}); columns: {', '.join(table.columns) or 'none'}"
            )
    out = []
    for i, row in enumerate(table.rows[:limit]):
        where, has = table.where(i), ", ".join(row) or "nothing"
        if prompt_key not in row:
            raise ValueError(f"{where}: no {prompt_key!r} (--prompt-key); the row has: {has}")
        p, answer = row[prompt_key], ""
        if isinstance(p, str) and not p.strip():
            raise ValueError(f"{where}: the prompt ({prompt_key!r}) is empty")
        if not isinstance(p, str) and not is_messages(p):
            raise ValueError(
                f"{where}: the prompt ({prompt_key!r}) is {_kind(p)}, not text (a string, or a list "
                f"of {{role, content}} messages)"
            )
        if answer_key and answer_key not in row:
            raise ValueError(f"{where}: no {answer_key!r} (--answer-key; '' for none); the row has: {has}")
        if answer_key:
            a = row[answer_key]
            if _null(a):
                raise ValueError(f"{where}: the answer ({answer_key!r}) is null")
            answer = a if isinstance(a, str) else json.dumps(a) if isinstance(a, (list, dict)) else str(a)
        if check_answer is not None:
            check_answer(answer, where)
        out.append(Example(prompt=make_prompt(p), answer=answer, row=row, where=where, index=i))
    if not out:
        raise ValueError(f"{table.path}: no rows")
    return out


class DatasetTask:
    """``Task`` over the rows of a dataset (see the module doc)."""

    templated = True

    def __init__(
        self,
        name: str,
        examples: list[Example],
        heldout: list[Example] | None,
        eval_prompts: int,
        scorer: Scorer,
    ) -> None:
        self.name, self.reward_spec, self.scorer = name, scorer.spec, scorer
        self.examples = tuple(examples)  # every row of the data, in file order
        self.notes: list[str] = []
        self.train = tuple(range(len(examples)))
        self.held = tuple(heldout or ())
        if heldout is None:
            h = min(eval_prompts, len(examples) // MAX_HELDOUT_FRACTION)
            held = sorted(int(i) for i in np.random.default_rng(HOLDOUT_SEED).permutation(len(examples))[:h])
            taken = set(held)
            self.train = tuple(i for i in self.train if i not in taken)
            self.held = tuple(examples[i] for i in held) if h else self.examples[:eval_prompts]
            if h == 0:
                self.notes.append(
                    f"note: {len(examples)} rows are too few to hold any out: the evaluation scores "
                    f"training rows (pass --eval-data for a held-out set)"
                )
            elif h < eval_prompts:
                self.notes.append(
                    f"note: {h} of {len(examples)} rows held out for evaluation (at most a quarter; "
                    f"--eval-prompts {eval_prompts}); training on the other {len(self.train)}"
                )
        self._perms: dict[int, np.ndarray] = {}
        self._seed: int | None = None

    def _perm(self, seed: int, epoch: int) -> np.ndarray:
        if self._seed != seed:
            self._perms, self._seed = {}, seed
        if epoch not in self._perms:
            if len(self._perms) > 4:
                self._perms.pop(min(self._perms))
            rng = np.random.default_rng([seed, epoch, DATA_STREAM])
            self._perms[epoch] = rng.permutation(len(self.train))
        return self._perms[epoch]

    def batch(self, seed: int, step: int, n: int) -> list[Example]:
        epochs = (divmod(step * n + j, len(self.train)) for j in range(n))
        return [self.examples[self.train[int(self._perm(seed, e)[k])]] for e, k in epochs]

    def heldout(self, seed: int, n: int) -> list[Example]:
        return list(self.held[:n])

    def sizing(self, seed: int) -> list[Example]:
        mine = {id(e) for e in self.examples}
        return [*self.examples, *(e for e in self.held if id(e) not in mine)]

    def rewards(self, prompts: list[str], completions: list[str], examples: list[Example], what: str) -> Any:
        return self.scorer.rewards(prompts, completions, examples, what)

    def close(self) -> None:
        self.scorer.close()


def dataset_task(
    cfg: Any,
    path: str,
    prompt_key: str,
    answer_key: str,
    reward: str,
    make_prompt: Callable[[Any], Any] = lambda p: p,
    check_answer: Callable[[str, str], None] | None = None,
) -> DatasetTask:
    """The task of ``cfg`` (a ``TaskConfig``) over the rows of ``path``, every row checked."""
    table = read_table(path, "--task-data")
    examples = examples_of(table, prompt_key, answer_key, make_prompt, check_answer)
    held_table = read_table(cfg.eval_data, "--eval-data") if cfg.eval_data is not None else table.heldout
    heldout = None
    if held_table is not None:
        heldout = examples_of(held_table, prompt_key, answer_key, make_prompt, check_answer, cfg.eval_prompts)
    env = {"MLLM_RL_PROMPT_KEY": prompt_key, "MLLM_RL_ANSWER_KEY": answer_key}
    scorer = Scorer(reward, cfg.reward_timeout, env)
    return DatasetTask(cfg.name, examples, heldout, cfg.eval_prompts, scorer)
