"""A FAKE ``gcloud`` for the tests of ``tpu/tpu.sh`` (stdlib only). It is not Google's gcloud.

The fixture in ``conftest.py`` copies this file to ``<tmp>/bin/gcloud`` (first on PATH). Each call
appends ``{"argv": [...]}`` to ``$FAKE_GCLOUD_STATE/calls.jsonl`` and then plays the scenario in
``$FAKE_GCLOUD_STATE/scenario.json``:

  create_errors        {zone: [stderr text or null, ...]}: consumed one per create (VM or queued
                       resource) in that zone; a text fails the create with that stderr, null lets
                       it succeed
  creating_describes   describes that answer CREATING after a create (default 0)
  initial_state        state of a created VM once past CREATING (default READY)
  preempt_generations  [g, ...]: the g-th VM created becomes PREEMPTED at the first describe
                       after a run was launched on it; a queued resource's VM is deleted instead
                       and its queued resource becomes SUSPENDED, still holding the name
  qr_preempt_keeps_node  such a preempted queued VM stays, PREEMPTED (default false)
  qr_preempt_state     the state its queued resource shows then (default SUSPENDED; ACTIVE plays
                       a queued resource that has not caught up yet)
  ssh_failures         the first N ssh calls fail with exit 255 (connection refused)
  workers              hosts per VM (default 1)
  qr_waiting_describes queued-resource describes answering WAITING_FOR_RESOURCES (default 1)
  qr_tick_s            fake seconds each queued-resource describe advances its clock (default
                       60); a request still waiting when its --valid-until-duration has passed on
                       that clock becomes FAILED (the wait expiry)
  exec_remote          run ssh commands in a sandbox per worker (default true), see below
  python312            python3.12 on the workers' PATH from the start (default true)
  platform             what the fake JAX on the workers reports (default "tpu")
  run_exit             exit status of the fake ``python -m mllm_rl.run`` (default 0)

Google's behaviours it plays (the error texts are the fake's own wording, not gcloud's):

- only the GA groups (``gcloud compute tpus tpu-vm|queued-resources``); ``alpha`` is refused;
- TPU v4 exists in us-central2-b only: a v4 create elsewhere fails with INVALID_ARGUMENT;
- a queued resource keeps its name in every state (SUSPENDED and FAILED included) until it is
  deleted: a create under that name fails with ALREADY_EXISTS; ``delete`` without ``--force``
  refuses while it has a node and is not FAILED/SUSPENDED;
- ``--strict-host-key-checking`` takes yes|no|ask; an ``-oStrictHostKeyChecking`` ssh/scp flag is
  refused, because on the real gcloud it has no effect (gcloud puts its own option first and
  OpenSSH keeps the first value) -- a fake-only check, so that tpu.sh never relies on one.

SSH commands run with ``bash -c`` in ``$FAKE_GCLOUD_STATE/vms/<name>/w<i>`` as $HOME, with a PATH
of stubs (``remote_stub.sh``: sudo, git, curl, python3.12, pgrep, ...) and a few coreutils only.
The fake metadata server (curl) answers agent-worker-number and worker-network-endpoints
(10.0.0.<i+2> for worker i, as ``describe`` reports). A recreated VM gets fresh homes, like a new
disk. Argument checking is strict (``--flag=value``, known flags only), so a malformed gcloud
command fails the test.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

STATE = Path(os.environ["FAKE_GCLOUD_STATE"])
BOOL_FLAGS = {"quiet", "spot", "recurse", "force"}
ALLOWED = {
    ("tpu-vm", "create"): {"project", "zone", "accelerator-type", "version", "spot", "quiet"},
    ("tpu-vm", "describe"): {"project", "zone", "format"},
    ("tpu-vm", "ssh"): {
        "project",
        "zone",
        "worker",
        "quiet",
        "ssh-flag",
        "command",
        "strict-host-key-checking",
    },
    ("tpu-vm", "scp"): {
        "project",
        "zone",
        "worker",
        "quiet",
        "scp-flag",
        "recurse",
        "strict-host-key-checking",
    },
    ("tpu-vm", "delete"): {"project", "zone", "quiet"},
    ("queued-resources", "create"): {
        "node-id",
        "project",
        "zone",
        "accelerator-type",
        "runtime-version",
        "spot",
        "valid-until-duration",
        "quiet",
    },
    ("queued-resources", "describe"): {"project", "zone", "format"},
    ("queued-resources", "delete"): {"project", "zone", "force", "quiet"},
}
REQUIRED_STUBS = ("sudo", "pgrep", "pkill", "lsof", "ps", "git", "curl")
V4_ZONES = ("us-central2-b",)  # https://cloud.google.com/tpu/docs/regions-zones


def fail(msg: str, code: int = 1) -> None:
    print(msg, file=sys.stderr)
    sys.exit(code)


def load(name: str, default):
    p = STATE / name
    return json.loads(p.read_text()) if p.exists() else default


def save(name: str, obj) -> None:
    tmp = STATE / (name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    tmp.replace(STATE / name)


def parse(argv: list[str]):
    if argv[:1] in (["alpha"], ["beta"]):
        fail(f"ERROR: (fake gcloud) {argv[0]} group refused: tpu-vm and queued-resources are GA", 2)
    if argv[:2] != ["compute", "tpus"] or len(argv) < 4:
        fail(f"ERROR: (fake gcloud) unsupported command: {argv}", 2)
    group, verb = argv[2], argv[3]
    allowed = ALLOWED.get((group, verb))
    if allowed is None:
        fail(f"ERROR: (fake gcloud) unsupported command: {group} {verb}", 2)
    flags: dict[str, list[str]] = {}
    pos: list[str] = []
    for a in argv[4:]:
        if a.startswith("--"):
            key, eq, val = a[2:].partition("=")
            if key not in allowed:
                fail(f"ERROR: (gcloud.compute.tpus.{group}.{verb}) unrecognized arguments: {a}", 2)
            if not eq and key not in BOOL_FLAGS:
                fail(f"ERROR: (fake gcloud) --{key} needs =VALUE in these tests", 2)
            flags.setdefault(key, []).append(val if eq else "true")
        else:
            pos.append(a)
    for need in ("project", "zone"):
        if need not in flags:
            fail(f"ERROR: (fake gcloud) --{need} missing (tpu.sh must pass it explicitly)", 2)
    for v in flags.get("strict-host-key-checking", []):
        if v not in ("yes", "no", "ask"):
            fail(
                f"ERROR: (gcloud.compute.tpus.{group}.{verb}) argument --strict-host-key-checking: "
                f"Invalid choice: '{v}'",
                2,
            )
    for v in flags.get("ssh-flag", []) + flags.get("scp-flag", []):
        if "stricthostkeychecking" in v.lower():
            fail(
                f"ERROR: (fake gcloud) {v}: no effect on the real gcloud, whose own "
                "StrictHostKeyChecking option comes first; use --strict-host-key-checking",
                2,
            )
    return group, verb, flags, pos


def duration_s(text: str) -> int:
    """Seconds of a duration like 12h, 90m, 1h30m (the forms tpu.sh passes)."""
    parts = re.findall(r"(\d+)([smhd])", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        fail(f"ERROR: (fake gcloud) --valid-until-duration: bad duration {text!r}", 2)
    return sum(int(n) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[u] for n, u in parts)


def check_zone(kind: str, accel: str, zone: str) -> None:
    """TPU v4 exists in us-central2-b only; elsewhere the API refuses the request."""
    if accel.startswith("v4-") and zone not in V4_ZONES:
        fail(
            f"ERROR: (gcloud.compute.tpus.{kind}.create) INVALID_ARGUMENT: accelerator type {accel} "
            f"is not available in zone {zone} (fake gcloud)",
            1,
        )


def create_error(db, sc, zone: str) -> None:
    """The scenario's next create error for ZONE, if any (consumed)."""
    used = db.setdefault("create_errors_used", {})
    errs = sc.get("create_errors", {}).get(zone, [])
    k = used.get(zone, 0)
    used[zone] = k + 1
    save("db.json", db)
    if k < len(errs) and errs[k] is not None:
        fail(errs[k], 1)


def one(flags, key, default=None):
    v = flags.get(key)
    return v[-1] if v else default


def rmtree(p: Path) -> None:
    import shutil  # imported where needed: every call of the fake pays for its imports

    shutil.rmtree(p, ignore_errors=True)


def homes_of(name: str) -> Path:
    return STATE / "vms" / name


def new_vm(db, sc, name, zone, accel, qr=None):
    db["generation"] = db.get("generation", 0) + 1
    gen = db["generation"]
    creating = int(sc.get("creating_describes", 0))
    db["vms"][name] = {
        "zone": zone,
        "gen": gen,
        "type": accel,
        "creating_left": creating,
        "state": "CREATING" if creating else sc.get("initial_state", "READY"),
        "run_launched": False,
        "qr": qr,  # the queued resource that made it, if any
    }
    home = homes_of(name)
    rmtree(home)
    for i in range(int(sc.get("workers", 1))):
        (home / f"w{i}").mkdir(parents=True, exist_ok=True)


def not_found(kind: str, project: str, zone: str, name: str) -> None:
    fail(
        f"ERROR: (gcloud.compute.tpus.{kind}) NOT_FOUND: Resource "
        f"'projects/{project}/locations/{zone}/nodes/{name}' was not found",
        1,
    )


def get_vm(db, name, zone):
    vm = db["vms"].get(name)
    return vm if vm and vm["zone"] == zone else None


def worker_list(flags, sc) -> list[int]:
    w = one(flags, "worker", "0")
    n = int(sc.get("workers", 1))
    return list(range(n)) if w == "all" else [int(w)]


def remote_env(sc, vm, home_root: Path, i: int) -> dict[str, str]:
    bins = Path(os.environ["FAKE_REMOTE_BIN"])
    apt_bin = home_root / f"apt-bin-w{i}"
    apt_bin.mkdir(parents=True, exist_ok=True)
    path = [str(bins / "base")]
    if sc.get("python312", True):
        path.append(str(bins / "py312"))
    path.append(str(apt_bin))
    for stub in REQUIRED_STUBS:  # never run a real sudo/pgrep/kill path on the test machine
        if not (bins / "base" / stub).exists():
            fail(f"fake gcloud: stub {stub} missing; refusing to run a remote command", 99)
    return {
        "HOME": str(home_root / f"w{i}"),
        "PATH": ":".join(path),
        "LANG": "C.UTF-8",
        "FAKE_WORKER": str(i),
        "FAKE_WORKERS": str(int(sc.get("workers", 1))),
        "FAKE_GEN": str(vm["gen"]),
        "FAKE_APT_BIN": str(apt_bin),
        "FAKE_PLATFORM": str(sc.get("platform", "tpu")),
        "FAKE_RUN_EXIT": str(sc.get("run_exit", 0)),
        "FAKE_REMOTE_LOG": str(STATE / "remote.jsonl"),
        "FAKE_STUB": str(bins / "stub"),
    }


def cmd_ssh(db, sc, name, zone, flags):
    import subprocess

    vm = get_vm(db, name, zone)
    if vm is None:
        not_found("tpu-vm.ssh", one(flags, "project"), zone, name)
    db["ssh_calls"] = db.get("ssh_calls", 0) + 1
    save("db.json", db)
    if db["ssh_calls"] <= int(sc.get("ssh_failures", 0)) or vm["state"] != "READY":
        fail(
            "ssh: connect to host 10.0.0.2 port 22: Connection refused\n"
            "ERROR: (gcloud.compute.tpus.tpu-vm.ssh) [/usr/bin/ssh] exited with return code [255].",
            255,
        )
    command = one(flags, "command", "")
    if "mllm_rl_launch" in command and "-m mllm_rl.run" in command:
        vm["run_launched"] = True
        save("db.json", db)
    if not sc.get("exec_remote", True):
        return 0
    root = homes_of(name)
    rc = 0
    for i in worker_list(flags, sc):
        p = subprocess.run(
            ["bash", "-c", command],
            cwd=root / f"w{i}",
            env=remote_env(sc, vm, root, i),
            capture_output=True,
            text=True,
            timeout=60,
        )
        sys.stdout.write(p.stdout)
        sys.stderr.write(p.stderr)
        rc = rc or p.returncode
    return rc


def cmd_scp(db, sc, flags, pos):
    import shutil

    *srcs, dest = pos
    zone = one(flags, "zone")
    recurse = "recurse" in flags

    def remote(spec: str):
        host, sep, path = spec.partition(":")
        return (host, path) if sep and host in db["vms"] else None

    rdest = remote(dest)
    for s in srcs:
        rsrc = remote(s)
        name = (rdest or rsrc or (None, None))[0]
        vm = get_vm(db, name, zone) if name else None
        if vm is None:
            fail(f"ERROR: (gcloud.compute.tpus.tpu-vm.scp) NOT_FOUND: {name} in {zone}", 1)
        if vm["state"] != "READY":
            fail("ssh: connect to host 10.0.0.2 port 22: Connection refused", 255)
        for i in worker_list(flags, sc):
            home = homes_of(name) / f"w{i}"
            if rdest:  # local -> remote
                target = home / rdest[1] if rdest[1] else home
                if target.is_dir():
                    target = target / Path(s).name
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(s, target)  # copies the mode bits, like scp does for a new file
            else:  # remote -> local
                src = home / rsrc[1]
                if not src.exists():
                    fail(f"scp: {rsrc[1]}: No such file or directory", 1)
                target = Path(dest)
                if target.is_dir():
                    target = target / src.name
                if src.is_dir():
                    if not recurse:
                        fail(f"scp: {rsrc[1]}: not a regular file", 1)
                    shutil.copytree(src, target)
                else:
                    shutil.copy(src, target)
    return 0


def cmd_describe(db, sc, name, zone, flags):
    vm = get_vm(db, name, zone)
    if vm is None:
        not_found("tpu-vm.describe", one(flags, "project"), zone, name)
    if vm["state"] == "CREATING":
        if vm["creating_left"] > 0:
            vm["creating_left"] -= 1
            save("db.json", db)
            print("CREATING")
            return 0
        vm["state"] = sc.get("initial_state", "READY")
    if vm["run_launched"] and vm["gen"] in sc.get("preempt_generations", []) and vm["state"] != "PREEMPTED":
        vm["state"] = "PREEMPTED"
        qr = db["qrs"].get(vm.get("qr") or "")
        if qr is not None:  # a queued resource's VM: the request is SUSPENDED and keeps the name
            qr["state"] = sc.get("qr_preempt_state", "SUSPENDED")
            if not sc.get("qr_preempt_keeps_node", False):
                del db["vms"][name]
                rmtree(homes_of(name))
                save("db.json", db)
                not_found("tpu-vm.describe", one(flags, "project"), zone, name)
    save("db.json", db)
    fmt = one(flags, "format", "")
    if fmt == "value(state)":
        print(vm["state"])
    elif fmt == "value(networkEndpoints[].ipAddress)":
        print(";".join(f"10.0.0.{i + 2}" for i in range(int(sc.get("workers", 1)))))
    else:
        print(f"acceleratorType: {vm['type']}\nstate: {vm['state']}")
    return 0


def main() -> int:
    argv = sys.argv[1:]
    with open(STATE / "calls.jsonl", "a") as f:
        f.write(json.dumps({"argv": argv}) + "\n")
    sc = load("scenario.json", {})
    db = load("db.json", {"vms": {}, "qrs": {}})
    group, verb, flags, pos = parse(argv)
    zone, project = one(flags, "zone"), one(flags, "project")
    name = pos[0] if pos else None

    if group == "tpu-vm" and verb == "create":
        for need in ("accelerator-type", "version"):
            if need not in flags:
                fail(f"ERROR: (fake gcloud) --{need} missing", 2)
        check_zone("tpu-vm", one(flags, "accelerator-type"), zone)
        create_error(db, sc, zone)
        if name in db["vms"]:
            fail(
                f"ERROR: (gcloud.compute.tpus.tpu-vm.create) ALREADY_EXISTS: node {name} already exists",
                1,
            )
        new_vm(db, sc, name, zone, one(flags, "accelerator-type"))
        save("db.json", db)
        print(f"Create request issued for: [{name}]", file=sys.stderr)
        return 0
    if group == "tpu-vm" and verb == "describe":
        return cmd_describe(db, sc, name, zone, flags)
    if group == "tpu-vm" and verb == "ssh":
        return cmd_ssh(db, sc, name, zone, flags)
    if group == "tpu-vm" and verb == "scp":
        return cmd_scp(db, sc, flags, pos)
    if group == "tpu-vm" and verb == "delete":
        if get_vm(db, name, zone) is None:
            not_found("tpu-vm.delete", project, zone, name)
        del db["vms"][name]
        rmtree(homes_of(name))
        save("db.json", db)
        return 0
    if group == "queued-resources" and verb == "create":
        if one(flags, "node-id") != name or "runtime-version" not in flags or "accelerator-type" not in flags:
            fail(
                "ERROR: (fake gcloud) queued-resources create needs --node-id=NAME, --runtime-version, --accelerator-type",
                2,
            )
        valid_until = (
            duration_s(one(flags, "valid-until-duration")) if "valid-until-duration" in flags else None
        )
        check_zone("queued-resources", one(flags, "accelerator-type"), zone)
        create_error(db, sc, zone)
        held = db["qrs"].get(name)
        if held is not None and held["zone"] == zone:  # every state holds the name, SUSPENDED too
            fail(
                "ERROR: (gcloud.compute.tpus.queued-resources.create) ALREADY_EXISTS: queued resource "
                f"projects/{project}/locations/{zone}/queuedResources/{name} already exists ({held['state']})",
                1,
            )
        if get_vm(db, name, zone) is not None:
            fail(f"ERROR: (gcloud.compute.tpus.queued-resources.create) ALREADY_EXISTS: node {name}", 1)
        db["qrs"][name] = {
            "zone": zone,
            "type": one(flags, "accelerator-type"),
            "waiting": int(sc.get("qr_waiting_describes", 1)),
            "state": "WAITING_FOR_RESOURCES",
            "valid_until_s": valid_until,
            "clock_s": 0,
        }
        save("db.json", db)
        return 0
    if group == "queued-resources" and verb == "describe":
        qr = db["qrs"].get(name)
        if qr is None or qr["zone"] != zone:
            not_found("queued-resources.describe", project, zone, name)
        if qr["state"] == "WAITING_FOR_RESOURCES":
            qr["clock_s"] += int(sc.get("qr_tick_s", 60))
            if qr["waiting"] > 0:
                qr["waiting"] -= 1
                if qr["valid_until_s"] is not None and qr["clock_s"] >= qr["valid_until_s"]:
                    qr["state"] = "FAILED"  # not fulfilled within --valid-until-duration
            else:
                qr["state"] = "ACTIVE"
                new_vm(db, sc, name, zone, qr["type"], qr=name)
        save("db.json", db)
        print(
            qr["state"] if one(flags, "format") == "value(state.state)" else f"state:\n  state: {qr['state']}"
        )
        return 0
    if group == "queued-resources" and verb == "delete":
        qr = db["qrs"].get(name)
        if qr is None or qr["zone"] != zone:
            not_found("queued-resources.delete", project, zone, name)
        if "force" not in flags and name in db["vms"] and qr["state"] not in ("FAILED", "SUSPENDED"):
            fail("ERROR: FAILED_PRECONDITION: the queued resource has a node; use --force", 1)
        del db["qrs"][name]
        if (db["vms"].get(name) or {}).get("qr") == name:
            db["vms"].pop(name)
            rmtree(homes_of(name))
        save("db.json", db)
        return 0
    fail(f"ERROR: (fake gcloud) unhandled {group} {verb}", 2)
    return 2


if __name__ == "__main__":
    sys.exit(main())
