#!/usr/bin/env bash
# tpu/tpu.sh: Cloud TPU VMs for mllm_rl, from create to results, with gcloud only.
#
#   tpu/tpu.sh SUBCOMMAND [FLAGS] [-- ARGS FOR python -m mllm_rl.run]
#
# Every subcommand takes --dry-run (print the gcloud commands, run nothing).
# See tpu/tpu.sh --help, tpu/tpu.sh SUBCOMMAND --help and docs/TPU.md.
set -euo pipefail

# shellcheck source=tpu/lib.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/lib.sh"

COMMON_FLAGS='Target (flags win over the environment; nothing is hard-coded):
  --project P          GCP project          (env TPU_PROJECT, else CLOUDSDK_CORE_PROJECT)
  --zone Z | --zones Z1,Z2
                       zone, or zones to try in order on create (env TPU_ZONES); each must offer
                       the generation of --type: v4 exists in us-central2-b only
  --name N             TPU VM name          (env TPU_NAME)
  --dry-run            print the gcloud commands (lines starting with "DRY-RUN: "), run nothing
  -h, --help           this help'

usage() {
  cat <<EOF
usage: tpu/tpu.sh SUBCOMMAND [FLAGS] [-- ARGS FOR python -m mllm_rl.run]

Cloud TPU VM lifecycle for mllm_rl runs (docs/TPU.md walks through it).

Subcommands:
  create   create the TPU VM (spot by default), trying each zone on capacity errors
  wait     wait until the VM is READY and every worker answers SSH
  setup    Python 3.12 + venv + the repo at the local commit (git) + pip install, on every worker
           (idempotent: a marker ~/.mllm_rl_setup_<commit> skips work already done)
  env      copy a local .env (WANDB_API_KEY=...) to ~/.mllm_rl.env (mode 600) on every worker
  run      free the TPU, assert JAX sees it, start python -m mllm_rl.run --backend jax ... (detached)
  watch    follow the run; on PREEMPTED/TERMINATED recreate the VM and re-run with --resume-or-start
  fetch    bring runs/<run_id>/ back from every worker into runs/<run_id>/worker<i>/
  delete   delete the VM (or the queued resource)
  up       create + wait + setup + env + run + watch + fetch, then delete (unless --keep)

$COMMON_FLAGS

Example (v4-8 spot, Qwen3-4B param swap; v4 exists in us-central2-b only):
  export TPU_PROJECT=my-project TPU_ZONES=us-central2-b TPU_NAME=mllm-rl-v4-8
  tpu/tpu.sh up --type v4-8 -- --plan swap --model Qwen/Qwen3-4B --tp 4
EOF
}

help_for() {
  case $1 in
    create)
      cat <<EOF
usage: tpu/tpu.sh create [FLAGS]

Creates the TPU VM:
  gcloud compute tpus tpu-vm create NAME --project=P --zone=Z --accelerator-type=T --version=V --spot --quiet
With --queued:
  gcloud compute tpus queued-resources create NAME --node-id=NAME ... --runtime-version=V [--spot]
    --valid-until-duration=D --quiet
Every zone must offer the type's generation (Google's TPU regions and zones page): v4 only
us-central2-b; v5e $(family_zones v5e); v6e $(family_zones v6e).
Another zone is refused (exit 2) unless --any-zone. Zones are tried in order. A capacity error
(no more capacity, RESOURCE_EXHAUSTED, insufficient capacity, stockout) moves to the next zone;
a quota or permission error (PERMISSION_DENIED, quota, 403) or any other error (INVALID_ARGUMENT,
ALREADY_EXISTS, ...) stops at once with one line naming the zone.

  --type T             accelerator type: v4-*, v5litepod-* (v5e), v6e-*   (default v4-8; env TPU_TYPE)
  --version V          runtime image (default: v4 tpu-ubuntu2204-base, v5e v2-alpha-tpuv5-lite,
                       v6e v2-alpha-tpuv6e; env TPU_VERSION)
  --spot               spot VM (default)
  --on-demand          on-demand VM
  --queued             create through a queued resource (waits in the queue for capacity). A
                       SUSPENDED or FAILED queued resource of the same name (a preempted or
                       expired one) is deleted first: it holds the name until deleted
  --valid-until-duration D
                       --queued: Google fails the request if not fulfilled within D (12h, 90m,
                       1d; default 12h; env TPU_VALID_UNTIL_DURATION); wait waits D + --timeout
  --any-zone           skip the zone check (a zone Google added after tpu/lib.sh's table)

$COMMON_FLAGS
EOF
      ;;
    wait)
      cat <<EOF
usage: tpu/tpu.sh wait [FLAGS]

Polls 'describe --format=value(state)' until READY (a queued resource: ACTIVE first), then
'ssh --worker=all --command=true' until every worker answers. PREEMPTED or TERMINATED fails
at once; so does a queued resource that is FAILED (expired) or SUSPENDED.

  --timeout S          give up after S seconds (default 1800; env TPU_TIMEOUT_S); a queued
                       resource gets --valid-until-duration + S to become ACTIVE, then S more
  --poll S             seconds between polls (default 30; env TPU_POLL_S)
  --queued             the VM was created with --queued
  --valid-until-duration D   the queued request's lifetime (default 12h)

$COMMON_FLAGS
EOF
      ;;
    setup)
      cat <<EOF
usage: tpu/tpu.sh setup [FLAGS]

On every worker, over SSH: Python 3.12 (python3.12 if present, else the deadsnakes PPA, else
Miniconda in ~/miniconda3), the repo at the SAME commit as here (git clone/fetch + checkout of
the remote URL; code is never copied with scp), a venv ~/REMOTE_DIR/.venv-jax and
pip install -e '.[jax,tpu,wandb]' -f $LIBTPU_URL.
A marker ~/.mllm_rl_setup_<commit> makes a second setup of the same commit a no-op.

  --repo-url U         git URL the workers clone (default: git remote get-url origin; a GitHub
                       SSH URL is turned into https; env TPU_REPO_URL)
  --commit C           commit to check out (default: local HEAD; push it first; env TPU_COMMIT)
  --remote-dir D       checkout on the workers, relative to \$HOME (default mllm_rl)
  --force              ignore the marker and set up again
  --workers N          number of workers (default: from the VM, else the accelerator type)

$COMMON_FLAGS
EOF
      ;;
    env)
      cat <<EOF
usage: tpu/tpu.sh env [FLAGS]

Copies a local env file (e.g. WANDB_API_KEY=..., HF_TOKEN=...) to ~/.mllm_rl.env (mode 600)
on every worker with 'gcloud ... scp --worker=all'. The secret never appears on a command
line or in a log; --dry-run prints the scp command, not the content. 'run' sources the file.

  --env-file F         the file to copy (default: .env at the repo root; env TPU_ENV_FILE)

$COMMON_FLAGS
EOF
      ;;
    run)
      cat <<EOF
usage: tpu/tpu.sh run [FLAGS] -- [ARGS FOR python -m mllm_rl.run]

On every worker at once (--worker=all): kill stale mllm_rl.run processes and whatever holds
/dev/accel* or /dev/vfio/*, assert python -c 'import jax; assert jax.devices()[0].platform == "tpu"'
(fails clearly if JAX fell back to CPU), source ~/.mllm_rl.env if present, then start
  nohup python -m mllm_rl.run --backend jax --run-id ID --run-dir runs/ID ARGS...
in ~/REMOTE_DIR with WANDB_MODE=offline unless ARGS say --wandb MODE (or the env file sets
WANDB_MODE). Each worker logs to ~/REMOTE_DIR/runs/tpu-NAME-w<worker>.log.
On a multi-host slice (v4-16, ...) every worker runs one process of the same run; with
--jax-dist env each gets MLLM_RL_COORDINATOR=<worker 0>:$COORDINATOR_PORT, MLLM_RL_NUM_PROCESSES=<workers>
and MLLM_RL_PROCESS_ID=<its worker number>, read from the TPU metadata server.

  --run-id ID          run id (default NAME-<utc time>); remembered in runs/.tpu/NAME.run_id
  --remote-dir D       checkout on the workers (default mllm_rl)
  --jax-dist env|auto  multi-host only: set the MLLM_RL_* variables per worker (env, default;
                       env TPU_JAX_DIST) or leave it to jax's Cloud TPU detection (auto)
  --workers N          number of workers (default: from the VM, else the accelerator type)

ARGS examples: --plan swap --model Qwen/Qwen3-4B --tp 4 | --plan rl --model qwen3-0.6b --wandb online

$COMMON_FLAGS
EOF
      ;;
    watch)
      cat <<EOF
usage: tpu/tpu.sh watch [FLAGS] [-- ARGS FOR python -m mllm_rl.run]

Polls the VM and the run until the run ends (exit 0 when every worker exited 0). On
PREEMPTED or TERMINATED (or the VM gone): delete, create (same zone fallback), wait, setup,
env (if the env file exists) and run again with --resume-or-start appended, at most --max-recoveries
times. Without ARGS and --run-id, the ones of the last 'tpu.sh run' from this machine are used.

  --max-recoveries N   recoveries before giving up (default 3)
  --poll S             seconds between polls (default 30)
  --run-timeout S      fail if the run is not done after S seconds (default 0: no limit)
  --run-id ID          the run to follow
  plus the create flags (--type, --version, --spot/--on-demand, --queued, --valid-until-duration,
  --any-zone) and setup/env/run flags used by a recovery. A queued VM's recovery deletes its
  SUSPENDED queued resource (which holds the name) and queues it again under the same name

$COMMON_FLAGS
EOF
      ;;
    fetch)
      cat <<EOF
usage: tpu/tpu.sh fetch [FLAGS]

Copies runs/<run_id>/ (phases.jsonl, run.json, trace, wandb/ offline runs) and the worker's
log from every worker into runs/<run_id>/worker<i>/ here, with
'gcloud ... scp --recurse --worker=i'.

  --run-id ID          the run (default: the last 'tpu.sh run' from this machine for NAME)
  --local-dir D        where runs/ is here (default: runs/ at the repo root; env TPU_LOCAL_RUNS)
  --workers N          number of workers (default: from the VM, else the accelerator type)

$COMMON_FLAGS
EOF
      ;;
    delete)
      cat <<EOF
usage: tpu/tpu.sh delete [FLAGS]

  gcloud compute tpus tpu-vm delete NAME --project=P --zone=Z --quiet
With --queued: gcloud compute tpus queued-resources delete NAME ... --force --quiet
(which deletes the VM too).

$COMMON_FLAGS
EOF
      ;;
    up)
      cat <<EOF
usage: tpu/tpu.sh up [FLAGS] -- [ARGS FOR python -m mllm_rl.run]

create, wait, setup, env (when the env file exists), run, watch (with recoveries), fetch,
then delete the VM on exit, success or not, unless --keep. Takes the flags of every step.
With --queued the request waits up to --valid-until-duration (default 12h) in the queue; only
then, or on Ctrl-C or an error, is it deleted (--keep keeps it, and your place in the queue).

  --keep               keep the VM at the end
  (see: tpu/tpu.sh create|wait|setup|env|run|watch|fetch --help)

$COMMON_FLAGS
EOF
      ;;
    *) usage ;;
  esac
}

cmd_create() {
  require_target
  create_vm
  log "next: tpu/tpu.sh wait --name $NAME --zone $ZONE --project $PROJECT"
}

cmd_wait() { require_target; resolve_zone; wait_vm; }
cmd_setup() { require_target; resolve_zone; setup_vm; }
cmd_env() { require_target; resolve_zone; env_vm; }
cmd_run() { require_target; resolve_zone; run_vm; }
cmd_delete() { require_target; resolve_zone; delete_vm; }
cmd_fetch() { require_target; resolve_zone; load_run_state; fetch_vm; }
cmd_watch() { require_target; check_zones; resolve_zone; load_run_state; watch_vm; }

# up: the whole life of one VM. The EXIT trap deletes the VM once it was created, whatever
# happens after (errors, Ctrl-C), unless --keep.
cleanup_up() {
  local rc=$?
  trap - EXIT
  if ((CREATED)); then
    if ((KEEP)); then
      log "keeping $NAME in $ZONE (--keep); delete it with: tpu/tpu.sh delete --name $NAME --zone $ZONE --project $PROJECT"
    else
      log "deleting $NAME in $ZONE (pass --keep to keep it)"
      delete_vm || true
    fi
  fi
  exit "$rc"
}

cmd_up() {
  require_target
  check_zones
  resolve_repo # fail on a missing --repo-url/--commit before paying for a VM
  [[ -f $ENV_FILE || $ENV_FILE_SET == 0 ]] || die2 "env file $ENV_FILE not found"
  trap cleanup_up EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
  create_vm
  wait_vm
  setup_vm
  env_if_present
  run_vm
  local rc=0
  watch_vm || rc=$?
  vm_state
  if [[ $STATE == READY ]]; then
    fetch_vm || rc=1
  else
    warn "TPU $NAME is $STATE: nothing to fetch"
  fi
  if ((rc == 0)); then
    log "done: results in $LOCAL_RUNS/$RUN_ID/worker<i>/"
  fi
  return "$rc"
}

main() {
  exec 3>&1 # --dry-run prints commands here, even from inside command substitutions
  local sub=${1:-}
  case $sub in
    "" | -h | --help | help)
      usage
      [[ -n $sub ]] || exit 2
      exit 0
      ;;
    create | wait | setup | env | run | watch | fetch | delete | up) shift ;;
    *) die2 "unknown subcommand '$sub' (create wait setup env run watch fetch delete up; see --help)" ;;
  esac
  parse_args "$@"
  if ((SHOW_HELP)); then
    help_for "$sub"
    exit 0
  fi
  check_ints
  if ((PASSTHRU_SET)) && [[ $sub != run && $sub != watch && $sub != up ]]; then
    die2 "'$sub' takes no arguments after --"
  fi
  "cmd_$sub"
}

main "$@"
