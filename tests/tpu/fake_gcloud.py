"""A FAKE ``gcloud`` for the tests of ``tpu/tpu.sh`` (stdlib only). It is not Google's gcloud.

The fixture in ``conftest.py`` copies this file to ``<tmp>/bin/gcloud`` (first on PATH). Each call
appends ``{"argv": [...]}`` to ``$FAKE_GCLOUD_STATE/calls.jsonl`` and then plays the scenario in
``$FAKE_GCLOUD_STATE/scenario.json``:

  create_errors        {zone: [stderr text or null, ...]}: consumed one per create in that zone;
                       a text fails the create with that stderr, null lets it succeed
  creating_describes   describes that answer CREATING after a create (default 0)
  initial_state        state of a created VM once past CREATING (default READY)
  preempt_generations  [g, ...]: the g-th VM created becomes PREEMPTED at the first describe
                       after a run was launched on it
  ssh_failures         the first N ssh calls fail with exit 255 (connection refused)
  workers              hosts per VM (default 1)
  qr_waiting_describes queued-resource describes answering WAITING_FOR_RESOURCES (default 1)
  exec_remote          run ssh commands in a sandbox per worker (default true), see below
  python312            python3.12 on the workers' PATH from the start (default true)
  platform             what the fake JAX on the workers reports (default "tpu")
  run_exit             exit status of the fake ``python -m mllm_rl.run`` (default 0)

SSH commands run with ``bash -c`` in ``$FAKE_GCLOUD_STATE/vms/<name>/w<i>`` as $HOME, with a PATH
of stubs (``remote_stub.sh``: sudo, git, curl, python3.12, pgrep, ...) and a few coreutils only.
A recreated VM gets fresh homes, like a new disk. Argument checking is strict (``--flag=value``,
known flags only), so a malformed gcloud command fails the test.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

STATE = Path(os.environ["FAKE_GCLOUD_STATE"])
BOOL_FLAGS = {"quiet", "spot", "recurse", "force"}
ALLOWED = {
    ("tpu-vm", "create"): {"project", "zone", "accelerator-type", "version", "spot", "quiet"},
    ("tpu-vm", "describe"): {"project", "zone", "format"},
    ("tpu-vm", "ssh"): {"project", "zone", "worker", "quiet", "ssh-flag", "command"},
    ("tpu-vm", "scp"): {"project", "zone", "worker", "quiet", "scp-flag", "recurse"},
    ("tpu-vm", "delete"): {"project", "zone", "quiet"},
    ("queued-resources", "create"): {
        "node-id",
        "project",
        "zone",
        "accelerator-type",
        "runtime-version",
        "spot",
        "quiet",
    },
    ("queued-resources", "describe"): {"project", "zone", "format"},
    ("queued-resources", "delete"): {"project", "zone", "force", "quiet"},
}
REQUIRED_STUBS = ("sudo", "pgrep", "pkill", "lsof", "ps", "git", "curl")


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
    if argv[:3] != ["alpha", "compute", "tpus"] or len(argv) < 5:
        fail(f"ERROR: (fake gcloud) unsupported command: {argv}", 2)
    group, verb = argv[3], argv[4]
    allowed = ALLOWED.get((group, verb))
    if allowed is None:
        fail(f"ERROR: (fake gcloud) unsupported command: {group} {verb}", 2)
    flags: dict[str, list[str]] = {}
    pos: list[str] = []
    for a in argv[5:]:
        if a.startswith("--"):
            key, eq, val = a[2:].partition("=")
            if key not in allowed:
                fail(f"ERROR: (gcloud.alpha.compute.tpus.{group}.{verb}) unrecognized arguments: {a}", 2)
            if not eq and key not in BOOL_FLAGS:
                fail(f"ERROR: (fake gcloud) --{key} needs =VALUE in these tests", 2)
            flags.setdefault(key, []).append(val if eq else "true")
        else:
            pos.append(a)
    for need in ("project", "zone"):
        if need not in flags:
            fail(f"ERROR: (fake gcloud) --{need} missing (tpu.sh must pass it explicitly)", 2)
    return group, verb, flags, pos


def one(flags, key, default=None):
    v = flags.get(key)
    return v[-1] if v else default


def rmtree(p: Path) -> None:
    import shutil  # imported where needed: every call of the fake pays for its imports

    shutil.rmtree(p, ignore_errors=True)


def homes_of(name: str) -> Path:
    return STATE / "vms" / name


def new_vm(db, sc, name, zone, accel):
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
    }
    home = homes_of(name)
    rmtree(home)
    for i in range(int(sc.get("workers", 1))):
        (home / f"w{i}").mkdir(parents=True, exist_ok=True)


def not_found(kind: str, project: str, zone: str, name: str) -> None:
    fail(
        f"ERROR: (gcloud.alpha.compute.tpus.{kind}) NOT_FOUND: Resource "
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
            "ERROR: (gcloud.alpha.compute.tpus.tpu-vm.ssh) [/usr/bin/ssh] exited with return code [255].",
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
            fail(f"ERROR: (gcloud.alpha.compute.tpus.tpu-vm.scp) NOT_FOUND: {name} in {zone}", 1)
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
    if vm["run_launched"] and vm["gen"] in sc.get("preempt_generations", []):
        vm["state"] = "PREEMPTED"
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
        used = db.setdefault("create_errors_used", {})
        errs = sc.get("create_errors", {}).get(zone, [])
        k = used.get(zone, 0)
        used[zone] = k + 1
        save("db.json", db)
        if k < len(errs) and errs[k] is not None:
            fail(errs[k], 1)
        if name in db["vms"]:
            fail(
                f"ERROR: (gcloud.alpha.compute.tpus.tpu-vm.create) ALREADY_EXISTS: node {name} already exists",
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
        if name in db["qrs"]:
            fail(f"ERROR: ALREADY_EXISTS: queued resource {name}", 1)
        db["qrs"][name] = {
            "zone": zone,
            "type": one(flags, "accelerator-type"),
            "waiting": int(sc.get("qr_waiting_describes", 1)),
            "state": "WAITING_FOR_RESOURCES",
        }
        save("db.json", db)
        return 0
    if group == "queued-resources" and verb == "describe":
        qr = db["qrs"].get(name)
        if qr is None or qr["zone"] != zone:
            not_found("queued-resources.describe", project, zone, name)
        if qr["waiting"] > 0:
            qr["waiting"] -= 1
        elif qr["state"] != "ACTIVE":
            qr["state"] = "ACTIVE"
            new_vm(db, sc, name, zone, qr["type"])
        save("db.json", db)
        print(
            qr["state"] if one(flags, "format") == "value(state.state)" else f"state:\n  state: {qr['state']}"
        )
        return 0
    if group == "queued-resources" and verb == "delete":
        if name not in db["qrs"]:
            not_found("queued-resources.delete", project, zone, name)
        if "force" not in flags and name in db["vms"]:
            fail("ERROR: FAILED_PRECONDITION: the queued resource has a node; use --force", 1)
        del db["qrs"][name]
        db["vms"].pop(name, None)
        rmtree(homes_of(name))
        save("db.json", db)
        return 0
    fail(f"ERROR: (fake gcloud) unhandled {group} {verb}", 2)
    return 2


if __name__ == "__main__":
    sys.exit(main())
