"""Bring your own task, the data side: every format read into the same rows, every bad row refused
with one line naming the file and the row, the training order a pure function of (seed, step), the
held-out split, the chat template, prompt lengths, and the boxed task's math answers (math-verify)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from mllm_rl.tasks import Example, TaskConfig, build_task, check_config, get_task
from mllm_rl.tasks.boxed import boxed_reward, math_equal, reward
from mllm_rl.tasks.data import DatasetTask, read_table
from mllm_rl.tasks.pattern import PatternTask
from mllm_rl.tasks.pattern import reward as pattern_reward
from mllm_rl.tasks.render import check_lengths, render

ROWS = [{"prompt": f"question {i}", "answer": str(i), "extra": [i, i + 1]} for i in range(40)]
TOKENIZER = Path(__file__).resolve().parents[2] / "mllm_rl" / "assets" / "tokenizer"
REWARD = "mllm_rl.tasks.pattern:reward"  # any importable reward: these tests score nothing


def jsonl(path: Path, rows: list, raw: str = "") -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + raw)
    return path


def data_task(path: Path, **kw) -> DatasetTask:
    return get_task("data", str(path), reward=REWARD, **kw)  # type: ignore[return-value]


@pytest.fixture(autouse=True)
def _tests_torch_is_not_torch(monkeypatch):
    """Where torch is not installed, pytest's ``tests/`` on ``sys.path`` makes ``tests/torch``
    importable as ``torch``, and ``datasets`` (which looks with ``find_spec``) takes it for torch."""
    import importlib.metadata

    import datasets

    try:
        importlib.metadata.distribution("torch")
    except importlib.metadata.PackageNotFoundError:
        monkeypatch.setattr(datasets.config, "TORCH_AVAILABLE", False)
        if "torch" in sys.modules:  # imported so by an earlier test of this worker
            monkeypatch.delitem(sys.modules, "torch")


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TOKENIZER))


# -- formats ------------------------------------------------------------------------------------
def test_jsonl_json_parquet_csv_tsv_and_saved_datasets_read_the_same_rows(tmp_path):
    import datasets
    import pandas as pd

    flat = [{k: v for k, v in r.items() if k != "extra"} for r in ROWS]
    paths = {
        "jsonl": jsonl(tmp_path / "d.jsonl", flat),
        "nosuffix": jsonl(tmp_path / "d", flat),
        "json": tmp_path / "d.json",
        "parquet": tmp_path / "d.parquet",
        "csv": tmp_path / "d.csv",
        "tsv": tmp_path / "d.tsv",
        "saved": tmp_path / "saved",
    }
    paths["json"].write_text(json.dumps(flat))
    frame = pd.DataFrame(flat)
    frame.to_parquet(paths["parquet"])
    frame.to_csv(paths["csv"], index=False)
    frame.to_csv(paths["tsv"], index=False, sep="\t")
    datasets.Dataset.from_list(flat).save_to_disk(str(paths["saved"]))
    for kind, path in paths.items():
        t = data_task(path)
        got = [(e.prompt, e.answer) for e in t.examples]
        assert got == [(r["prompt"], r["answer"]) for r in flat], kind  # CSV's 7 becomes "7" again
    assert read_table(paths["jsonl"]).where(2) == f"{paths['jsonl']}:3"
    assert read_table(paths["parquet"]).where(2) == f"{paths['parquet']}: row 2"


def test_a_saved_dataset_dict_trains_on_train_and_evaluates_on_test(tmp_path):
    import datasets

    d = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:30]),
                              "test": datasets.Dataset.from_list(ROWS[30:])})  # fmt: skip
    d.save_to_disk(str(tmp_path / "dd"))
    t = data_task(tmp_path / "dd", eval_prompts=4)
    assert len(t.examples) == 30 and len(t.train) == 30
    assert [e.prompt for e in t.heldout(0, 100)] == [r["prompt"] for r in ROWS[30:34]]
    assert t.heldout(0, 1)[0].where == f"{tmp_path / 'dd'} [test]: row 0"


def test_the_row_is_passed_as_loaded_with_every_column(tmp_path):
    t = data_task(jsonl(tmp_path / "d.jsonl", ROWS))
    assert t.examples[5].row == ROWS[5] and t.examples[5].index == 5


# -- refusals: one line naming the file and the row ---------------------------------------------
@pytest.mark.parametrize(
    "content,key,message",
    [
        ('{"prompt": "a", "answer": "1"}\n{"prompt": 7, "answer": "2"}\n', {},
         ":2: the prompt ('prompt') is int 7, not text"),
        ('{"prompt": "a", "answer": "1"}\n{"prompt": {"x": 1}, "answer": "2"}\n', {}, ":2: the prompt ('prompt') is dict"),
        ('{"prompt": "a", "answer": "1"}\n\n{"prompt": "  ", "answer": "2"}\n', {}, ":3: the prompt ('prompt') is empty"),
        ('{"question": "a", "answer": "1"}\n', {}, ":1: no 'prompt' (--prompt-key); the row has: question, answer"),
        ('{"q": "a", "a": "1"}\n', {"prompt_key": "q"}, ":1: no 'answer' (--answer-key; '' for none); the row has: q, a"),
        ('{"prompt": "a", "answer": null}\n', {}, ":1: the answer ('answer') is null"),
        ('{"prompt": "a", "answer": "1"}\n[1, 2]\n', {}, ":2: expected a JSON object, got list"),
        ('{"prompt": "a", "answer": "1"}\n{nope\n', {}, ":2: expected a JSON object (Expecting property name"),
        ("\n\n", {}, ": no rows"),
    ],
)  # fmt: skip
def test_bad_rows_are_refused_naming_file_and_row(tmp_path, content, key, message):
    path = tmp_path / "d.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError) as e:
        data_task(path, **key)
    assert str(e.value).startswith(str(path)) and message in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


def test_a_missing_column_of_a_columnar_file_names_the_columns(tmp_path):
    import pandas as pd

    pd.DataFrame([{"question": "a", "answer": 1}]).to_parquet(tmp_path / "d.parquet")
    with pytest.raises(
        ValueError, match=r"d\.parquet: no column 'prompt' \(--prompt-key\); columns: question, answer"
    ):
        data_task(tmp_path / "d.parquet")
    pd.DataFrame([{"prompt": "a", "answer": 1}, {"prompt": None, "answer": 2}]).to_parquet(
        tmp_path / "n.parquet"
    )
    with pytest.raises(ValueError, match=r"n\.parquet: row 1: the prompt \('prompt'\) is null, not text"):
        data_task(tmp_path / "n.parquet")


def test_unreadable_files_and_directories_are_refused_in_one_line(tmp_path):
    (tmp_path / "bin").write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff")
    (tmp_path / "bad.parquet").write_text("hello")
    (tmp_path / "dir").mkdir()
    for path, message in [
        (tmp_path / "missing.jsonl", "--task-data {p}: not a file"),
        (tmp_path / "bin", "--task-data {p}: 'utf-8' codec can't decode byte 0x89 in position 0"),
        (tmp_path / "bad.parquet", "--task-data {p}: not readable as parquet: "),
        (
            tmp_path / "dir",
            "--task-data {p}: a directory, but not a dataset saved with datasets' save_to_disk",
        ),
    ]:
        with pytest.raises(ValueError) as e:
            data_task(path)
        assert str(e.value).startswith(message.format(p=path)) and "\n" not in str(e.value), str(e.value)


def test_settings_a_task_does_not_take_are_refused_not_ignored(tmp_path):
    for cfg, message in [
        (
            TaskConfig(task="pattern", data="x.jsonl"),
            "--task-data: the pattern task generates its own prompts",
        ),
        (TaskConfig(prompt_key="q"), "--prompt-key: the pattern task generates its own prompts"),
        (TaskConfig(eval_data="e.jsonl"), "--eval-data: the pattern task"),
        (TaskConfig(data="x.jsonl"), "--task-data x.jsonl: a dataset needs --reward module:function"),
        (TaskConfig(task="data", reward=REWARD), "--task data needs --data PATH"),
        (TaskConfig(data="x.jsonl", reward="nocolon"), "--reward 'nocolon': expected module:function"),
        (
            TaskConfig(data="x.jsonl", reward="missing.py:f"),
            "--reward missing.py:f: missing.py: no such file",
        ),
        (TaskConfig(task="chess"), "--task 'chess': choose one of pattern, boxed, data"),
    ]:
        with pytest.raises(ValueError, match="^" + __import__("re").escape(message)):
            check_config(cfg)


# -- order, held-out split ------------------------------------------------------------------------
def test_each_epoch_visits_every_training_row_once_in_a_seeded_order(tmp_path):
    t = data_task(jsonl(tmp_path / "d.jsonl", ROWS), eval_prompts=8)
    train = set(t.train)
    assert len(train) == 32 and not train & {e.index for e in t.heldout(0, 8)}  # never trained on
    n = 5  # 32 rows / 5 per step: epochs end mid-step
    seen = [e.index for s in range(64) for e in t.batch(3, s, n)]  # 10 epochs
    for epoch in range(10):
        assert sorted(seen[epoch * 32 : (epoch + 1) * 32]) == sorted(train), epoch
    assert seen[:32] != seen[32:64]  # reshuffled per epoch
    again = data_task(jsonl(tmp_path / "e.jsonl", ROWS), eval_prompts=8)
    # a pure function of (seed, step): another task object over the same rows, step 17 alone
    assert [e.index for e in again.batch(3, 17, n)] == seen[17 * n : 18 * n]
    assert [e.index for e in again.batch(4, 0, 32)] != seen[:32]  # another seed, another order


def test_the_held_out_split_is_the_same_for_every_seed_and_at_most_a_quarter(tmp_path):
    t = data_task(jsonl(tmp_path / "d.jsonl", ROWS), eval_prompts=16)
    assert len(t.heldout(0, 100)) == 10 and len(t.train) == 30  # 40 rows: a quarter
    assert t.heldout(0, 10) == t.heldout(5, 10)
    assert "10 of 40 rows held out" in t.notes[0]
    small = data_task(jsonl(tmp_path / "s.jsonl", ROWS[:3]), eval_prompts=16)
    assert len(small.train) == 3 and "too few to hold any out" in small.notes[0]


def test_eval_data_is_held_out_and_every_row_of_the_data_trains(tmp_path):
    evals = [{"prompt": f"held {i}", "answer": "x"} for i in range(20)]
    t = data_task(
        jsonl(tmp_path / "d.jsonl", ROWS), eval_data=str(jsonl(tmp_path / "e.jsonl", evals)), eval_prompts=6
    )
    assert len(t.train) == 40 and [e.prompt for e in t.heldout(0, 6)] == [f"held {i}" for i in range(6)]
    assert len(t.sizing(0)) == 46
    with pytest.raises(ValueError, match=r"e2\.jsonl:1: no 'prompt'"):
        data_task(tmp_path / "d.jsonl", eval_data=str(jsonl(tmp_path / "e2.jsonl", [{"q": "a"}])))
    with pytest.raises(ValueError, match=r"^--eval-data .*nope\.jsonl: not a file"):
        data_task(tmp_path / "d.jsonl", eval_data=str(tmp_path / "nope.jsonl"))


def test_the_pattern_task_is_the_same_generator_as_before():
    """Its prompts are drawn as the rollout drew them before tasks became pluggable (stream 0 of
    (seed, step)), its held-out ones from stream 2 of EVAL_STREAM: runs are bit-identical."""
    t = PatternTask()
    assert t.batch(0, 3, 16) == t.sample(np.random.default_rng([0, 3, 0]), 16)
    assert t.heldout(0, 4) == t.sample(np.random.default_rng([0, 2**31 - 1, 2]), 4)
    ex = t.batch(0, 0, 8)
    for e in ex:
        for c in (e.answer, e.answer[:2] + "zz", ""):
            assert pattern_reward(e.prompt, c, e.row) == t.reward(c, e)


# -- prompts as the model sees them ------------------------------------------------------------------
def test_the_chat_template_applies_to_dataset_prompts_unless_off(tok):
    text = render(tok, "What is 2+2?", templated=True, mode="auto")
    assert text == "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert render(tok, "What is 2+2?", templated=True, mode="off") == "What is 2+2?"
    assert render(tok, "abcab", templated=False, mode="auto") == "abcab"  # pattern: never
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert render(tok, chat, True, "auto").startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    with pytest.raises(
        ValueError, match=r"d\.jsonl:4: a list of messages needs a chat template \(--chat-template off\)"
    ):
        render(tok, chat, True, "off", "d.jsonl:4")


def test_a_prompt_longer_than_the_context_is_refused_naming_its_row(tok, tmp_path):
    rows = [{"prompt": "short", "answer": "1"}, {"prompt": "x" * 100, "answer": "2"}]
    t = data_task(jsonl(tmp_path / "d.jsonl", rows))
    assert check_lengths(tok, t.sizing(0), True, "off", 8, 200, "--context-length") == 100
    with pytest.raises(ValueError) as e:
        check_lengths(tok, t.sizing(0), True, "auto", 8, 100, "--context-length")
    assert str(e.value) == (f"{tmp_path / 'd.jsonl'}:2: the prompt is 119 tokens; with --max-new-tokens 8 it "
                            "needs a context of 128, and the run allows 100 (--context-length)")  # fmt: skip


def test_a_prompt_longer_than_the_tokenizers_maximum_is_refused_without_its_warning(tmp_path):
    """Our refusal is the one line: transformers' "Token indices sequence length is longer than the
    specified maximum" warning (the tokenizer's ``model_max_length``, 32768 here) is not printed
    when we tokenize; the same tokenizer called as transformers' default does warn (the control)."""
    import logging

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(TOKENIZER))  # its own: the warning is given once per tokenizer
    long = "x " * tok.model_max_length
    t = data_task(jsonl(tmp_path / "d.jsonl", [{"prompt": long, "answer": "1"}]))
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    handler, log = Keep(level=logging.WARNING), logging.getLogger("transformers")
    log.addHandler(handler)
    try:
        with pytest.raises(ValueError, match=r"d\.jsonl:1: the prompt is \d+ tokens"):
            check_lengths(tok, t.sizing(0), True, "off", 8, 1024, "--context-length")
        assert not [m for m in seen if "Token indices sequence length" in m], seen
        tok([long], add_special_tokens=False)
        assert [m for m in seen if "Token indices sequence length" in m], seen
    finally:
        log.removeHandler(handler)


# -- the boxed task ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "got,want",
    [("72", True), ("72.0", True), ("\\frac{144}{2}", True), ("144/2", True), ("$72$", True), ("72.00", True),
     ("73", False), ("72.5", False), ("", False), ("x", False)],
)  # fmt: skip
def test_math_answers_are_compared_as_math(got, want):
    assert math_equal(got, "72") is want
    assert boxed_reward(f"so the answer is \\boxed{{{got}}}", "18 * 4 = 72\n#### 72") == float(want)


def test_the_boxed_reward_reads_the_answer_column_the_task_names(monkeypatch):
    assert reward("q", "\\boxed{\\frac{1}{2}}", {"answer": "0.5"}) == 1.0
    monkeypatch.setenv("MLLM_RL_ANSWER_KEY", "solution")
    assert reward("q", "\\boxed{0.5}", {"solution": "#### 1/2", "answer": "9"}) == 1.0


def test_the_boxed_task_is_a_dataset_with_its_own_prompt_and_keys(tmp_path):
    t = get_task("boxed")
    assert t.reward_spec == "mllm_rl.tasks.boxed:reward" and len(t.examples) == 24
    assert t.examples[0].prompt.endswith("Please put the final answer within \\boxed{}.\n")
    rows = [{"problem": f"p{i}", "solution": f"#### {i}"} for i in range(8)]
    t = get_task("boxed", str(jsonl(tmp_path / "m.jsonl", rows)), prompt_key="problem", answer_key="solution")
    assert t.examples[3].answer == "#### 3" and t.scorer.env["MLLM_RL_ANSWER_KEY"] == "solution"
    with pytest.raises(ValueError, match=r"m2\.jsonl:1: the answer \('answer'\) has no target"):
        get_task("boxed", str(jsonl(tmp_path / "m2.jsonl", [{"question": "q", "answer": "#### "}])))


def test_build_task_takes_the_run_settings():
    t = build_task(TaskConfig(task="boxed", eval_prompts=4, reward="mllm_rl.tasks.pattern:reward"))
    assert t.reward_spec == "mllm_rl.tasks.pattern:reward" and len(t.heldout(0, 100)) == 4
    assert isinstance(t.examples[0], Example)


def test_a_hub_id_the_hub_cannot_give_is_one_line_naming_it(monkeypatch):
    """No network here: with the Hub offline, ``org/name`` is refused in one line naming the flag."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError) as e:
        read_table("nobody-here/no-such-dataset:main", "--data")
    msg = str(e.value)
    assert msg.startswith("--data nobody-here/no-such-dataset:main: no such local file or directory, and the "
                          "Hugging Face Hub did not give the dataset: ") and "\n" not in msg  # fmt: skip


def test_a_hub_dataset_trains_on_train_and_holds_out_test(monkeypatch):
    """``org/name:config`` goes to ``datasets.load_dataset(name, config)`` and its splits are used as a
    saved DatasetDict's (a fake stands in for the Hub, which this machine cannot reach)."""
    import datasets

    asked = []

    def fake_load_dataset(name, config=None, **kw):
        asked.append((name, config))
        return datasets.DatasetDict({"train": datasets.Dataset.from_list([{"question": "1+1", "answer": "2"}] * 8),
                                     "test": datasets.Dataset.from_list([{"question": "2+2", "answer": "4"}] * 2)})  # fmt: skip

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    t = read_table("someone/math-set:main", "--data")
    assert asked == [("someone/math-set", "main")]
    assert len(t.rows) == 8 and t.split == "train" and t.heldout is not None and len(t.heldout.rows) == 2
    assert t.where(0) == "someone/math-set:main [train]: row 0"


def test_a_local_path_that_looks_like_a_hub_id_is_read_locally(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "rows").write_text('{"prompt": "p", "answer": "a"}\n')
    assert read_table("org/rows").rows == ({"prompt": "p", "answer": "a"},)
    with pytest.raises(ValueError, match="--task-data org/missing.jsonl: not a file"):
        read_table("org/missing.jsonl")
