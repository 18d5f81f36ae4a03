"""``--tasks`` files and the port allocator: bad input is one line naming file, task and field."""

from __future__ import annotations

import dataclasses
import json
import socket

import pytest

from mllm_rl.multitask.plan import BLOCK, PortAllocator, allocate, port_free
from mllm_rl.multitask.spec import TaskSpec, load_tasks
from mllm_rl.options.schema import in_scope
from mllm_rl.plans.preflight import build_options
from mllm_rl.run import parse_args
from tests.conftest import run_cli

GOOD = """
[defaults]
steps = 3
group_size = 4

[[task]]
name = "small"
seed = 1
lr = 1

[[task]]
name = "other-2"
model = "ckpt"
task = "boxed"
task_data = "data.jsonl"
lora_rank = 4
steps = 5
"""


def write(tmp_path, text, name="tasks.toml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_good_file_defaults_and_relative_paths(tmp_path):
    (tmp_path / "ckpt").mkdir()
    a, b = load_tasks(write(tmp_path, GOOD))
    assert (a.name, a.steps, a.group_size, a.seed, a.lr, a.model) == ("small", 3, 4, 1, 1.0, "tiny")
    assert (b.steps, b.lora_rank, b.task) == (5, 4, "boxed")
    assert b.model == str(tmp_path / "ckpt") and b.task_data == str(tmp_path / "data.jsonl")
    opts = a.rl_options()
    assert opts.train.lr == 1.0 and opts.train.seed == 1 and opts.group_size == 4 and opts.seed == 1


def test_a_tasks_files_dataset_eval_data_and_reward_file_are_relative_to_it(tmp_path):
    """A task's own data, held-out data and reward file resolve against the TOML file's folder (the
    run may start anywhere); a reward given as a module stays as it is."""
    text = ('[[task]]\nname = "mine"\ntask_data = "d/train.jsonl"\neval_data = "d/test.jsonl"\n'
            'prompt_key = "question"\nreward = "r/score.py:score"\nreward_timeout = 5.0\n'
            '[[task]]\nname = "mod"\ntask_data = "/abs/x.jsonl"\nreward = "my.module:fn"\n')  # fmt: skip
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "score.py").write_text("def score(prompt, completion, row):\n    return 0.0\n")
    mine, mod = load_tasks(write(tmp_path, text))
    assert mine.task_data == str(tmp_path / "d" / "train.jsonl")
    assert mine.eval_data == str(tmp_path / "d" / "test.jsonl")
    assert mine.reward == f"{tmp_path / 'r' / 'score.py'}:score" and mine.prompt_key == "question"
    assert (mod.task_data, mod.reward) == ("/abs/x.jsonl", "my.module:fn")
    cfg = mine.rl_options().task_config
    assert (cfg.name, cfg.prompt_key, cfg.reward_timeout, cfg.eval_data) == ("data", "question", 5.0,
                                                                             mine.eval_data)  # fmt: skip


@pytest.mark.parametrize(
    "text, match",
    [
        ('[[task]]\nname = "a"\nstepz = 3\n', r"task 0 \('a'\): unknown field 'stepz'"),
        ('[[task]]\nname = "a"\nsteps = "3"\n', r"task 0 \('a'\)\.steps: expected int"),
        ('[[task]]\nname = "a"\nlr = true\n', r"\.lr: expected float"),
        ("[[task]]\nsteps = 3\n", r"task 0 \(unnamed\): field 'name' is required"),
        ('[[task]]\nname = "a b"\n', r"\.name: 'a b' must match"),
        ('[[task]]\nname = "a"\n[[task]]\nname = "a"\n', r"task name 'a' is used twice"),
        ('[[task]]\nname = "a"\nsteps = 0\n', r"task 'a': steps must be >= 1"),
        ('[[task]]\nname = "a"\nestimator = "x"\n', r"task 'a': estimator 'x'"),
        ('[defaults]\nname = "x"\n[[task]]\nname = "a"\n', r"\[defaults\] cannot set 'name'"),
        ("[[task]]\nname = \n", r"not valid TOML"),
        ("x = 1\n", r"unknown table\(s\) \['x'\]"),
        ("[defaults]\nsteps = 1\n", r"no \[\[task\]\] table"),
    ],
)
def test_bad_files_name_file_task_and_field(tmp_path, text, match):
    path = write(tmp_path, text)
    with pytest.raises(ValueError, match=match) as e:
        load_tasks(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_cli_bad_tasks_file_exits_2_before_anything_starts(tmp_path):
    path = write(tmp_path, '[[task]]\nname = "a"\nsteps = -1\n')
    r = run_cli("mllm_rl.run", "--backend", "jax", "--tasks", str(path), "--run-dir", str(tmp_path / "run"))
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [f"error: {path}: task 'a': steps must be >= 1, got -1"]
    assert not (tmp_path / "run").exists()
    r = run_cli("mllm_rl.run", "--backend", "jax", "--tasks", str(tmp_path / "missing.toml"))
    assert r.returncode == 2 and "cannot read" in r.stderr


def test_cli_bad_data_file_of_one_task_exits_2(tmp_path):
    path = write(
        tmp_path, '[[task]]\nname = "a"\n[[task]]\nname = "m"\ntask = "boxed"\ntask_data = "nope.jsonl"\n'
    )
    r = run_cli("mllm_rl.run", "--backend", "jax", "--tasks", str(path), "--run-dir", str(tmp_path / "run"))
    assert r.returncode == 2 and "task 'm'" in r.stderr and "nope.jsonl" in r.stderr, r.stderr


def test_ports_blocks_are_disjoint_bind_tested_and_skip_busy_ports():
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        busy = s.getsockname()[1]
        assert not port_free(busy)
        alloc = PortAllocator(first=busy - 3, last=busy + 2 * BLOCK + 3)
        a = alloc.block("a")
        assert busy not in a and a[0] == busy + 1 and len(a) == BLOCK
        b = alloc.block("b")
        assert not set(a) & set(b) and all(port_free(p) for p in a + b)
        with pytest.raises(ValueError, match="already allocated"):
            alloc.block("a")
        with pytest.raises(RuntimeError, match="no 8 consecutive free ports"):
            alloc.block("c")


def test_allocate_never_hands_a_port_out_twice_even_if_it_looks_free():
    ports = allocate(["a", "b", "c"], PortAllocator(30000, 30100, is_free=lambda p: p % 10 != 7))
    flat = [p for ps in ports.values() for p in ps]
    assert len(flat) == len(set(flat)) == 3 * BLOCK and not any(p % 10 == 7 for p in flat)


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (["--engine", "sglang"], "not an engine of the jax backend"),
        (["--tp", "3"], "not divisible by --tp 3"),
        (["--plan", "swap"], "--plan swap"),
        (["--resume-or-start"], "--resume-or-start"),
    ],
)
def test_cli_run_level_flags_are_checked_per_task_before_anything_starts(tmp_path, flags, match):
    path = tmp_path / "t.toml"
    path.write_text('[[task]]\nname = "m"\n')
    run = tmp_path / "run"
    r = run_cli("mllm_rl.run", "--backend", "jax", "--tasks", str(path), "--run-dir", str(run), *flags)
    assert r.returncode == 2 and match in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not run.exists()


def test_save_every_is_an_alias_of_checkpoint_every(tmp_path):
    path = tmp_path / "t.toml"
    path.write_text(
        '[defaults]\nsave_every = 3\n\n[[task]]\nname = "a"\n\n[[task]]\nname = "b"\ncheckpoint_every = 1\n'
    )
    a, b = load_tasks(path)
    assert (a.checkpoint_every, b.checkpoint_every) == (3, 1)
    assert a.rl_options().checkpoint_every == 3 and b.rl_options().engine.task == "b"


def test_a_task_gets_the_options_the_same_flags_give():
    """A task key is the flag of the same name: one declaration, one builder (``RLPlan.options``)."""
    settings = {"lr": 1e-5, "temperature": 0.7, "lora_rank": 4, "precision": "pure", "steps": 3,
                "eval_prompts": 5, "checkpoint_every": 2, "max_new_tokens": 12, "tis_cap": 2.0}  # fmt: skip
    flags = [x for k, v in settings.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    cli = build_options(parse_args(["--backend", "jax", *flags])[0])
    task = TaskSpec(name="t", **settings).rl_options()
    assert dataclasses.replace(task, engine=dataclasses.replace(task.engine, task=None)) == cli
    assert task.engine.task == "t" and task.train.lr == 1e-5 and task.eval_prompts == 5
    assert set(TaskSpec.__dataclass_fields__) == {"name", *(o.key for o in in_scope("task"))}


@pytest.mark.parametrize(
    "text, match",
    [
        ('[[task]]\nname = "a"\nlr = nan\n', r"task 'a': lr must be a finite number, got nan"),
        ('[[task]]\nname = "a"\ntop_p = 1.5\n', r"task 'a': top_p must be <= 1, got 1.5"),
        (
            '[[task]]\nname = "a"\nprecision = "fp8"\n',
            r"task 'a': precision 'fp8': choose one of mixed, pure",
        ),
        ('[[task]]\nname = "a"\ntp = 2\n', r"'tp' is a run-level setting, not a task's: pass it as --tp"),
    ],
)
def test_a_task_key_is_checked_like_its_flag(tmp_path, text, match):
    with pytest.raises(ValueError, match=match):
        load_tasks(write(tmp_path, text))


def test_per_task_flags_next_to_tasks_are_refused_not_ignored(tmp_path):
    path = write(tmp_path, '[[task]]\nname = "a"\n')
    r = run_cli("mllm_rl.run", "--backend", "jax", "--tasks", str(path), "--steps", "3", "--lr", "0.1")
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"error: --steps 3: with --tasks it is set per task: put steps in {path}'s [[task]] or [defaults] table"
    ]


def test_a_resumed_task_with_a_changed_setting_is_refused_unless_overridden(tmp_path):
    from mllm_rl.options.resume import compare_tasks, task_record

    path = write(tmp_path, '[[task]]\nname = "a"\nlr = 1e-5\n[[task]]\nname = "b"\n')
    (a, b) = load_tasks(path)
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(
        json.dumps({"run_id": "mt", "task_options": {"a": task_record(a), "b": task_record(b)}})
    )
    write(tmp_path, '[[task]]\nname = "a"\nlr = 2e-5\n[[task]]\nname = "b"\n[[task]]\nname = "new"\n')
    r = run_cli("mllm_rl.run", "--backend", "jax", "--tasks", str(path), "--resume", "--run-dir", str(run))
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"error: {path}: task 'a': lr 2e-05: {run / 'run.json'} was run with 1e-05; resuming with another value "
        f"changes what is trained: pass --override lr to accept it"
    ]
    changes = compare_tasks(
        load_tasks(path), {"a": task_record(a), "b": task_record(b)}, ["lr"], str(path), run
    )
    assert changes == [{"task": "a", "key": "lr", "from": 1e-05, "to": 2e-05}]  # "new" starts fresh


def test_run_json_records_the_data_eval_data_and_reward_file_absolute(tmp_path, monkeypatch):
    """``--data``, ``--eval-data`` and a reward file given relative to the working directory are
    recorded absolute, so a --resume started elsewhere reads the same files; modules as given."""
    from mllm_rl.options.resume import record

    for f in ("train.jsonl", "test.jsonl", "score.py"):
        (tmp_path / f).write_text("")
    monkeypatch.chdir(tmp_path)
    args = parse_args(["--backend", "jax", "--data", "train.jsonl", "--eval-data", "test.jsonl",
                       "--reward", "score.py:score"])[0]  # fmt: skip
    rec = record(args, "rl")
    assert rec["task_data"] == str(tmp_path / "train.jsonl") and rec["eval_data"] == str(
        tmp_path / "test.jsonl"
    )
    assert rec["reward"] == f"{tmp_path / 'score.py'}:score"
    args = parse_args(["--backend", "jax", "--data", "train.jsonl", "--reward", "pkg.mod:fn"])[0]
    assert record(args, "rl")["reward"] == "pkg.mod:fn"


def test_docs_list_every_key_a_task_takes():
    """docs/MULTITASK.md's ``Keys:`` list is the schema's ``task`` options and ``name``, no more."""
    import re

    from mllm_rl.multitask.spec import TASK_OPTIONS
    from tests.conftest import ROOT

    doc = (ROOT / "docs" / "MULTITASK.md").read_text()
    start = doc.index("Keys: `") + len("Keys: `")
    listed = set(re.sub(r"\(or \w+\)", "", doc[start : doc.index("`", start)]).split())
    assert listed == {"name", *TASK_OPTIONS}, (
        sorted(set(TASK_OPTIONS) - listed),
        sorted(listed - set(TASK_OPTIONS)),
    )
