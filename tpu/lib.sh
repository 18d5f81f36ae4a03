#!/usr/bin/env bash
# Shared code of tpu/tpu.sh: configuration, argument parsing, the gcloud wrapper (with
# --dry-run), the remote scripts sent over SSH, and one function per step (create, wait,
# setup, env, run, fetch, watch, delete). Sourced by tpu.sh; not meant to be run.
#
# Portable to bash 3.2 (macOS): no associative arrays, no mapfile, no ${x,,}, and empty
# arrays are expanded as ${a[@]+"${a[@]}"} under `set -u`.
# shellcheck disable=SC2034  # globals set here are read by tpu.sh
# shellcheck disable=SC2016  # remote scripts are single-quoted on purpose: they expand on the worker

TPU_LIB_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_ROOT=$(cd "$TPU_LIB_DIR/.." && pwd)

# ---------------------------------------------------------------- configuration
# Everything that names a cloud resource comes from flags or the environment; nothing is
# hard-coded. Flags win over the environment.
PROJECT=${TPU_PROJECT:-${CLOUDSDK_CORE_PROJECT:-}}
ZONES=${TPU_ZONES:-${TPU_ZONE:-}}
ZONE=""                                   # the zone in use, resolved from ZONES
NAME=${TPU_NAME:-}
ACCEL=${TPU_TYPE:-v4-8}
VERSION=${TPU_VERSION:-}
PROVISIONING=spot                         # spot | on-demand
QUEUED=0
TIMEOUT=${TPU_TIMEOUT_S:-1800}            # wait: READY + SSH, seconds
POLL=${TPU_POLL_S:-30}                    # seconds between polls (wait, watch)
RUN_TIMEOUT=${TPU_RUN_TIMEOUT_S:-0}       # watch/up: give up on a run after this many seconds (0: never)
MAX_RECOVERIES=${TPU_MAX_RECOVERIES:-3}
REPO_URL=${TPU_REPO_URL:-}
COMMIT=${TPU_COMMIT:-}
REMOTE_DIR=${TPU_REMOTE_DIR:-mllm_rl}     # checkout on every worker, relative to the remote $HOME
ENV_FILE=${TPU_ENV_FILE:-}
ENV_FILE_SET=0
RUN_ID=${TPU_RUN_ID:-}
LOCAL_RUNS=${TPU_LOCAL_RUNS:-$REPO_ROOT/runs}
WORKERS=${TPU_WORKERS:-}
KEEP=0
FORCE=0
ANY_ZONE=${TPU_ANY_ZONE:-0}               # 1: skip the documented-zone check of create (a zone newer than the table)
# Queued resources: Google fails the request (state FAILED) if it is not fulfilled within this
# long (gcloud --valid-until-duration); wait gives the queue this long plus --timeout.
VALID_UNTIL=${TPU_VALID_UNTIL_DURATION:-12h}
VALID_UNTIL_S=0
# How the processes of a multi-host run find each other (run): env = MLLM_RL_COORDINATOR /
# MLLM_RL_NUM_PROCESSES / MLLM_RL_PROCESS_ID set on each worker from the metadata server;
# auto = nothing set, jax's own Cloud TPU detection (backends/jax/distributed.py).
JAX_DIST=${TPU_JAX_DIST:-env}
COORDINATOR_PORT=${TPU_COORDINATOR_PORT:-8482} # jax's own port for a Cloud TPU coordinator
DRY_RUN=0
SHOW_HELP=0
PASSTHRU=()                               # arguments after `--`, passed to python -m mllm_rl.run
PASSTHRU_SET=0
# Host-key checking goes through gcloud's own --strict-host-key-checking (yes | no | ask):
# gcloud puts its own -o StrictHostKeyChecking=... before any --ssh-flag, and OpenSSH keeps the
# first value it is given, so an -oStrictHostKeyChecking ssh flag would have no effect. `no`
# lets the first contact with a (re)created worker through without a prompt; gcloud keeps the
# keys per VM in ~/.ssh/google_compute_known_hosts.
STRICT_HOST_KEYS=${TPU_STRICT_HOST_KEY_CHECKING:-no}
# Extra OpenSSH options, one word each (gcloud splits --ssh-flag values on spaces); none of them
# is one gcloud sets itself, so they take effect.
read -r -a SSH_OPTS <<<"${TPU_SSH_OPTS:--oConnectTimeout=30 -oServerAliveInterval=30}"

GCLOUD=${TPU_GCLOUD:-gcloud}             # the gcloud binary (tests point this at a fake)
TPU_CMD=(compute tpus tpu-vm)            # GA groups: neither needs `gcloud alpha`
QR_CMD=(compute tpus queued-resources)
LIBTPU_URL=https://storage.googleapis.com/jax-releases/libtpu_releases.html
MINICONDA_URL=https://repo.anaconda.com/miniconda/Miniconda3-latest-Linux-x86_64.sh
DRY_PREFIX="DRY-RUN:"

# ---------------------------------------------------------------- messages
log() { printf '[tpu] %s\n' "$*" >&2; }
warn() { printf '[tpu] warning: %s\n' "$*" >&2; }
# die MESSAGE [CODE]: one line on stderr, exit CODE (default 1).
die() { printf 'tpu.sh: error: %s\n' "$1" >&2; exit "${2:-1}"; }
# usage errors exit 2
die2() { die "$1" 2; }

now() { date +%s; }

# ---------------------------------------------------------------- quoting
# q ARG: ARG quoted for a POSIX shell, like Python's shlex.quote (safe words stay bare).
q() {
  local s=$1 sq="'\\''"
  if [[ -n $s && $s =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then
    printf '%s' "$s"
  else
    printf "'%s'" "${s//\'/$sq}"
  fi
}

# qargs ARG...: every ARG quoted, joined by spaces.
qargs() {
  local out="" a
  for a in "$@"; do out+="${out:+ }$(q "$a")"; done
  printf '%s' "$out"
}

# oneline TEXT: a template made one line: leading blanks, blank lines and comment lines
# dropped, lines joined by a space. Templates end every statement explicitly (; && then do).
oneline() {
  local out="" line
  while IFS= read -r line || [[ -n $line ]]; do
    line=${line#"${line%%[![:space:]]*}"}
    [[ -z $line || $line == \#* ]] && continue
    out+="${out:+ }$line"
  done <<<"$1"
  printf '%s' "$out"
}

# render TEMPLATE KEY VALUE...: every @KEY@ replaced by VALUE (already quoted by the caller).
render() {
  local t=$1
  shift
  while (($# >= 2)); do
    t=${t//"@$1@"/"$2"}
    shift 2
  done
  oneline "$t"
}

# ---------------------------------------------------------------- gcloud
# gc ARG...: run gcloud, or under --dry-run print the command (one line, prefixed) and
# succeed with no output. Printed commands go to fd 3 (tpu.sh's stdout), so they show up
# even from inside a command substitution.
gc() {
  if ((DRY_RUN)); then
    printf '%s %s\n' "$DRY_PREFIX" "$(qargs gcloud "$@")" >&3
    return 0
  fi
  "$GCLOUD" "$@"
}

# The host-key setting and the SSH/SCP option words as gcloud flags.
ssh_flags() {
  local o
  printf '%s\n' "--strict-host-key-checking=$STRICT_HOST_KEYS"
  for o in ${SSH_OPTS[@]+"${SSH_OPTS[@]}"}; do printf '%s\n' "--ssh-flag=$o"; done
}
scp_flags() {
  local o
  printf '%s\n' "--strict-host-key-checking=$STRICT_HOST_KEYS"
  for o in ${SSH_OPTS[@]+"${SSH_OPTS[@]}"}; do printf '%s\n' "--scp-flag=$o"; done
}

# ssh_all SCRIPT: SCRIPT on every worker; gcloud's exit status.
ssh_all() {
  local -a extra=()
  local f
  while IFS= read -r f; do extra+=("$f"); done < <(ssh_flags)
  gc "${TPU_CMD[@]}" ssh "$NAME" "--project=$PROJECT" "--zone=$ZONE" --worker=all --quiet \
    ${extra[@]+"${extra[@]}"} "--command=$1"
}

# scp_tpu WORKER ARG...: gcloud scp with the target, the worker and our host-key options.
scp_tpu() {
  local worker=$1 f
  shift
  local -a extra=()
  while IFS= read -r f; do extra+=("$f"); done < <(scp_flags)
  gc "${TPU_CMD[@]}" scp "$@" "--project=$PROJECT" "--zone=$ZONE" "--worker=$worker" --quiet \
    ${extra[@]+"${extra[@]}"}
}

# vm_state: sets STATE to the node's state (READY, CREATING, PREEMPTED, ...), NOT_FOUND when
# it does not exist, or ERROR (LAST_ERROR says why). Under --dry-run: prints the describe
# command and says READY.
STATE=""
LAST_ERROR=""
vm_state() {
  LAST_ERROR=""
  if ((DRY_RUN)); then
    gc "${TPU_CMD[@]}" describe "$NAME" "--project=$PROJECT" "--zone=$ZONE" '--format=value(state)'
    STATE=READY
    return 0
  fi
  local out err rc=0
  err=$(mktemp "${TMPDIR:-/tmp}/tpu-describe.XXXXXX")
  out=$("$GCLOUD" "${TPU_CMD[@]}" describe "$NAME" "--project=$PROJECT" "--zone=$ZONE" '--format=value(state)' 2>"$err") || rc=$?
  if ((rc == 0)); then
    STATE=${out:-UNKNOWN}
  elif grep -Eq 'NOT_FOUND|not found' "$err"; then
    STATE=NOT_FOUND
  else
    STATE=ERROR
    LAST_ERROR=$(grep -v '^[[:space:]]*$' "$err" | tail -n 1 || true)
  fi
  rm -f "$err"
}

# qr_state: sets QR_STATE to the state of the queued resource NAME in ZONE:
# WAITING_FOR_RESOURCES, PROVISIONING, ACTIVE, FAILED, SUSPENDING, SUSPENDED, ...;
# NOT_FOUND when there is none, ERROR otherwise (LAST_ERROR says why).
QR_STATE=""
qr_state() {
  local zone=$ZONE
  LAST_ERROR=""
  if ((DRY_RUN)); then
    gc "${QR_CMD[@]}" describe "$NAME" "--project=$PROJECT" "--zone=$zone" '--format=value(state.state)'
    QR_STATE=ACTIVE
    return 0
  fi
  local out err rc=0
  err=$(mktemp "${TMPDIR:-/tmp}/tpu-qr.XXXXXX")
  out=$("$GCLOUD" "${QR_CMD[@]}" describe "$NAME" "--project=$PROJECT" "--zone=$zone" '--format=value(state.state)' 2>"$err") || rc=$?
  if ((rc == 0)); then
    QR_STATE=${out:-UNKNOWN}
  elif grep -Eq 'NOT_FOUND|not found' "$err"; then
    QR_STATE=NOT_FOUND
  else
    QR_STATE=ERROR
    LAST_ERROR=$(grep -v '^[[:space:]]*$' "$err" | tail -n 1 || true)
  fi
  rm -f "$err"
}

# ---------------------------------------------------------------- validation
is_uint() { [[ $1 =~ ^[0-9]+$ ]]; }

# accel_family TYPE: v4 | v5e | v6e, or nothing for an unsupported type.
accel_family() {
  case $1 in
    v4-[0-9]*) echo v4 ;;
    v5litepod-[0-9]*) echo v5e ;;
    v6e-[0-9]*) echo v6e ;;
  esac
}

# default_version TYPE: the TPU VM runtime image for the accelerator generation.
default_version() {
  case $(accel_family "$1") in
    v4) echo tpu-ubuntu2204-base ;;
    v5e) echo v2-alpha-tpuv5-lite ;;
    v6e) echo v2-alpha-tpuv6e ;;
  esac
}

# hosts_for_type TYPE: number of TPU VM hosts (workers) of a slice. v4-N counts TensorCores
# (2 per chip, 4 chips per host); v5litepod-N / v6e-N count chips (up to 8 on one host,
# 4 per host in multi-host slices).
hosts_for_type() {
  local n=${1##*-}
  case $(accel_family "$1") in
    v4) echo $(((n / 2 + 3) / 4)) ;;
    v5e | v6e) if ((n <= 8)); then echo 1; else echo $((n / 4)); fi ;;
    *) echo 1 ;;
  esac
}

check_type() {
  [[ -n $(accel_family "$ACCEL") && ${ACCEL##*-} =~ ^[0-9]+$ ]] ||
    die2 "unsupported accelerator type '$ACCEL' (supported: v4-*, v5litepod-*, v6e-*)"
  [[ -n $VERSION ]] || VERSION=$(default_version "$ACCEL")
}

# family_zones FAMILY: the zones Google's "TPU regions and zones" page
# (https://cloud.google.com/tpu/docs/regions-zones) lists for the generation. v4 exists in
# us-central2-b only (every version of the page says so). The v5e and v6e lists are the page's
# North America and Europe entries; zones it adds later (and Asia Pacific ones) need --any-zone.
ZONES_DOC=https://cloud.google.com/tpu/docs/regions-zones
family_zones() {
  case $1 in
    v4) echo "us-central2-b" ;;
    v5e) echo "us-central1-a us-south1-a us-west1-c us-west4-a europe-west4-b" ;;
    v6e) echo "us-central1-b us-east1-d us-east5-a us-east5-b europe-west4-a" ;;
  esac
}

# check_zones: every zone of ZONES offers the accelerator's generation; exit 2 with one line
# naming the first one that does not (a create there fails with INVALID_ARGUMENT, which is
# not a capacity error, so the zone fallback would stop at it). --any-zone skips the check.
check_zones() {
  check_type
  ((ANY_ZONE)) && return 0
  local fam known z
  fam=$(accel_family "$ACCEL")
  known=$(family_zones "$fam")
  for z in "${ZONE_LIST[@]}"; do
    case " $known " in
      *" $z "*) ;;
      *) die2 "zone $z has no TPU $fam ($ACCEL): $fam is offered in ${known// /, } only ($ZONES_DOC); pass --any-zone if Google lists $z for $fam now" ;;
    esac
  done
}

# duration_s D: seconds of a gcloud-style duration made of <int>s|m|h|d parts (90m, 1h30m, 2d);
# fails on anything else.
duration_s() {
  local rest=$1 total=0 n unit
  [[ -n $rest ]] || return 1
  while [[ -n $rest ]]; do
    [[ $rest =~ ^([0-9]+)([smhd])(.*)$ ]] || return 1
    n=$((10#${BASH_REMATCH[1]}))
    unit=${BASH_REMATCH[2]}
    rest=${BASH_REMATCH[3]}
    case $unit in
      s) total=$((total + n)) ;;
      m) total=$((total + n * 60)) ;;
      h) total=$((total + n * 3600)) ;;
      d) total=$((total + n * 86400)) ;;
    esac
  done
  printf '%s' "$total"
}

# require_target: project, zone(s) and name are set and well-formed (exit 2 otherwise).
require_target() {
  [[ -n $PROJECT ]] || die2 "no project: pass --project P or set TPU_PROJECT (or CLOUDSDK_CORE_PROJECT)"
  [[ -n $ZONES ]] || die2 "no zone: pass --zone Z or --zones Z1,Z2 or set TPU_ZONES"
  [[ -n $NAME ]] || die2 "no TPU name: pass --name N or set TPU_NAME"
  [[ $PROJECT =~ ^[a-z][-a-z0-9.:]*$ ]] || die2 "bad project id '$PROJECT'"
  [[ $NAME =~ ^[a-z]([-a-z0-9]*[a-z0-9])?$ ]] || die2 "bad TPU name '$NAME' (lowercase letters, digits, '-')"
  local z
  IFS=, read -r -a ZONE_LIST <<<"$ZONES"
  ((${#ZONE_LIST[@]} > 0)) || die2 "no zone in '$ZONES'"
  for z in "${ZONE_LIST[@]}"; do
    [[ $z =~ ^[a-z0-9-]+$ ]] || die2 "bad zone '$z' in '$ZONES'"
  done
  if [[ -z $ZONE && ${#ZONE_LIST[@]} -eq 1 ]]; then ZONE=${ZONE_LIST[0]}; fi
}
ZONE_LIST=()

# resolve_zone: with several zones, the one where the node exists (first one under --dry-run).
resolve_zone() {
  [[ -n $ZONE ]] && return 0
  if ((DRY_RUN)); then
    ZONE=${ZONE_LIST[0]}
    return 0
  fi
  local z
  for z in "${ZONE_LIST[@]}"; do
    if "$GCLOUD" "${TPU_CMD[@]}" describe "$NAME" "--project=$PROJECT" "--zone=$z" '--format=value(state)' >/dev/null 2>&1; then
      ZONE=$z
      log "found $NAME in zone $z"
      return 0
    fi
  done
  die "TPU $NAME not found in any of the zones $ZONES"
}

check_ints() {
  local pair
  for pair in "--timeout:$TIMEOUT" "--poll:$POLL" "--max-recoveries:$MAX_RECOVERIES" "--run-timeout:$RUN_TIMEOUT"; do
    is_uint "${pair#*:}" || die2 "${pair%%:*} needs a non-negative integer, got '${pair#*:}'"
  done
  [[ -z $WORKERS ]] || { is_uint "$WORKERS" && ((WORKERS > 0)); } || die2 "--workers needs a positive integer, got '$WORKERS'"
  [[ -z $RUN_ID || $RUN_ID =~ ^[A-Za-z0-9._-]+$ ]] || die2 "bad run id '$RUN_ID' (letters, digits, . _ -)"
  [[ $REMOTE_DIR =~ ^[A-Za-z0-9._/-]+$ ]] || die2 "bad --remote-dir '$REMOTE_DIR'"
  VALID_UNTIL_S=$(duration_s "$VALID_UNTIL") || VALID_UNTIL_S=0
  ((VALID_UNTIL_S > 0)) || die2 "--valid-until-duration needs a duration like 12h, 90m or 1d, got '$VALID_UNTIL'"
  case $STRICT_HOST_KEYS in
    yes | no | ask) ;;
    *) die2 "TPU_STRICT_HOST_KEY_CHECKING must be yes, no or ask (gcloud's --strict-host-key-checking), got '$STRICT_HOST_KEYS'" ;;
  esac
  local o
  for o in ${SSH_OPTS[@]+"${SSH_OPTS[@]}"}; do
    case $o in
      *[Ss]trict[Hh]ost[Kk]ey[Cc]hecking*)
        die2 "TPU_SSH_OPTS has '$o', which has no effect (gcloud passes its own StrictHostKeyChecking first); set TPU_STRICT_HOST_KEY_CHECKING=yes|no|ask instead" ;;
    esac
  done
  case $JAX_DIST in
    env | auto) ;;
    *) die2 "--jax-dist must be env or auto, got '$JAX_DIST'" ;;
  esac
  { is_uint "$COORDINATOR_PORT" && ((COORDINATOR_PORT > 0 && COORDINATOR_PORT < 65536)); } ||
    die2 "TPU_COORDINATOR_PORT must be a port number, got '$COORDINATOR_PORT'"
  [[ $ANY_ZONE == 0 || $ANY_ZONE == 1 ]] || die2 "TPU_ANY_ZONE must be 0 or 1, got '$ANY_ZONE'"
}

# ---------------------------------------------------------------- arguments
# parse_args ARG...: flags of every subcommand (each subcommand reads the ones it needs).
parse_args() {
  local opt val has_val
  while (($#)); do
    opt=$1
    val=""
    has_val=0
    if [[ $opt == --*=* ]]; then
      val=${opt#*=}
      opt=${opt%%=*}
      has_val=1
    fi
    case $opt in
      --project | --zone | --zones | --name | --type | --accelerator-type | --version | --timeout | --poll | \
        --repo-url | --commit | --remote-dir | --env-file | --run-id | --local-dir | --workers | \
        --max-recoveries | --run-timeout | --valid-until-duration | --jax-dist)
        if ((!has_val)); then
          (($# >= 2)) || die2 "$opt needs a value"
          val=$2
          shift
        fi
        case $opt in
          --project) PROJECT=$val ;;
          --zone | --zones) ZONES=$val ;;
          --name) NAME=$val ;;
          --type | --accelerator-type) ACCEL=$val ;;
          --version) VERSION=$val ;;
          --timeout) TIMEOUT=$val ;;
          --poll) POLL=$val ;;
          --repo-url) REPO_URL=$val ;;
          --commit) COMMIT=$val ;;
          --remote-dir) REMOTE_DIR=$val ;;
          --env-file) ENV_FILE=$val ENV_FILE_SET=1 ;;
          --run-id) RUN_ID=$val ;;
          --local-dir) LOCAL_RUNS=$val ;;
          --workers) WORKERS=$val ;;
          --max-recoveries) MAX_RECOVERIES=$val ;;
          --run-timeout) RUN_TIMEOUT=$val ;;
          --valid-until-duration) VALID_UNTIL=$val ;;
          --jax-dist) JAX_DIST=$val ;;
        esac
        ;;
      --spot) PROVISIONING=spot ;;
      --on-demand) PROVISIONING=on-demand ;;
      --queued) QUEUED=1 ;;
      --any-zone) ANY_ZONE=1 ;;
      --keep) KEEP=1 ;;
      --force) FORCE=1 ;;
      --dry-run) DRY_RUN=1 ;;
      -h | --help) SHOW_HELP=1 ;;
      --)
        shift
        PASSTHRU=("$@")
        PASSTHRU_SET=1
        break
        ;;
      *) die2 "unknown argument '$1' (see tpu/tpu.sh --help)" ;;
    esac
    shift
  done
  if [[ -n $ENV_FILE ]]; then ENV_FILE_SET=1; else ENV_FILE=$REPO_ROOT/.env; fi
}

# ---------------------------------------------------------------- create
# create_vm: create the node (or queue the request for it), trying each zone in order. A
# capacity error moves on to the next zone; a quota/permission error (or any other, e.g. the
# INVALID_ARGUMENT of a zone without the generation) stops at once with one line.
create_vm() {
  check_zones
  local z rc errf line
  local -a prov=()
  [[ $PROVISIONING == spot ]] && prov=(--spot)
  for z in "${ZONE_LIST[@]}"; do
    ZONE=$z
    local -a cmd
    if ((QUEUED)); then
      cmd=("${QR_CMD[@]}" create "$NAME" "--node-id=$NAME" "--project=$PROJECT" "--zone=$z"
        "--accelerator-type=$ACCEL" "--runtime-version=$VERSION" ${prov[@]+"${prov[@]}"}
        "--valid-until-duration=$VALID_UNTIL" --quiet)
    else
      cmd=("${TPU_CMD[@]}" create "$NAME" "--project=$PROJECT" "--zone=$z"
        "--accelerator-type=$ACCEL" "--version=$VERSION" ${prov[@]+"${prov[@]}"} --quiet)
    fi
    if ((DRY_RUN)); then
      ((QUEUED)) && log "dry-run: a SUSPENDED or FAILED queued resource named $NAME in $z would be deleted first (it holds the name)"
      gc "${cmd[@]}"
      ((${#ZONE_LIST[@]} > 1)) && log "dry-run: on a capacity error the next zone of $ZONES would be tried"
      CREATED=1
      return 0
    fi
    ((QUEUED)) && clear_dead_qr
    log "creating $NAME ($ACCEL, $VERSION, $PROVISIONING$( ((QUEUED)) && echo ", queued, valid for $VALID_UNTIL")) in $z"
    errf=$(mktemp "${TMPDIR:-/tmp}/tpu-create-$NAME-$z.XXXXXX")
    rc=0
    "$GCLOUD" "${cmd[@]}" >/dev/null 2>"$errf" || rc=$?
    if ((rc == 0)); then
      rm -f "$errf"
      log "created $NAME in $z"
      CREATED=1
      return 0
    fi
    # Quota/permission first: quota errors may also say RESOURCE_EXHAUSTED.
    line=$(grep -E 'PERMISSION_DENIED|[Qq]uota|(^|[^0-9])403([^0-9]|$)' "$errf" | head -n 1 || true)
    if [[ -n $line ]]; then
      die "create $NAME in zone $z failed (quota/permission, not retried): $(trim "$line") [full output: $errf]"
    fi
    line=$(grep -Ei 'no more capacity|RESOURCE_EXHAUSTED|insufficient capacity|stockout|out of capacity|resource_pool_exhausted' "$errf" | head -n 1 || true)
    if [[ -n $line ]]; then
      log "no capacity for $ACCEL in $z: $(trim "$line")"
      rm -f "$errf"
      continue
    fi
    if grep -q 'ALREADY_EXISTS' "$errf"; then
      die "a TPU named $NAME already exists in zone $z (delete it or pick another --name) [full output: $errf]"
    fi
    line=$(grep -v '^[[:space:]]*$' "$errf" | tail -n 1 || true)
    die "create $NAME in zone $z failed: $(trim "${line:-gcloud exit $rc}") [full output: $errf]"
  done
  ZONE=""
  die "no capacity for $ACCEL in any zone ($ZONES)"
}
CREATED=0

# clear_dead_qr: a queued resource named NAME in ZONE that is SUSPENDED (its VM was preempted or
# deleted) or FAILED (expired after --valid-until-duration, or refused) keeps the name until it
# is deleted, so a new request under that name fails with ALREADY_EXISTS: delete it (and its
# node) first. A live one (waiting, provisioning, active) is refused, never deleted.
clear_dead_qr() {
  qr_state
  case $QR_STATE in
    NOT_FOUND | ERROR) return 0 ;; # ERROR: the create says what is wrong
    SUSPENDED | SUSPENDING | FAILED)
      log "queued resource $NAME in $ZONE is $QR_STATE and still holds the name: deleting it (and its node) before queuing again"
      delete_qr
      ;;
    *) die "a queued resource named $NAME already exists in zone $ZONE ($QR_STATE); wait for it, or delete it with: tpu/tpu.sh delete --queued --name $NAME --zone $ZONE --project $PROJECT" ;;
  esac
}

# delete_qr: delete the queued resource NAME in ZONE with --force (which deletes its node
# too), then a node of that name if one is left, and wait (within --timeout) until the name
# is free. Nothing to delete is fine.
delete_qr() {
  local deadline errf rc=0
  if ((DRY_RUN)); then
    gc "${QR_CMD[@]}" delete "$NAME" "--project=$PROJECT" "--zone=$ZONE" --force --quiet
    return 0
  fi
  errf=$(mktemp "${TMPDIR:-/tmp}/tpu-qr-delete.XXXXXX")
  "$GCLOUD" "${QR_CMD[@]}" delete "$NAME" "--project=$PROJECT" "--zone=$ZONE" --force --quiet >/dev/null 2>"$errf" || rc=$?
  if ((rc != 0)) && ! grep -Eq 'NOT_FOUND|not found' "$errf"; then
    die "delete of queued resource $NAME in $ZONE failed: $(grep -v '^[[:space:]]*$' "$errf" | tail -n 1 || true) [full output: $errf]"
  fi
  rm -f "$errf"
  deadline=$(($(now) + TIMEOUT))
  while :; do
    qr_state
    [[ $QR_STATE == NOT_FOUND ]] && break
    (($(now) < deadline)) || die "queued resource $NAME in $ZONE is still $QR_STATE ${TIMEOUT}s after its delete"
    sleep "$POLL"
  done
  vm_state
  if [[ $STATE != NOT_FOUND ]]; then
    log "deleting the node $NAME left in $ZONE ($STATE)"
    gc "${TPU_CMD[@]}" delete "$NAME" "--project=$PROJECT" "--zone=$ZONE" --quiet >/dev/null ||
      die "delete of node $NAME in $ZONE failed"
  fi
}

trim() { local s=$1; s=${s#"${s%%[![:space:]]*}"}; printf '%s' "${s%"${s##*[![:space:]]}"}"; }

# ---------------------------------------------------------------- delete
delete_vm() {
  if ((QUEUED)); then
    gc "${QR_CMD[@]}" delete "$NAME" "--project=$PROJECT" "--zone=$ZONE" --force --quiet && return 0
  else
    gc "${TPU_CMD[@]}" delete "$NAME" "--project=$PROJECT" "--zone=$ZONE" --quiet && return 0
  fi
  warn "delete of $NAME in $ZONE failed (check: gcloud ${TPU_CMD[*]} list --zone=$ZONE --project=$PROJECT)"
  return 1
}

# ---------------------------------------------------------------- wait
# wait_vm: READY (and, for a queued resource, ACTIVE first), then SSH on every worker,
# both within TIMEOUT seconds. PREEMPTED / TERMINATED / FAILED fail at once.
wait_vm() {
  local deadline last=""
  deadline=$(($(now) + TIMEOUT))
  if ((QUEUED)); then
    # The queue gets the request's own lifetime (--valid-until-duration; Google fails it after
    # that) plus --timeout: giving up earlier would delete (under `up`) a request still in line.
    local qdeadline
    qdeadline=$(($(now) + VALID_UNTIL_S + TIMEOUT))
    log "waiting for queued resource $NAME in $ZONE (up to --valid-until-duration $VALID_UNTIL + ${TIMEOUT}s)"
    while :; do
      qr_state
      case $QR_STATE in
        ACTIVE) break ;;
        FAILED) die "queued resource $NAME in zone $ZONE is FAILED: not fulfilled within --valid-until-duration $VALID_UNTIL, or refused (gcloud ${QR_CMD[*]} describe $NAME --zone=$ZONE says why)" ;;
        SUSPENDED | SUSPENDING) die "queued resource $NAME in zone $ZONE is $QR_STATE (its VM was preempted or deleted); 'tpu.sh watch --queued' or 'tpu.sh create --queued' queues it again" ;;
        NOT_FOUND) die "queued resource $NAME not found in zone $ZONE" ;;
      esac
      [[ $QR_STATE != "$last" ]] && log "queued resource $NAME: $QR_STATE${LAST_ERROR:+ ($LAST_ERROR)}"
      last=$QR_STATE
      (($(now) < qdeadline)) || die "timed out waiting for queued resource $NAME to be ACTIVE (last state: $QR_STATE)"
      sleep "$POLL"
    done
    deadline=$(($(now) + TIMEOUT))
  fi
  last=""
  while :; do
    vm_state
    case $STATE in
      READY) break ;;
      PREEMPTED | TERMINATED) die "TPU $NAME in zone $ZONE is $STATE (delete and recreate it, or use 'tpu.sh watch')" ;;
      NOT_FOUND) ((QUEUED)) || die "TPU $NAME not found in zone $ZONE" ;;
    esac
    [[ $STATE != "$last" ]] && log "TPU $NAME: $STATE${LAST_ERROR:+ ($LAST_ERROR)}"
    last=$STATE
    (($(now) < deadline)) || die "timed out after ${TIMEOUT}s waiting for $NAME to be READY (last state: $STATE)"
    sleep "$POLL"
  done
  log "TPU $NAME is READY; checking SSH on every worker"
  if ((DRY_RUN)); then
    ssh_all true
    return 0
  fi
  local tries=0 errf err=""
  errf=$(mktemp "${TMPDIR:-/tmp}/tpu-ssh.XXXXXX")
  while :; do
    tries=$((tries + 1))
    if ssh_all true >/dev/null 2>"$errf"; then
      rm -f "$errf"
      log "SSH reachable on every worker of $NAME (attempt $tries)"
      return 0
    fi
    err=$(grep -v '^[[:space:]]*$' "$errf" | tail -n 1 || true)
    if (($(now) >= deadline)); then
      rm -f "$errf"
      die "timed out after ${TIMEOUT}s: SSH to $NAME in $ZONE still failing after $tries attempts${err:+: $err}"
    fi
    log "SSH to $NAME not ready yet (attempt $tries${err:+: $err}); retrying"
    sleep "$POLL"
  done
}

# ---------------------------------------------------------------- workers
# ensure_workers: WORKERS = number of hosts, from the node's network endpoints, else from
# the accelerator type (always from the type under --dry-run).
ensure_workers() {
  [[ -n $WORKERS ]] && return 0
  local ips="" rc=0
  ips=$(gc "${TPU_CMD[@]}" describe "$NAME" "--project=$PROJECT" "--zone=$ZONE" \
    '--format=value(networkEndpoints[].ipAddress)' 2>/dev/null) || rc=$?
  if ((rc == 0 && !DRY_RUN)) && [[ -n $ips ]]; then
    local -a arr
    IFS=';' read -r -a arr <<<"$ips"
    WORKERS=${#arr[@]}
  else
    check_type
    WORKERS=$(hosts_for_type "$ACCEL")
  fi
}

# ---------------------------------------------------------------- repo / commit
RESOLVED_REPO=""
resolve_repo() {
  [[ -n $RESOLVED_REPO ]] && return 0
  RESOLVED_REPO=1
  if [[ -z $COMMIT ]]; then
    COMMIT=$(git -C "$REPO_ROOT" rev-parse HEAD 2>/dev/null) ||
      die2 "no --commit and $REPO_ROOT is not a git checkout"
    if [[ -n $(git -C "$REPO_ROOT" status --porcelain --untracked-files=no 2>/dev/null) ]]; then
      warn "the work tree has uncommitted changes; the TPU gets commit ${COMMIT:0:12} only"
    fi
  fi
  [[ $COMMIT =~ ^[0-9a-f]{7,40}$ ]] || die2 "bad --commit '$COMMIT' (a hex commit id)"
  if ((${#COMMIT} < 40)); then # the workers can fetch a full commit id only
    local full
    full=$(git -C "$REPO_ROOT" rev-parse --verify -q "$COMMIT^{commit}" 2>/dev/null) ||
      die2 "--commit $COMMIT: give the full 40-character id (a short one is not known here to expand)"
    COMMIT=$full
  fi
  if [[ -z $REPO_URL ]]; then
    REPO_URL=$(git -C "$REPO_ROOT" remote get-url origin 2>/dev/null) ||
      die2 "no --repo-url and no git remote 'origin' in $REPO_ROOT"
  fi
  # A GitHub SSH URL needs keys the TPU VM does not have; the https form works for public repos.
  if [[ $REPO_URL =~ ^git@github\.com:(.+)$ ]]; then
    REPO_URL="https://github.com/${BASH_REMATCH[1]}"
    log "using $REPO_URL on the workers (an SSH remote needs keys the TPU VM lacks)"
  fi
  if git -C "$REPO_ROOT" cat-file -e "$COMMIT^{commit}" 2>/dev/null &&
    [[ -z $(git -C "$REPO_ROOT" branch -r --contains "$COMMIT" 2>/dev/null) ]]; then
    warn "commit ${COMMIT:0:12} is on no remote-tracking branch: push it, or the workers cannot check it out"
  fi
}

# ---------------------------------------------------------------- remote scripts
# Each is one line (so --dry-run prints one line per command) and runs in the worker's
# login shell. Values are substituted already quoted. Every script reports its outcome as
# a `mllm_rl_<what>_ok|error worker=W ...` line that tpu.sh counts.
WORKER_ID_SNIPPET='W=$(curl -fsS -m 5 -H "Metadata-Flavor: Google" http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number 2>/dev/null || echo 0);'

setup_template() {
  cat <<'EOF'
set -euo pipefail;
@WORKER_ID@
C=@COMMIT@; D="$HOME"/@DIR@; M="$HOME/.mllm_rl_setup_$C";
if [ @FORCE@ = 1 ]; then rm -f "$M"; fi;
if [ -f "$M" ]; then echo "mllm_rl_setup_ok worker=$W commit=$C cached=1 (marker $M)"; exit 0; fi;
echo "[setup] worker $W: setting up commit $C in $D" >&2;
PY="";
for c in python3.12 "$HOME/miniconda3/envs/mllm_rl/bin/python3.12"; do if command -v "$c" >/dev/null 2>&1; then PY=$(command -v "$c"); break; fi; done;
if [ -z "$PY" ]; then
  echo "[setup] worker $W: no python3.12; installing it from the deadsnakes PPA" >&2;
  export DEBIAN_FRONTEND=noninteractive;
  { sudo -E apt-get update -qq && sudo -E apt-get install -y -qq software-properties-common && sudo -E add-apt-repository -y ppa:deadsnakes/ppa && sudo -E apt-get install -y -qq python3.12 python3.12-venv python3.12-dev; } >&2 || echo "[setup] worker $W: deadsnakes install failed" >&2;
  if command -v python3.12 >/dev/null 2>&1; then PY=$(command -v python3.12); fi;
fi;
if [ -z "$PY" ]; then
  echo "[setup] worker $W: falling back to Miniconda in ~/miniconda3" >&2;
  if [ ! -x "$HOME/miniconda3/bin/conda" ]; then curl -fsSL -o "$HOME/miniconda.sh" @MINICONDA_URL@ && bash "$HOME/miniconda.sh" -b -p "$HOME/miniconda3" >&2 && rm -f "$HOME/miniconda.sh"; fi;
  "$HOME/miniconda3/bin/conda" tos accept --override-channels --channel https://repo.anaconda.com/pkgs/main >/dev/null 2>&1 || true;
  "$HOME/miniconda3/bin/conda" tos accept --override-channels --channel https://repo.anaconda.com/pkgs/r >/dev/null 2>&1 || true;
  "$HOME/miniconda3/bin/conda" create -y -q -n mllm_rl python=3.12 >&2;
  PY="$HOME/miniconda3/envs/mllm_rl/bin/python3.12";
fi;
"$PY" -c 'import sys; assert sys.version_info[:2] == (3, 12), sys.version' || { echo "mllm_rl_setup_error worker=$W $PY is not Python 3.12"; exit 4; };
if [ -d "$D/.git" ]; then git -C "$D" remote set-url origin @REPO_URL@ && git -C "$D" fetch -q --prune origin >&2; else git clone -q @REPO_URL@ "$D" >&2; fi;
git -C "$D" cat-file -e "$C^{commit}" 2>/dev/null || git -C "$D" fetch -q origin "$C" >&2 || { echo "mllm_rl_setup_error worker=$W commit $C not found at @REPO_URL@ (pushed?)"; exit 4; };
git -C "$D" checkout -q --force --detach "$C" >&2;
V="$D/.venv-jax";
if [ ! -x "$V/bin/python" ]; then "$PY" -m venv "$V"; fi;
"$V/bin/python" -m pip install -q -U pip >&2;
"$V/bin/python" -m pip install -q -e "$D[jax,tpu,wandb]" -f @LIBTPU_URL@ >&2;
"$V/bin/python" -c 'import jax, mllm_rl' || { echo "mllm_rl_setup_error worker=$W the venv cannot import jax and mllm_rl"; exit 4; };
touch "$M";
echo "mllm_rl_setup_ok worker=$W commit=$C cached=0 python=$("$V/bin/python" -V 2>&1)";
EOF
}

setup_script() {
  render "$(setup_template)" WORKER_ID "$WORKER_ID_SNIPPET" COMMIT "$(q "$COMMIT")" DIR "$(q "$REMOTE_DIR")" \
    FORCE "$FORCE" REPO_URL "$(q "$REPO_URL")" LIBTPU_URL "$(q "$LIBTPU_URL")" MINICONDA_URL "$(q "$MINICONDA_URL")"
}

# The run: free the TPU (stale mllm_rl.run processes, anything holding /dev/accel* or
# /dev/vfio/*), assert JAX sees a TPU, then start the run detached with a log per worker.
# `pkill -f mllm_rl.run` would also match this very shell (its command line contains the
# text), so stale runs are found with pgrep and only python processes are killed.
#
# A multi-host slice (more than one worker) runs one process per worker, all of them at once
# (ssh --worker=all). With --jax-dist env (the default) each process gets the environment
# backends/jax/distributed.py reads, from the same metadata jax's own Cloud TPU detection uses:
# MLLM_RL_COORDINATOR = worker 0's address (first entry of worker-network-endpoints) on
# COORDINATOR_PORT (8482, jax's), MLLM_RL_NUM_PROCESSES = the slice's workers,
# MLLM_RL_PROCESS_ID = this worker's agent-worker-number. They are exported after
# ~/.mllm_rl.env is sourced, so that file cannot override them.
run_template() {
  cat <<'EOF'
set -euo pipefail;
@WORKER_ID@
D="$HOME"/@DIR@; R=@RUN_ID@; N=@NPROC@; DIST="";
if [ "$N" -gt 1 ] && [ @JAX_DIST@ = env ]; then
  MD=http://metadata.google.internal/computeMetadata/v1/instance/attributes;
  EP=$(curl -fsS -m 5 -H "Metadata-Flavor: Google" "$MD/worker-network-endpoints" 2>/dev/null || true);
  WN=$(curl -fsS -m 5 -H "Metadata-Flavor: Google" "$MD/agent-worker-number" 2>/dev/null || true);
  if [ -z "$EP" ] || [ -z "$WN" ]; then echo "mllm_rl_run_error worker=$W cannot read worker-network-endpoints and agent-worker-number from the metadata server (a multi-host run needs them; --jax-dist auto leaves it to jax)"; exit 3; fi;
  NE=$(printf '%s\n' "$EP" | tr ',' '\n' | grep -c . || true);
  if [ "$NE" != "$N" ]; then echo "mllm_rl_run_error worker=$W the metadata server lists $NE workers, tpu.sh expected $N"; exit 3; fi;
  C0=${EP%%,*}; C0=${C0##*:};
  DIST="MLLM_RL_COORDINATOR=$C0:@COORD_PORT@ MLLM_RL_NUM_PROCESSES=$N MLLM_RL_PROCESS_ID=$WN";
fi;
cd "$D" 2>/dev/null || { echo "mllm_rl_run_error worker=$W no checkout at $D: run 'tpu.sh setup' first"; exit 3; };
PY="$D/.venv-jax/bin/python";
[ -x "$PY" ] || { echo "mllm_rl_run_error worker=$W no venv at $PY: run 'tpu.sh setup' first"; exit 3; };
for p in $(pgrep -f 'mllm_rl[.]run' || true); do case "$(ps -o comm= -p "$p" 2>/dev/null || true)" in python*) echo "[run] worker $W: killing stale mllm_rl.run (pid $p)" >&2; kill -9 "$p" 2>/dev/null || true;; esac; done;
H=$(sudo lsof -t /dev/accel* /dev/vfio/* 2>/dev/null | sort -u | tr '\n' ' ' || true);
if [ -n "${H// /}" ]; then echo "[run] worker $W: killing processes holding the TPU: $H" >&2; echo "$H" | xargs -r sudo kill -9 || true; sleep 2; fi;
sudo rm -f /tmp/libtpu_lockfile || true;
if ! OUT=$(timeout 600 "$PY" -c 'import jax; d = jax.devices(); assert d[0].platform == "tpu", d; print(len(d), d[0].device_kind)' 2>&1); then echo "mllm_rl_run_error worker=$W JAX does not see a TPU (platform check failed): $(printf '%s' "$OUT" | tail -n 1)"; exit 3; fi;
echo "[run] worker $W: JAX sees TPU: $(printf '%s' "$OUT" | tail -n 1)" >&2;
if [ -f "$HOME/.mllm_rl.env" ]; then set -a; . "$HOME/.mllm_rl.env"; set +a; fi;
export WANDB_MODE=@WANDB_MODE@; export PYTHONUNBUFFERED=1;
if [ -n "$DIST" ]; then export $DIST; echo "[run] worker $W: jax.distributed: $DIST" >&2; fi;
mkdir -p "runs/$R"; LOG="runs/tpu-"@NAME@"-w$W.log";
export MLLM_RL_EXIT_FILE="runs/$R/.tpu-exit-w$W"; rm -f "$MLLM_RL_EXIT_FILE";
echo "=== $(date -u +%Y-%m-%dT%H:%M:%SZ) worker $W run $R commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')${DIST:+ $DIST}" >> "$LOG";
nohup bash -c '"$@"; echo $? > "$MLLM_RL_EXIT_FILE"' mllm_rl_launch "$PY" -m mllm_rl.run --backend jax --run-id "$R" --run-dir "runs/$R" @ARGS@ >> "$LOG" 2>&1 < /dev/null &
echo $! > "runs/$R/.tpu-pid-w$W";
echo "mllm_rl_run_ok worker=$W pid=$! log=$D/$LOG";
EOF
}

# wandb_mode ARG...: the WANDB_MODE the run gets: the value of --wandb among the run's
# arguments if any, else ${WANDB_MODE:-offline} on the worker (after ~/.mllm_rl.env).
wandb_mode() {
  local prev="" a mode=""
  for a in "$@"; do
    if [[ $prev == --wandb ]]; then mode=$a; fi
    if [[ $a == --wandb=* ]]; then mode=${a#*=}; fi
    prev=$a
  done
  if [[ -n $mode ]]; then q "$mode"; else printf '%s' '"${WANDB_MODE:-offline}"'; fi
}

# run_script ARG...: the run script with ARG... passed to python -m mllm_rl.run.
# (WORKERS must be known: ensure_workers.)
run_script() {
  render "$(run_template)" WORKER_ID "$WORKER_ID_SNIPPET" DIR "$(q "$REMOTE_DIR")" RUN_ID "$(q "$RUN_ID")" \
    NAME "$(q "$NAME")" WANDB_MODE "$(wandb_mode "$@")" ARGS "$(qargs "$@")" NPROC "$WORKERS" \
    JAX_DIST "$JAX_DIST" COORD_PORT "$COORDINATOR_PORT"
}

status_template() {
  cat <<'EOF'
@WORKER_ID@
D="$HOME"/@DIR@; R=@RUN_ID@;
P="$D/runs/$R/.tpu-pid-w$W"; E="$D/runs/$R/.tpu-exit-w$W"; L="$D/runs/tpu-"@NAME@"-w$W.log";
if [ -f "$E" ]; then echo "mllm_rl_status worker=$W state=exited code=$(cat "$E")"; if [ "$(cat "$E")" != 0 ] && [ -f "$L" ]; then echo "mllm_rl_status_tail worker=$W $(grep -v '^[[:space:]]*$' "$L" | tail -n 1 | head -c 300)"; fi;
elif [ -f "$P" ] && kill -0 "$(cat "$P")" 2>/dev/null; then echo "mllm_rl_status worker=$W state=running";
else echo "mllm_rl_status worker=$W state=missing"; fi
EOF
}

status_script() {
  render "$(status_template)" WORKER_ID "$WORKER_ID_SNIPPET" DIR "$(q "$REMOTE_DIR")" RUN_ID "$(q "$RUN_ID")" NAME "$(q "$NAME")"
}

# ---------------------------------------------------------------- steps
# run_capture SCRIPT [--silent]: ssh_all SCRIPT; its output is streamed to stderr (unless
# --silent) and kept in CAPTURED. The markers are matched anywhere in a line, in case gcloud
# prefixes the output of each worker.
CAPTURED=""
run_capture() {
  local out rc=0
  out=$(mktemp "${TMPDIR:-/tmp}/tpu-ssh.XXXXXX")
  if [[ ${2:-} == --silent ]]; then
    ssh_all "$1" >"$out" 2>&1 || rc=$?
  else
    ssh_all "$1" 2>&1 | tee "$out" >&2 || rc=$?
  fi
  CAPTURED=$(cat "$out")
  rm -f "$out"
  return "$rc"
}

# count_lines PATTERN: lines of CAPTURED matching the extended regex PATTERN.
count_lines() { printf '%s\n' "$CAPTURED" | grep -cE "$1" || true; }

# first_line PATTERN: the first line of CAPTURED matching PATTERN, from the match on, after ': '.
first_line() { printf '%s\n' "$CAPTURED" | grep -oE "$1.*" | head -n 1 | sed 's/^/: /' || true; }

setup_vm() {
  resolve_repo
  log "setup: commit $COMMIT from $REPO_URL into ~/$REMOTE_DIR on every worker of $NAME"
  local rc=0 ok
  run_capture "$(setup_script)" || rc=$?
  ((DRY_RUN)) && return 0
  ensure_workers
  ok=$(count_lines 'mllm_rl_setup_ok ')
  if ((rc != 0 || ok < WORKERS)); then
    die "setup failed on $NAME: $((WORKERS - ok)) of $WORKERS worker(s) did not finish (gcloud exit $rc)$(first_line 'mllm_rl_setup_error')"
  fi
  log "setup done on $ok worker(s) ($(count_lines 'mllm_rl_setup_ok .*cached=1') already set up for this commit)"
}

env_vm() {
  [[ -f $ENV_FILE ]] || die2 "env file $ENV_FILE not found (pass --env-file F)"
  grep -Eq '^[[:space:]]*(export[[:space:]]+)?WANDB_API_KEY=' "$ENV_FILE" ||
    warn "$ENV_FILE has no WANDB_API_KEY=...; W&B online runs will not authenticate"
  local pre post tmpd="" src rc=0
  pre='umask 077; touch "$HOME/.mllm_rl.env"; chmod 600 "$HOME/.mllm_rl.env"'
  post='chmod 600 "$HOME/.mllm_rl.env"'
  ssh_all "$pre" >/dev/null || die "env: could not prepare ~/.mllm_rl.env on $NAME"
  if ((DRY_RUN)); then
    src=$ENV_FILE
  else
    # A mode-600 copy is what travels: the secret is never readable by others on either side.
    tmpd=$(mktemp -d "${TMPDIR:-/tmp}/tpu-env.XXXXXX")
    src=$tmpd/mllm_rl.env
    (umask 077 && cat "$ENV_FILE" >"$src")
  fi
  scp_tpu all "$src" "$NAME:.mllm_rl.env" >/dev/null || rc=$?
  [[ -n $tmpd ]] && rm -rf "$tmpd"
  ((rc == 0)) || die "env: scp of $ENV_FILE to $NAME failed (gcloud exit $rc)"
  ssh_all "$post" >/dev/null || die "env: chmod of ~/.mllm_rl.env on $NAME failed"
  log "env: $ENV_FILE copied to ~/.mllm_rl.env (mode 600) on every worker of $NAME"
}

# env_if_present: the env step when an env file exists; a missing default .env is skipped
# (offline W&B needs no key), a missing --env-file is an error.
env_if_present() {
  if [[ -f $ENV_FILE ]]; then
    env_vm
  elif ((ENV_FILE_SET)); then
    die2 "env file $ENV_FILE not found"
  else
    log "no $ENV_FILE: skipping the env step (W&B stays offline unless the run says otherwise)"
  fi
}

# State files under $LOCAL_RUNS/.tpu/: the last run id and run arguments per TPU name, so
# `watch` and `fetch` find them without repeating them.
state_dir() { printf '%s' "$LOCAL_RUNS/.tpu"; }

save_run_state() {
  ((DRY_RUN)) && return 0
  local d
  d=$(state_dir)
  mkdir -p "$d"
  printf '%s\n' "$RUN_ID" >"$d/$NAME.run_id"
  if ((${#PASSTHRU[@]})); then printf '%s\0' "${PASSTHRU[@]}" >"$d/$NAME.args"; else : >"$d/$NAME.args"; fi
}

load_run_state() {
  local d a
  d=$(state_dir)
  if [[ -z $RUN_ID && -f $d/$NAME.run_id ]]; then
    RUN_ID=$(cat "$d/$NAME.run_id")
    log "run id $RUN_ID (from $d/$NAME.run_id)"
  fi
  if ((!PASSTHRU_SET)) && [[ -f $d/$NAME.args ]]; then
    PASSTHRU=()
    while IFS= read -r -d '' a; do PASSTHRU+=("$a"); done <"$d/$NAME.args"
    PASSTHRU_SET=1
  fi
}

# run_vm [--resume]: start the run on every worker (with --resume-or-start appended if asked,
# in place of a --resume of the arguments: a recreated VM's new disk may hold nothing to resume).
run_vm() {
  local -a args=(${PASSTHRU[@]+"${PASSTHRU[@]}"}) kept=()
  local a rc=0 ok
  if [[ ${1:-} == --resume ]]; then
    for a in ${args[@]+"${args[@]}"}; do [[ $a == --resume || $a == --resume-or-start ]] || kept+=("$a"); done
    args=(${kept[@]+"${kept[@]}"} --resume-or-start)
  fi
  [[ -n $RUN_ID ]] || RUN_ID="$NAME-$(date -u +%y%m%d-%H%M%S)"
  save_run_state
  ensure_workers
  log "run $RUN_ID on every worker of $NAME ($WORKERS process(es)$( ((WORKERS > 1)) && echo ", jax.distributed from $([[ $JAX_DIST == env ]] && echo "MLLM_RL_* set per worker" || echo "jax's own detection")")): python -m mllm_rl.run --backend jax --run-id $RUN_ID --run-dir runs/$RUN_ID $(qargs ${args[@]+"${args[@]}"})"
  run_capture "$(run_script ${args[@]+"${args[@]}"})" || rc=$?
  ((DRY_RUN)) && return 0
  ok=$(count_lines 'mllm_rl_run_ok ')
  if ((rc != 0 || ok < WORKERS)); then
    die "run did not start on $((WORKERS - ok)) of $WORKERS worker(s) of $NAME$(first_line 'mllm_rl_run_error')"
  fi
  log "run $RUN_ID started on $ok worker(s); logs: ~/$REMOTE_DIR/runs/tpu-$NAME-w<i>.log"
}

# run_status: sets RUN_STATE: RUNNING | DONE (every worker exited 0) | FAILED (a worker
# exited non-zero or has no run) | UNKNOWN (no complete answer, e.g. an SSH hiccup);
# STATUS_DETAIL lists the workers.
RUN_STATE=""
STATUS_DETAIL=""
STATUS_TAIL=""                            # the last log line of the first failed worker
run_status() {
  if ((DRY_RUN)); then
    ssh_all "$(status_script)"
    RUN_STATE=DONE
    return 0
  fi
  run_capture "$(status_script)" --silent || true
  ensure_workers
  local running exited ok missing
  running=$(count_lines 'mllm_rl_status .*state=running')
  exited=$(count_lines 'mllm_rl_status .*state=exited')
  ok=$(count_lines 'mllm_rl_status .*state=exited code=0$')
  missing=$(count_lines 'mllm_rl_status .*state=missing')
  STATUS_DETAIL=$(printf '%s\n' "$CAPTURED" | grep -oE 'mllm_rl_status .*' | sed 's/^mllm_rl_status //' | tr '\n' ' ' || true)
  STATUS_TAIL=$(printf '%s\n' "$CAPTURED" | grep -oE 'mllm_rl_status_tail .*' | head -n 1 | sed 's/^mllm_rl_status_tail //' || true)
  if ((running > 0)); then
    RUN_STATE=RUNNING
  elif ((exited + missing < WORKERS)); then
    RUN_STATE=UNKNOWN
  elif ((ok == WORKERS)); then
    RUN_STATE=DONE
  else
    RUN_STATE=FAILED
  fi
}

fetch_vm() {
  [[ -n $RUN_ID ]] || die2 "no run id: pass --run-id ID (or start the run with tpu.sh run from this machine)"
  ensure_workers
  local i dest stage rc=0
  dest=$LOCAL_RUNS/$RUN_ID
  ((DRY_RUN)) || mkdir -p "$dest"
  for ((i = 0; i < WORKERS; i++)); do
    stage=$dest/.worker$i.partial
    ((DRY_RUN)) || rm -rf "$stage"
    if ! scp_tpu "$i" --recurse "$NAME:$REMOTE_DIR/runs/$RUN_ID" "$stage"; then
      warn "fetch: runs/$RUN_ID from worker $i of $NAME failed"
      rc=1
      continue
    fi
    if ((!DRY_RUN)); then
      rm -rf "$dest/worker$i"
      mv "$stage" "$dest/worker$i"
    fi
    scp_tpu "$i" "$NAME:$REMOTE_DIR/runs/tpu-$NAME-w$i.log" "$dest/worker$i/" || warn "fetch: no log from worker $i"
  done
  ((rc == 0)) && log "fetched runs/$RUN_ID from $WORKERS worker(s) into $dest/worker<i>/"
  return "$rc"
}

# ---------------------------------------------------------------- watch
err() { printf 'tpu.sh: error: %s\n' "$1" >&2; }

# recover_vm: the node is gone (PREEMPTED / TERMINATED / deleted): delete it, create it again
# (same zone list, same fallback), wait, setup, env, and run again with --resume-or-start.
recover_vm() {
  if ((QUEUED)); then
    # A preempted queued VM leaves its request SUSPENDED, holding the name (ALREADY_EXISTS on
    # a new request): delete the request and what is left of the node, then queue again.
    delete_qr
  else
    [[ $STATE == NOT_FOUND ]] || delete_vm || true
  fi
  ZONE=""
  create_vm
  wait_vm
  setup_vm
  env_if_present
  run_vm --resume
}

# watch_vm: poll the node and the run until the run ends. Returns 0 when every worker
# exited 0, 1 when the run failed, the run timed out, or recoveries ran out.
watch_vm() {
  [[ -n $RUN_ID ]] || die2 "no run id: pass --run-id ID (or start the run with tpu.sh run from this machine)"
  local recoveries=0 start last=""
  start=$(now)
  log "watching $NAME (run $RUN_ID, poll ${POLL}s, at most $MAX_RECOVERIES recoveries)"
  while :; do
    vm_state
    case $STATE in
      READY)
        run_status
        case $RUN_STATE in
          DONE)
            log "run $RUN_ID finished on every worker (${STATUS_DETAIL:-ok})"
            return 0
            ;;
          FAILED)
            err "run $RUN_ID failed on $NAME: $STATUS_DETAIL${STATUS_TAIL:+(last log line of $STATUS_TAIL) }(logs: ~/$REMOTE_DIR/runs/tpu-$NAME-w<i>.log; tpu.sh fetch brings them back)"
            return 1
            ;;
        esac
        [[ $RUN_STATE != "$last" ]] && log "run $RUN_ID: $RUN_STATE ${STATUS_DETAIL}"
        last=$RUN_STATE
        ;;
      PREEMPTED | TERMINATED | NOT_FOUND)
        if ((recoveries >= MAX_RECOVERIES)); then
          err "TPU $NAME is $STATE; giving up after $recoveries recoveries (--max-recoveries $MAX_RECOVERIES)"
          return 1
        fi
        recoveries=$((recoveries + 1))
        log "TPU $NAME is $STATE: recovery $recoveries of $MAX_RECOVERIES (delete, create, wait, setup, env, run --resume-or-start)"
        recover_vm
        last=""
        ;;
      STOPPED | STOPPING)
        err "TPU $NAME is $STATE (stopped by someone); not recovering"
        return 1
        ;;
      *)
        [[ $STATE != "$last" ]] && log "TPU $NAME: $STATE${LAST_ERROR:+ ($LAST_ERROR)}"
        last=$STATE
        ;;
    esac
    if ((RUN_TIMEOUT > 0 && $(now) - start >= RUN_TIMEOUT)); then
      err "run $RUN_ID still not finished after --run-timeout ${RUN_TIMEOUT}s"
      return 1
    fi
    ((DRY_RUN)) && return 0
    sleep "$POLL"
  done
}
