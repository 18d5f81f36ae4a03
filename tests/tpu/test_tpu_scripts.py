"""tpu/tpu.sh against a FAKE gcloud (tests/tpu/fake_gcloud.py) and fake TPU workers.

What is checked: the --dry-run command sequence against the manual param-swap procedure (docs/TPU.md, "Step by step"), zone fallback and
fail-fast on create, wait's retries, setup's idempotence (marker per commit), that secrets never
reach a command line, the run's TPU assertion and launch, fetch, and watch's recovery from
preemption with a bound. Nothing here talks to Google Cloud.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TPU_SH = ROOT / "tpu" / "tpu.sh"
DRY = "DRY-RUN: "
COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO_URL = "https://example.invalid/org/mllm_rl.git"
NAME = "tpu-a"
ZONE = "us-central2-b"
TARGET = ["--project", "proj-1", "--zone", ZONE, "--name", NAME]
REPO = ["--repo-url", REPO_URL, "--commit", COMMIT]
SECRET = "wandb-secret-0123456789abcdef"

CAPACITY = "ERROR: (gcloud.alpha.compute.tpus.tpu-vm.create) {code}"
PREFIX = ["compute", "tpus", "tpu-vm"]  # the GA group: no `gcloud alpha`
# zone fallback needs a generation offered in several zones: v6e (v4 exists in us-central2-b only)
V6E = ["--type", "v6e-8"]
Z1, Z2 = "us-east5-b", "europe-west4-a"
HOSTKEY = "--strict-host-key-checking=no"


def dry_commands(stdout: str) -> list[list[str]]:
    """The gcloud commands a --dry-run printed, each split as a shell would."""
    return [shlex.split(line[len(DRY) :]) for line in stdout.splitlines() if line.startswith(DRY)]


def cverb(call: list[str]) -> str:
    """The verb (create, ssh, ...) of a call the fake gcloud recorded (argv without 'gcloud')."""
    return call[3]


def dverb(cmd: list[str]) -> str:
    """The verb of a command a --dry-run printed (starting with 'gcloud')."""
    return cmd[4]


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("tpu.sh: error:")]


def flag(cmd: list[str], name: str) -> str | None:
    for a in cmd:
        if a.startswith(f"--{name}="):
            return a.split("=", 1)[1]
    return None


def write_env(tmp: Path) -> Path:
    p = tmp / "secrets.env"
    p.write_text(f"WANDB_API_KEY={SECRET}\nHF_TOKEN=hf_not_a_real_token\n")
    return p


# ---------------------------------------------------------------- usage


def test_help_lists_subcommands_and_flags(fake_cloud):
    r = fake_cloud.run("--help")
    assert r.returncode == 0
    for sub in ("create", "wait", "setup", "env", "run", "watch", "fetch", "delete", "up"):
        assert f"  {sub} " in r.stdout
    r = fake_cloud.run("create", "--help")
    assert r.returncode == 0
    for f in ("--zones", "--spot", "--on-demand", "--queued", "--version", "--type", "--dry-run"):
        assert f in r.stdout
    for f in (
        "--valid-until-duration",
        "--any-zone",
        "us-central2-b",
        "gcloud compute tpus queued-resources create",
    ):
        assert f in r.stdout
    assert "gcloud alpha" not in r.stdout
    r = fake_cloud.run("run", "--help")
    assert r.returncode == 0 and "--jax-dist" in r.stdout and "MLLM_RL_COORDINATOR" in r.stdout
    assert fake_cloud.calls() == []


@pytest.mark.parametrize("drop,word", [("--project", "project"), ("--zone", "zone"), ("--name", "name")])
def test_missing_target_exits_2_with_one_line(fake_cloud, drop, word):
    args = list(TARGET)
    i = args.index(drop)
    del args[i : i + 2]
    r = fake_cloud.run("create", *args)
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and word in r.stderr.lower()
    assert fake_cloud.calls() == []


def test_project_from_env(fake_cloud):
    args = TARGET[2:]  # no --project
    r = fake_cloud.run("create", "--dry-run", *args, env={"CLOUDSDK_CORE_PROJECT": "from-env"})
    assert r.returncode == 0, r.stderr
    assert flag(dry_commands(r.stdout)[0], "project") == "from-env"
    r = fake_cloud.run(
        "create", "--dry-run", *args, env={"TPU_PROJECT": "tpu-env", "CLOUDSDK_CORE_PROJECT": "x"}
    )
    assert flag(dry_commands(r.stdout)[0], "project") == "tpu-env"


def test_unknown_flag_and_type_exit_2(fake_cloud):
    assert fake_cloud.run("create", *TARGET, "--bogus").returncode == 2
    r = fake_cloud.run("create", *TARGET, "--type", "v3-8")
    assert r.returncode == 2 and "v3-8" in r.stderr
    assert fake_cloud.calls() == []


# ---------------------------------------------------------------- dry-run = the manual procedure


def test_dry_run_up_v4_8_spot_reproduces_the_sop(fake_cloud):
    env_file = write_env(fake_cloud.tmp)
    r = fake_cloud.run(
        "up",
        "--dry-run",
        *TARGET,
        "--type",
        "v4-8",
        *REPO,
        "--env-file",
        str(env_file),
        "--run-id",
        "r1",
        "--",
        "--plan",
        "swap",
        "--model",
        "Qwen/Qwen3-4B",
        "--tp",
        "4",
    )
    assert r.returncode == 0, r.stderr
    assert fake_cloud.calls() == [], "--dry-run must not call gcloud"
    cmds = dry_commands(r.stdout)
    assert all(c[0] == "gcloud" and c[1:4] == PREFIX for c in cmds)
    # 1) create, exactly as in the manual procedure
    assert cmds[0] == [
        "gcloud",
        *PREFIX,
        "create",
        NAME,
        "--project=proj-1",
        f"--zone={ZONE}",
        "--accelerator-type=v4-8",
        "--version=tpu-ubuntu2204-base",
        "--spot",
        "--quiet",
    ]
    # 2) describe for the state, 3) SSH on every worker
    assert cmds[1][4:6] == ["describe", NAME] and flag(cmds[1], "format") == "value(state)"
    ssh = [c for c in cmds if dverb(c) == "ssh"]
    assert all(flag(c, "worker") == "all" and "--quiet" in c for c in ssh)
    # host keys through gcloud's own flag; an -oStrictHostKeyChecking ssh flag would have no effect
    assert all(HOSTKEY in c for c in ssh + [c for c in cmds if dverb(c) == "scp"])
    assert not any("stricthostkeychecking" in a.lower() for c in cmds for a in c)
    assert flag(cmds[2], "command") == "true"
    scripts = [flag(c, "command") for c in ssh]
    setup = next(s for s in scripts if "mllm_rl_setup_ok" in s)
    assert f"git clone -q {REPO_URL}" in setup and f"C={COMMIT}" in setup
    assert (
        'pip install -q -e "$D[jax,tpu,wandb]" -f https://storage.googleapis.com/jax-releases/libtpu_releases.html'
        in setup
    )
    run = next(s for s in scripts if "mllm_rl_launch" in s)
    assert (
        "-m mllm_rl.run --backend jax --run-id" in run and "--plan swap --model Qwen/Qwen3-4B --tp 4" in run
    )
    # env goes by scp of the file (the secret is not printed), fetch by scp --recurse per worker
    scps = [c for c in cmds if dverb(c) == "scp"]
    assert any(
        str(env_file) in c and f"{NAME}:.mllm_rl.env" in c and flag(c, "worker") == "all" for c in scps
    )
    assert any("--recurse" in c and f"{NAME}:mllm_rl/runs/r1" in c and flag(c, "worker") == "0" for c in scps)
    assert SECRET not in r.stdout + r.stderr
    # the EXIT trap deletes last
    assert cmds[-1] == ["gcloud", *PREFIX, "delete", NAME, "--project=proj-1", f"--zone={ZONE}", "--quiet"]
    order = [dverb(c) for c in cmds]
    assert order.index("create") < order.index("describe") < order.index("ssh") < order.index("scp")


def test_dry_run_up_keep_does_not_delete(fake_cloud):
    r = fake_cloud.run(
        "up", "--dry-run", "--keep", *TARGET, *REPO, "--env-file", str(write_env(fake_cloud.tmp))
    )
    assert r.returncode == 0, r.stderr
    assert "delete" not in [dverb(c) for c in dry_commands(r.stdout)]


@pytest.mark.parametrize(
    "accel,version,zone",
    [
        ("v4-8", "tpu-ubuntu2204-base", "us-central2-b"),
        ("v4-32", "tpu-ubuntu2204-base", "us-central2-b"),
        ("v5litepod-8", "v2-alpha-tpuv5-lite", "us-west4-a"),
        ("v6e-8", "v2-alpha-tpuv6e", "us-east5-b"),
    ],
)
def test_dry_run_create_runtime_version_per_type(fake_cloud, accel, version, zone):
    r = fake_cloud.run(
        "create", "--dry-run", "--project", "proj-1", "--zone", zone, "--name", NAME, "--type", accel
    )
    assert r.returncode == 0, r.stderr
    (cmd,) = dry_commands(r.stdout)
    assert flag(cmd, "accelerator-type") == accel and flag(cmd, "version") == version and "--spot" in cmd
    assert flag(cmd, "zone") == zone


def test_dry_run_create_version_override_on_demand_and_queued(fake_cloud):
    r = fake_cloud.run("create", "--dry-run", *TARGET, "--version", "custom-img", "--on-demand")
    (cmd,) = dry_commands(r.stdout)
    assert flag(cmd, "version") == "custom-img" and "--spot" not in cmd
    r = fake_cloud.run("create", "--dry-run", *TARGET, "--queued")
    (cmd,) = dry_commands(r.stdout)
    assert cmd[1:6] == ["compute", "tpus", "queued-resources", "create", NAME]
    assert (
        flag(cmd, "node-id") == NAME
        and flag(cmd, "runtime-version") == "tpu-ubuntu2204-base"
        and "--spot" in cmd
    )
    assert flag(cmd, "valid-until-duration") == "12h"  # the default request lifetime
    r = fake_cloud.run("delete", "--dry-run", *TARGET, "--queued")
    (cmd,) = dry_commands(r.stdout)
    assert cmd[3:5] == ["queued-resources", "delete"] and "--force" in cmd


def test_dry_run_fetch_per_worker_of_a_pod_slice(fake_cloud):
    r = fake_cloud.run("fetch", "--dry-run", *TARGET, "--type", "v4-32", "--run-id", "r9")
    assert r.returncode == 0, r.stderr
    rec = [c for c in dry_commands(r.stdout) if dverb(c) == "scp" and "--recurse" in c]
    assert [flag(c, "worker") for c in rec] == ["0", "1", "2", "3"]  # v4-32: 16 chips, 4 hosts


# ---------------------------------------------------------------- create


@pytest.mark.parametrize(
    "code",
    [
        'RESOURCE_EXHAUSTED: There is no more capacity in the zone "us-central2-b"',
        "Insufficient capacity for the requested accelerator",
        "Code: 8, stockout in zone",
    ],
)
def test_create_falls_back_to_next_zone_on_capacity(fake_cloud, code):
    fake_cloud.scenario(create_errors={Z1: [CAPACITY.format(code=code)]})
    args = ["--project", "proj-1", "--zones", f"{Z1},{Z2}", "--name", NAME, *V6E]
    r = fake_cloud.run("create", *args)
    assert r.returncode == 0, r.stderr
    creates = [c for c in fake_cloud.calls() if cverb(c) == "create"]
    assert [flag(c, "zone") for c in creates] == [Z1, Z2]
    assert fake_cloud.db()["vms"][NAME]["zone"] == Z2
    assert "no capacity" in r.stderr


def test_later_subcommands_find_the_zone_the_vm_landed_in(fake_cloud):
    capacity = CAPACITY.format(code="RESOURCE_EXHAUSTED: no more capacity")
    fake_cloud.scenario(create_errors={Z1: [capacity]})
    args = ["--project", "proj-1", "--zones", f"{Z1},{Z2}", "--name", NAME]
    assert fake_cloud.run("create", *args, *V6E).returncode == 0
    r = fake_cloud.run("wait", *args)
    assert r.returncode == 0, r.stderr
    ssh = [c for c in fake_cloud.calls() if cverb(c) == "ssh"]
    assert ssh and all(flag(c, "zone") == Z2 for c in ssh)


def test_create_no_capacity_anywhere_fails(fake_cloud):
    err = CAPACITY.format(code="RESOURCE_EXHAUSTED: no more capacity")
    fake_cloud.scenario(create_errors={Z1: [err], Z2: [err]})
    r = fake_cloud.run("create", "--project", "p", "--zones", f"{Z1},{Z2}", "--name", NAME, *V6E)
    assert r.returncode != 0 and "any zone" in r.stderr
    assert len([c for c in fake_cloud.calls() if cverb(c) == "create"]) == 2


@pytest.mark.parametrize(
    "code,word",
    [
        ("PERMISSION_DENIED: Permission 'tpu.nodes.create' denied", "PERMISSION_DENIED"),
        ("RESOURCE_EXHAUSTED: Quota 'TPUV4sPodPerProjectPerZoneForTPUAPI' exhausted", "Quota"),
        ("HTTPError 403: the caller does not have permission", "403"),
    ],
)
def test_create_fails_fast_on_quota_or_permission(fake_cloud, code, word):
    fake_cloud.scenario(create_errors={Z1: [CAPACITY.format(code=code)]})
    r = fake_cloud.run("create", "--project", "proj-1", "--zones", f"{Z1},{Z2}", "--name", NAME, *V6E)
    assert r.returncode != 0
    (line,) = error_lines(r.stderr)
    assert Z1 in line and word in line
    assert len([c for c in fake_cloud.calls() if cverb(c) == "create"]) == 1, "must not try the next zone"


def test_create_other_error_fails_fast(fake_cloud):
    fake_cloud.run("create", *TARGET)
    r = fake_cloud.run("create", *TARGET)
    assert r.returncode != 0 and "already exists" in r.stderr
    assert len(error_lines(r.stderr)) == 1


# ---------------------------------------------------------------- wait


def test_wait_polls_state_and_retries_ssh(fake_cloud):
    fake_cloud.scenario(creating_describes=2, ssh_failures=2)
    assert fake_cloud.run("create", *TARGET).returncode == 0
    r = fake_cloud.run("wait", *TARGET)
    assert r.returncode == 0, r.stderr
    verbs = fake_cloud.verbs()
    assert verbs.count("tpu-vm describe") >= 3 and verbs.count("tpu-vm ssh") == 3
    ssh = [c for c in fake_cloud.calls() if cverb(c) == "ssh"]
    assert all(flag(c, "worker") == "all" and flag(c, "command") == "true" for c in ssh)
    assert "attempt 3" in r.stderr


def test_wait_times_out_when_ssh_never_works(fake_cloud):
    fake_cloud.scenario(ssh_failures=10_000)
    fake_cloud.run("create", *TARGET)
    r = fake_cloud.run("wait", *TARGET, "--timeout", "1")
    assert r.returncode != 0
    (line,) = error_lines(r.stderr)
    assert "timed out" in line and "SSH" in line


@pytest.mark.parametrize("state", ["PREEMPTED", "TERMINATED"])
def test_wait_fails_clearly_on_terminal_state(fake_cloud, state):
    fake_cloud.scenario(initial_state=state)
    fake_cloud.run("create", *TARGET)
    r = fake_cloud.run("wait", *TARGET)
    assert r.returncode != 0 and state in r.stderr
    assert "tpu-vm ssh" not in fake_cloud.verbs()


def test_queued_create_and_wait(fake_cloud):
    fake_cloud.scenario(qr_waiting_describes=2)
    assert fake_cloud.run("create", *TARGET, "--queued").returncode == 0
    n = fake_cloud.verbs().count("queued-resources describe")  # create looks for a dead one first
    r = fake_cloud.run("wait", *TARGET, "--queued")
    assert r.returncode == 0, r.stderr
    assert fake_cloud.verbs().count("queued-resources describe") - n == 3
    assert fake_cloud.run("delete", *TARGET, "--queued").returncode == 0
    assert fake_cloud.db()["vms"] == {} and fake_cloud.db()["qrs"] == {}


# ---------------------------------------------------------------- setup


def test_setup_is_idempotent_per_commit(fake_cloud):
    fake_cloud.scenario(workers=2)
    fake_cloud.run("create", *TARGET, "--type", "v4-16")
    r1 = fake_cloud.run("setup", *TARGET, *REPO)
    assert r1.returncode == 0, r1.stderr
    for w in (0, 1):
        assert (fake_cloud.home(NAME, w) / f".mllm_rl_setup_{COMMIT}").exists()
    git = fake_cloud.remote("git")
    assert any(r["argv"][:3] == ["clone", "-q", REPO_URL] for r in git)
    assert any("checkout" in r["argv"] and r["argv"][-1] == COMMIT for r in git)
    pips = [
        r
        for r in fake_cloud.remote("python")
        if r["argv"][:4] == ["-m", "pip", "install", "-q"] and "-e" in r["argv"]
    ]
    assert len(pips) == 2 and all("[jax,tpu,wandb]" in r["argv"][5] for r in pips)
    assert all("libtpu_releases.html" in r["argv"][-1] for r in pips)
    n_remote = len(fake_cloud.remote())

    r2 = fake_cloud.run("setup", *TARGET, *REPO)
    assert r2.returncode == 0, r2.stderr
    assert r2.stderr.count("cached=1") == 2
    new = fake_cloud.remote()[n_remote:]
    assert [r["prog"] for r in new] == ["curl", "curl"], "a second setup of the same commit must do nothing"
    assert "tpu-vm scp" not in fake_cloud.verbs(), "code travels by git, never scp"

    other = "fedcba9876543210fedcba9876543210fedcba98"
    r3 = fake_cloud.run("setup", *TARGET, "--repo-url", REPO_URL, "--commit", other)
    assert r3.returncode == 0, r3.stderr
    assert any(r["argv"][-1] == other for r in fake_cloud.remote("git") if "checkout" in r["argv"])


def test_setup_installs_python312_when_missing(fake_cloud):
    fake_cloud.scenario(python312=False)
    fake_cloud.run("create", *TARGET)
    r = fake_cloud.run("setup", *TARGET, *REPO)
    assert r.returncode == 0, r.stderr
    sudo = [r["argv"] for r in fake_cloud.remote("sudo")]
    assert any("ppa:deadsnakes/ppa" in a for a in sudo)
    assert any("install" in a and "python3.12" in a for a in sudo)


def test_setup_fails_clearly_when_the_commit_is_not_pushed(fake_cloud):
    fake_cloud.run("create", *TARGET)
    r = fake_cloud.run(
        "setup", *TARGET, "--repo-url", "https://example.invalid/missing-commit.git", "--commit", COMMIT
    )
    assert r.returncode != 0
    (line,) = error_lines(r.stderr)
    assert "setup failed" in line and "not found at https://example.invalid/missing-commit.git" in line
    assert not (fake_cloud.home(NAME, 0) / f".mllm_rl_setup_{COMMIT}").exists()


# ---------------------------------------------------------------- env


def test_env_copies_file_mode_600_and_never_puts_the_secret_on_a_command_line(fake_cloud):
    fake_cloud.scenario(workers=2)
    fake_cloud.run("create", *TARGET, "--type", "v4-16")
    env_file = write_env(fake_cloud.tmp)
    r = fake_cloud.run("env", *TARGET, "--env-file", str(env_file))
    assert r.returncode == 0, r.stderr
    for w in (0, 1):
        remote = fake_cloud.home(NAME, w) / ".mllm_rl.env"
        assert remote.read_text() == env_file.read_text()
        assert remote.stat().st_mode & 0o777 == 0o600
    scp = [c for c in fake_cloud.calls() if cverb(c) == "scp"]
    assert len(scp) == 1 and flag(scp[0], "worker") == "all" and f"{NAME}:.mllm_rl.env" in scp[0]
    everything = (fake_cloud.state / "calls.jsonl").read_text() + r.stdout + r.stderr
    assert SECRET not in everything
    assert all(SECRET not in str(x) for x in fake_cloud.remote())
    r = fake_cloud.run("env", "--dry-run", *TARGET, "--env-file", str(env_file))
    assert r.returncode == 0 and SECRET not in r.stdout + r.stderr
    assert any(dverb(c) == "scp" for c in dry_commands(r.stdout))


def test_env_missing_file_exits_2(fake_cloud):
    r = fake_cloud.run("env", *TARGET, "--env-file", str(fake_cloud.tmp / "nope.env"))
    assert r.returncode == 2 and "nope.env" in r.stderr


# ---------------------------------------------------------------- run / fetch


def _ready_vm(fc, workers=1, **scenario):
    fc.scenario(workers=workers, **scenario)
    accel = "v4-8" if workers == 1 else f"v4-{8 * workers}"
    assert fc.run("create", *TARGET, "--type", accel).returncode == 0
    assert fc.run("setup", *TARGET, *REPO).returncode == 0
    return accel


def test_run_frees_the_tpu_asserts_the_platform_and_launches(fake_cloud):
    _ready_vm(fake_cloud, workers=2)
    r = fake_cloud.run("run", *TARGET, "--run-id", "r1", "--", "--plan", "swap", "--model", "Qwen/Qwen3-4B")
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("mllm_rl_run_ok") == 2
    runs = [x for x in fake_cloud.remote("python") if x["argv"][:2] == ["-m", "mllm_rl.run"]]
    # the run is started detached; wait for both fake runs to have logged
    for _ in range(100):
        if len(runs) == 2:
            break
        subprocess.run(["sleep", "0.05"])
        runs = [x for x in fake_cloud.remote("python") if x["argv"][:2] == ["-m", "mllm_rl.run"]]
    assert sorted(x["worker"] for x in runs) == [0, 1]
    for x in runs:
        assert x["argv"] == [
            "-m",
            "mllm_rl.run",
            "--backend",
            "jax",
            "--run-id",
            "r1",
            "--run-dir",
            "runs/r1",
            "--plan",
            "swap",
            "--model",
            "Qwen/Qwen3-4B",
        ]
        assert x["wandb_mode"] == "offline" and x["cwd"].endswith("/mllm_rl")
    sudo = [x["argv"] for x in fake_cloud.remote("sudo")]
    assert any(a[:2] == ["lsof", "-t"] for a in sudo), "stale TPU holders are looked for"
    assert any(x["prog"] == "pgrep" for x in fake_cloud.remote())
    for w in (0, 1):
        assert (fake_cloud.home(NAME, w) / "mllm_rl" / "runs" / f"tpu-{NAME}-w{w}.log").exists()
    assert (fake_cloud.runs / ".tpu" / f"{NAME}.run_id").read_text().strip() == "r1"


def test_run_sources_env_and_honours_wandb_flag(fake_cloud):
    _ready_vm(fake_cloud)
    fake_cloud.run("env", *TARGET, "--env-file", str(write_env(fake_cloud.tmp)))
    r = fake_cloud.run("run", *TARGET, "--run-id", "r2", "--", "--plan", "rl", "--wandb", "online")
    assert r.returncode == 0, r.stderr
    for _ in range(100):
        runs = [x for x in fake_cloud.remote("python") if x["argv"][:2] == ["-m", "mllm_rl.run"]]
        if runs:
            break
        subprocess.run(["sleep", "0.05"])
    assert runs[0]["wandb_mode"] == "online" and runs[0]["has_wandb_key"] is True


def test_run_fails_clearly_when_jax_does_not_see_a_tpu(fake_cloud):
    _ready_vm(fake_cloud, platform="cpu")
    r = fake_cloud.run("run", *TARGET, "--run-id", "r3", "--", "--plan", "swap")
    assert r.returncode != 0
    (line,) = error_lines(r.stderr)
    assert "JAX does not see a TPU" in line
    assert not [x for x in fake_cloud.remote("python") if x["argv"][:2] == ["-m", "mllm_rl.run"]]


def test_fetch_brings_back_every_worker(fake_cloud):
    _ready_vm(fake_cloud, workers=2)
    assert fake_cloud.run("run", *TARGET, "--run-id", "r4", "--", "--plan", "swap").returncode == 0
    r = fake_cloud.run("watch", *TARGET)  # run id remembered from `run`
    assert r.returncode == 0, r.stderr
    r = fake_cloud.run("fetch", *TARGET)
    assert r.returncode == 0, r.stderr
    for w in (0, 1):
        d = fake_cloud.runs / "r4" / f"worker{w}"
        assert (d / "phases.jsonl").exists() and (d / "wandb" / "offline-run-fake").is_dir()
        assert (d / f"tpu-{NAME}-w{w}.log").exists()
    scp = [c for c in fake_cloud.calls() if cverb(c) == "scp" and "--recurse" in c]
    assert [flag(c, "worker") for c in scp] == ["0", "1"]
    # a second fetch replaces, it does not nest
    assert fake_cloud.run("fetch", *TARGET).returncode == 0
    assert not (fake_cloud.runs / "r4" / "worker0" / "r4").exists()


# ---------------------------------------------------------------- watch / up


def _python_runs(fc):
    return [x for x in fc.remote("python") if x["argv"][:2] == ["-m", "mllm_rl.run"]]


def test_up_recovers_from_preemption_with_resume_and_zone_fallback(fake_cloud):
    capacity = CAPACITY.format(code="RESOURCE_EXHAUSTED: no more capacity")
    fake_cloud.scenario(preempt_generations=[1], create_errors={Z1: [None, capacity]})
    env_file = write_env(fake_cloud.tmp)
    args = ["--project", "proj-1", "--zones", f"{Z1},{Z2}", "--name", NAME, *V6E]
    r = fake_cloud.run(
        "up",
        *args,
        *REPO,
        "--env-file",
        str(env_file),
        "--run-id",
        "r5",
        "--",
        "--plan",
        "swap",
        "--model",
        "Qwen/Qwen3-4B",
    )
    assert r.returncode == 0, r.stderr
    calls = fake_cloud.calls()
    creates = [flag(c, "zone") for c in calls if cverb(c) == "create"]
    assert creates == [Z1, Z1, Z2], "recovery recreates with the same zone fallback"
    verbs = [cverb(c) for c in calls]
    first_delete = verbs.index("delete")
    assert "create" in verbs[first_delete:], "delete, then create again"
    launches = [
        flag(c, "command") for c in calls if cverb(c) == "ssh" and "mllm_rl_launch" in flag(c, "command")
    ]
    assert len(launches) == 2 and "--resume" not in launches[0] and "--resume-or-start" in launches[1]
    runs = _python_runs(fake_cloud)  # the fake run of each VM generation
    (resumed,) = [x for x in runs if x["gen"] == 2]
    assert resumed["argv"][-1] == "--resume-or-start"  # the new disk may hold nothing to resume
    # (the first VM may be deleted before its detached run got going: no count for gen 1)
    assert all("--resume" not in x["argv"] for x in runs if x["gen"] == 1)
    # the new VM was set up from scratch (fresh disk) and got the env file again
    assert len([c for c in calls if cverb(c) == "scp" and f"{NAME}:.mllm_rl.env" in c]) == 2
    assert cverb(calls[-1]) == "delete" and flag(calls[-1], "zone") == Z2
    assert (fake_cloud.runs / "r5" / "worker0" / "phases.jsonl").exists()
    assert "recovery 1 of 3" in r.stderr


def test_watch_gives_up_after_max_recoveries(fake_cloud):
    fake_cloud.scenario(preempt_generations=[1, 2, 3, 4, 5])
    r = fake_cloud.run(
        "up",
        *TARGET,
        *REPO,
        "--env-file",
        str(write_env(fake_cloud.tmp)),
        "--max-recoveries",
        "2",
        "--run-id",
        "r6",
        "--",
        "--plan",
        "rl",
    )
    assert r.returncode != 0
    assert "giving up after 2 recoveries" in r.stderr
    verbs = fake_cloud.verbs()
    assert verbs.count("tpu-vm create") == 3
    assert verbs[-1] == "tpu-vm delete", "the EXIT trap deletes the last VM"


def test_up_deletes_on_failure_unless_keep(fake_cloud):
    fake_cloud.scenario(platform="cpu")
    r = fake_cloud.run(
        "up", *TARGET, *REPO, "--env-file", str(write_env(fake_cloud.tmp)), "--", "--plan", "swap"
    )
    assert r.returncode != 0 and "JAX does not see a TPU" in r.stderr
    assert fake_cloud.verbs()[-1] == "tpu-vm delete" and fake_cloud.db()["vms"] == {}

    fake_cloud.scenario(platform="cpu")
    r = fake_cloud.run("up", "--keep", *TARGET, *REPO, "--env-file", str(write_env(fake_cloud.tmp)))
    assert r.returncode != 0
    assert NAME in fake_cloud.db()["vms"]


def test_watch_reports_a_failed_run(fake_cloud):
    _ready_vm(fake_cloud, run_exit=3)
    assert fake_cloud.run("run", *TARGET, "--run-id", "r7", "--", "--plan", "swap").returncode == 0
    r = fake_cloud.run("watch", *TARGET)
    assert r.returncode == 1
    (line,) = error_lines(r.stderr)
    assert "r7" in line and "code=3" in line


# ---------------------------------------------------------------- zones per TPU generation


def _family_zones(fam: str) -> list[str]:
    """tpu/lib.sh's table of documented zones for a generation."""
    r = subprocess.run(
        ["bash", "-c", f'source "{ROOT}/tpu/lib.sh" && family_zones {fam}'], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


def test_zone_table_v4_is_us_central2_b_only_and_docs_agree():
    # Google's "TPU regions and zones": v4 exists in us-central2-b only
    assert _family_zones("v4") == ["us-central2-b"]
    doc = (ROOT / "docs" / "TPU.md").read_text()
    assert "us-central2-b,europe-west4-a" not in doc, "the impossible v4 fallback is documented again"
    for fam, pattern in (("v4", "v4-*"), ("v5e", "v5litepod-*"), ("v6e", "v6e-*")):
        (row,) = [line for line in doc.splitlines() if line.startswith(f"| {fam} | `{pattern}` |")]
        assert sorted(row.split("|")[3].replace("`", "").replace(",", " ").split()) == sorted(
            _family_zones(fam)
        )


@pytest.mark.parametrize("sub", ["create", "up", "watch"])
def test_v4_outside_us_central2_b_is_refused_before_any_gcloud_call(fake_cloud, sub):
    args = ["--project", "proj-1", "--zones", f"{ZONE},europe-west4-a", "--name", NAME, "--type", "v4-8"]
    r = fake_cloud.run(sub, *args, *REPO, "--run-id", "r1")
    assert r.returncode == 2
    (line,) = r.stderr.strip().splitlines()
    assert (
        line.startswith("tpu.sh: error: zone europe-west4-a has no TPU v4") and "us-central2-b only" in line
    )
    assert fake_cloud.calls() == []


@pytest.mark.parametrize(
    "accel,zone", [("v6e-8", ZONE), ("v5litepod-8", "us-east1-d"), ("v6e-8", "us-west4-a")]
)
def test_other_generations_in_a_zone_without_them_are_refused(fake_cloud, accel, zone):
    r = fake_cloud.run("create", "--project", "proj-1", "--zone", zone, "--name", NAME, "--type", accel)
    assert r.returncode == 2 and f"zone {zone} has no TPU" in r.stderr
    assert fake_cloud.calls() == []


def test_any_zone_skips_the_check_and_an_invalid_argument_stops_the_fallback(fake_cloud):
    # the fake plays Google's answer to a v4 outside us-central2-b (INVALID_ARGUMENT): not a
    # capacity error, so tpu.sh must stop there with one line instead of trying the next zone
    args = ["--project", "proj-1", "--zones", f"europe-west4-a,{ZONE}", "--name", NAME, "--any-zone"]
    r = fake_cloud.run("create", *args)
    assert r.returncode == 1
    (line,) = error_lines(r.stderr)
    assert "europe-west4-a" in line and "INVALID_ARGUMENT" in line
    assert [flag(c, "zone") for c in fake_cloud.calls() if cverb(c) == "create"] == ["europe-west4-a"]
    assert not (fake_cloud.state / "db.json").exists() or fake_cloud.db()["vms"] == {}


# ---------------------------------------------------------------- gcloud groups and SSH host keys


def test_every_gcloud_call_uses_the_ga_groups(fake_cloud):
    r = fake_cloud.run("up", *TARGET, *REPO, "--queued", "--env-file", str(write_env(fake_cloud.tmp)))
    assert r.returncode == 0, r.stderr
    calls = fake_cloud.calls()
    assert calls and all(
        c[:2] == ["compute", "tpus"] and c[2] in ("tpu-vm", "queued-resources") for c in calls
    )
    for sub in ("create", "wait", "setup", "env", "run", "watch", "fetch", "delete"):
        for extra in ([], ["--queued"]):
            r = fake_cloud.run(
                sub,
                "--dry-run",
                *TARGET,
                *REPO,
                *extra,
                "--run-id",
                "r1",
                "--env-file",
                str(write_env(fake_cloud.tmp)),
            )
            assert r.returncode == 0, (sub, r.stderr)
            assert all(c[1:3] == ["compute", "tpus"] for c in dry_commands(r.stdout)), sub


def test_ssh_and_scp_set_host_key_checking_through_gcloud(fake_cloud):
    _ready_vm(fake_cloud)
    assert fake_cloud.run("env", *TARGET, "--env-file", str(write_env(fake_cloud.tmp))).returncode == 0
    ssh_scp = [c for c in fake_cloud.calls() if cverb(c) in ("ssh", "scp")]
    assert ssh_scp and all(HOSTKEY in c for c in ssh_scp)
    assert not any("stricthostkeychecking" in a.lower() for c in ssh_scp for a in c if a.startswith("--s"))
    r = fake_cloud.run("wait", *TARGET, env={"TPU_STRICT_HOST_KEY_CHECKING": "yes"})
    assert r.returncode == 0, r.stderr
    assert "--strict-host-key-checking=yes" in fake_cloud.calls()[-1]


@pytest.mark.parametrize(
    "env,word",
    [
        ({"TPU_SSH_OPTS": "-oStrictHostKeyChecking=accept-new -oConnectTimeout=5"}, "no effect"),
        ({"TPU_STRICT_HOST_KEY_CHECKING": "accept-new"}, "yes, no or ask"),
    ],
)
def test_host_key_settings_gcloud_would_ignore_or_refuse_exit_2(fake_cloud, env, word):
    r = fake_cloud.run("wait", *TARGET, env=env)
    assert r.returncode == 2
    (line,) = r.stderr.strip().splitlines()
    assert word in line
    assert fake_cloud.calls() == []


# ---------------------------------------------------------------- queued resources


def _put_qr(fc, state: str, node: bool = False) -> None:
    """A queued resource already in the fake's books (a run before this one left it)."""
    db = {"vms": {}, "qrs": {}}
    db["qrs"][NAME] = {
        "zone": ZONE,
        "type": "v4-8",
        "waiting": 100,
        "state": state,
        "valid_until_s": None,
        "clock_s": 0,
    }
    if node:
        db["vms"][NAME] = {
            "zone": ZONE,
            "gen": 1,
            "type": "v4-8",
            "creating_left": 0,
            "state": "PREEMPTED",
            "run_launched": True,
            "qr": NAME,
        }
        db["generation"] = 1
    (fc.state / "db.json").write_text(json.dumps(db))


@pytest.mark.parametrize("state,node", [("SUSPENDED", False), ("SUSPENDED", True), ("FAILED", False)])
def test_create_queued_deletes_a_dead_queued_resource_that_holds_the_name(fake_cloud, state, node):
    _put_qr(fake_cloud, state, node)
    r = fake_cloud.run("create", *TARGET, "--queued")
    assert r.returncode == 0, r.stderr
    verbs = fake_cloud.verbs()
    assert verbs.index("queued-resources delete") < verbs.index("queued-resources create")
    (delete,) = [c for c in fake_cloud.calls() if c[2:4] == ["queued-resources", "delete"]]
    assert "--force" in delete  # the node of a SUSPENDED one may still be there
    assert fake_cloud.db()["qrs"][NAME]["state"] == "WAITING_FOR_RESOURCES"
    assert NAME not in fake_cloud.db()["vms"]


@pytest.mark.parametrize("state", ["WAITING_FOR_RESOURCES", "ACTIVE"])
def test_create_queued_never_deletes_a_live_queued_resource(fake_cloud, state):
    _put_qr(fake_cloud, state)
    r = fake_cloud.run("create", *TARGET, "--queued")
    assert r.returncode == 1
    (line,) = error_lines(r.stderr)
    assert "already exists" in line and state in line
    assert "queued-resources delete" not in fake_cloud.verbs()
    assert fake_cloud.db()["qrs"][NAME]["state"] == state


@pytest.mark.parametrize(
    "keeps_node,qr_state", [(False, "SUSPENDED"), (True, "SUSPENDED"), (False, "ACTIVE"), (True, "FAILED")]
)
def test_up_queued_recovers_from_preemption_under_the_same_name(fake_cloud, keeps_node, qr_state):
    # a preempted queued spot VM leaves its queued resource SUSPENDED, holding the name: the fake
    # answers ALREADY_EXISTS to a new request under it unless tpu.sh deletes it first (also when
    # the queued resource still says ACTIVE: its VM is gone, so the recovery deletes it anyway)
    fake_cloud.scenario(preempt_generations=[1], qr_preempt_keeps_node=keeps_node, qr_preempt_state=qr_state)
    r = fake_cloud.run(
        "up",
        *TARGET,
        "--queued",
        *REPO,
        "--env-file",
        str(write_env(fake_cloud.tmp)),
        "--run-id",
        "rq",
        "--",
        "--plan",
        "swap",
    )
    assert r.returncode == 0, r.stderr
    qr = [c for c in fake_cloud.calls() if c[2] == "queued-resources" and c[3] in ("create", "delete")]
    assert [c[3] for c in qr] == ["create", "delete", "create", "delete"]
    assert all(c[4] == NAME and flag(c, "zone") == ZONE for c in qr)
    assert "recovery 1 of 3" in r.stderr
    assert [x["gen"] for x in _python_runs(fake_cloud) if x["argv"][-1] == "--resume-or-start"] == [2]
    assert fake_cloud.db()["qrs"] == {} and fake_cloud.db()["vms"] == {}


def test_queued_wait_gives_the_queue_its_valid_until_duration_not_the_timeout(fake_cloud):
    # --timeout 0 bounds READY + SSH only; a request still in line is waited for (up would
    # otherwise delete it and lose its place in the queue)
    fake_cloud.scenario(qr_waiting_describes=5)
    assert fake_cloud.run("create", *TARGET, "--queued").returncode == 0
    r = fake_cloud.run("wait", *TARGET, "--queued", "--timeout", "0")
    assert r.returncode == 0, r.stderr
    assert fake_cloud.db()["qrs"][NAME]["state"] == "ACTIVE"


def test_up_queued_passes_valid_until_and_stops_when_the_request_expires(fake_cloud):
    # the fake fails a request still waiting after its --valid-until-duration (fake clock: 1h
    # per describe); tpu.sh reports that in one line instead of giving up on its own
    fake_cloud.scenario(qr_waiting_describes=1000, qr_tick_s=3600)
    r = fake_cloud.run(
        "up",
        *TARGET,
        "--queued",
        "--valid-until-duration",
        "2h",
        *REPO,
        "--env-file",
        str(write_env(fake_cloud.tmp)),
    )
    assert r.returncode == 1
    (line,) = error_lines(r.stderr)
    assert "FAILED" in line and "--valid-until-duration 2h" in line
    calls = fake_cloud.calls()
    (create,) = [c for c in calls if c[2:4] == ["queued-resources", "create"]]
    assert flag(create, "valid-until-duration") == "2h"
    waits = [c for c in calls if c[2:4] == ["queued-resources", "describe"]]
    assert len(waits) == 3  # one before the create (a dead one holding the name?), then 1h, 2h: FAILED
    assert cverb(calls[-1]) == "delete" and fake_cloud.db()["qrs"] == {}


@pytest.mark.parametrize("bad", ["12", "h", "1.5h", "0m", "-1h"])
def test_bad_valid_until_duration_exits_2(fake_cloud, bad):
    r = fake_cloud.run("create", *TARGET, "--queued", "--valid-until-duration", bad)
    assert r.returncode == 2 and "--valid-until-duration" in r.stderr
    assert fake_cloud.calls() == []


# ---------------------------------------------------------------- multi-host slices


def _runs_when_all_logged(fc, n: int) -> list[dict]:
    for _ in range(200):  # the run is started detached: wait for the fake runs to have logged
        runs = _python_runs(fc)
        if len(runs) >= n:
            return runs
        subprocess.run(["sleep", "0.05"])
    return _python_runs(fc)


@pytest.mark.parametrize("plan", ["swap", "rl"])
def test_run_on_a_multi_host_slice_gives_every_worker_its_jax_distributed_env(fake_cloud, plan):
    _ready_vm(fake_cloud, workers=2)  # v4-16: 2 hosts
    env_file = fake_cloud.tmp / "dist.env"  # the env file cannot override the process variables
    env_file.write_text("MLLM_RL_PROCESS_ID=7\nMLLM_RL_NUM_PROCESSES=9\n")
    assert fake_cloud.run("env", *TARGET, "--env-file", str(env_file)).returncode == 0
    r = fake_cloud.run("run", *TARGET, "--run-id", "rm", "--", "--plan", plan, "--tp", "8")
    assert r.returncode == 0, r.stderr
    (launch,) = [
        c for c in fake_cloud.calls() if cverb(c) == "ssh" and "mllm_rl_launch" in flag(c, "command")
    ]
    assert flag(launch, "worker") == "all"
    runs = sorted(_runs_when_all_logged(fake_cloud, 2), key=lambda x: x["worker"])
    assert [x["worker"] for x in runs] == [0, 1]
    for x in runs:
        assert x["argv"][:8] == [
            "-m",
            "mllm_rl.run",
            "--backend",
            "jax",
            "--run-id",
            "rm",
            "--run-dir",
            "runs/rm",
        ]
        assert x["argv"][8:] == ["--plan", plan, "--tp", "8"]
        assert x["MLLM_RL_COORDINATOR"] == "10.0.0.2:8482"  # worker 0, jax's Cloud TPU port
        assert x["MLLM_RL_NUM_PROCESSES"] == "2"
        assert x["MLLM_RL_PROCESS_ID"] == str(x["worker"])


def test_single_host_and_jax_dist_auto_set_no_process_variables(fake_cloud):
    _ready_vm(fake_cloud)
    assert fake_cloud.run("run", *TARGET, "--run-id", "r1", "--", "--plan", "swap").returncode == 0
    (one_host,) = _runs_when_all_logged(fake_cloud, 1)
    assert not any(k.startswith("MLLM_RL_") for k in one_host)

    fc = fake_cloud
    fc.scenario(workers=2)
    fc.run("delete", *TARGET)
    assert fc.run("create", *TARGET, "--type", "v4-16").returncode == 0
    assert fc.run("setup", *TARGET, *REPO).returncode == 0
    r = fc.run("run", *TARGET, "--jax-dist", "auto", "--run-id", "r2", "--", "--plan", "swap")
    assert r.returncode == 0, r.stderr
    runs = [x for x in _runs_when_all_logged(fc, 3) if "r2" in x["argv"]]
    assert len(runs) == 2 and not any(k.startswith("MLLM_RL_") for x in runs for k in x)


def test_run_refuses_when_the_metadata_disagrees_with_the_worker_count(fake_cloud):
    _ready_vm(fake_cloud, workers=2)
    r = fake_cloud.run("run", *TARGET, "--workers", "3", "--run-id", "r1", "--", "--plan", "swap")
    assert r.returncode == 1
    (line,) = error_lines(r.stderr)
    assert "lists 2 workers, tpu.sh expected 3" in line
    assert _python_runs(fake_cloud) == []


def test_watch_shows_the_failing_workers_last_log_line(fake_cloud):
    _ready_vm(fake_cloud, workers=2, run_exit=2)
    assert fake_cloud.run("run", *TARGET, "--run-id", "r7", "--", "--plan", "rl").returncode == 0
    r = fake_cloud.run("watch", *TARGET)
    assert r.returncode == 1
    (line,) = error_lines(r.stderr)
    assert "code=2" in line and "error: the fake run failed on worker" in line


# ---------------------------------------------------------------- lint


def test_shellcheck_clean():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed")
    scripts = sorted(str(p) for p in (ROOT / "tpu").glob("*.sh"))
    assert scripts
    r = subprocess.run(["shellcheck", "-x", *scripts], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


def test_remote_scripts_are_valid_bash(fake_cloud):
    r = fake_cloud.run(
        "up",
        "--dry-run",
        *TARGET,
        *REPO,
        "--env-file",
        str(write_env(fake_cloud.tmp)),
        "--run-id",
        "r8",
        "--",
        "--plan",
        "swap",
        "--prompt",
        'it\'s a "test"',
    )
    assert r.returncode == 0, r.stderr
    for c in dry_commands(r.stdout):
        script = flag(c, "command")
        if script:
            p = subprocess.run(["bash", "-n", "-c", script], capture_output=True, text=True)
            assert p.returncode == 0, (script, p.stderr)
