# FAKE programs on a fake TPU worker (tests/tpu only): one bash script, linked under many names.
# (conftest.py writes it out with a shebang of this machine's bash.)
#
# fake_gcloud.py runs each ssh command with a PATH of links to this file (sudo, git, curl,
# python3.12, pgrep, pkill, lsof, ps) plus a few real coreutils. Nothing here touches the test
# machine beyond the worker's sandbox $HOME: sudo never runs its command, pgrep/lsof find
# nothing, the fake JAX reports $FAKE_PLATFORM, the fake metadata server (curl) answers the
# worker number and the slice's workers. Every call is logged (program, argv, worker, VM
# generation) to $FAKE_REMOTE_LOG as one JSON line; of the environment only WANDB_MODE, whether a
# WANDB_API_KEY is set (never its value) and the MLLM_RL_* process variables of the run.
set -u
prog=${0##*/}

J=""
jstr() { # J = $1 as a JSON string
  local s=$1
  s=${s//\\/\\\\}
  s=${s//\"/\\\"}
  s=${s//$'\n'/\\n}
  s=${s//$'\t'/\\t}
  s=${s//$'\r'/\\r}
  J="\"$s\""
}

log() { # log EXTRA_JSON_FIELDS ARG...
  local extra=$1 a args=""
  shift
  for a in "$@"; do
    jstr "$a"
    args+="${args:+, }$J"
  done
  jstr "$prog"
  local p=$J
  jstr "$PWD"
  printf '{"worker": %s, "gen": %s, "prog": %s, "argv": [%s], "cwd": %s%s}\n' \
    "${FAKE_WORKER:-0}" "${FAKE_GEN:-0}" "$p" "$args" "$J" "$extra" >>"$FAKE_REMOTE_LOG"
}

link_stub() { mkdir -p "$(dirname "$1")"; [ -e "$1" ] || ln -s "$FAKE_STUB" "$1"; }

stub_sudo() {
  local -a args=()
  local a
  for a in "$@"; do [ "$a" = -E ] || args+=("$a"); done
  case ${args[0]:-} in
    lsof) return 1 ;; # nothing holds the TPU
    apt-get)
      case " ${args[*]} " in *" install "*python3.12*) link_stub "$FAKE_APT_BIN/python3.12" ;; esac
      return 0
      ;;
  esac
  return 0 # kill, rm, add-apt-repository, apt-get update: nothing to do
}

stub_curl() {
  case "$*" in
    *agent-worker-number*) echo "${FAKE_WORKER:-0}"; return 0 ;;
    *worker-network-endpoints*) # the old name:id:ip form; worker i is 10.0.0.<i+2>, as describe says
      local i out=""
      for ((i = 0; i < ${FAKE_WORKERS:-1}; i++)); do out+="${out:+,}t1v-n-fake-w-$i:uid$i:10.0.0.$((i + 2))"; done
      printf '%s' "$out"
      return 0
      ;;
  esac
  echo "curl: (6) Could not resolve host (fake worker: no internet)" >&2
  return 6
}

stub_git() {
  local repo=$PWD
  if [ "${1:-}" = -C ]; then repo=$2; shift 2; fi
  local -a args=()
  local a
  for a in "$@"; do [ "$a" = -q ] || args+=("$a"); done
  local url_file=$repo/.git/fake_url unpushed=0
  # A URL with "missing-commit" in it plays a repo without the wanted commit.
  if [ -f "$url_file" ] && grep -q missing-commit "$url_file"; then unpushed=1; fi
  case ${args[0]:-} in
    clone)
      mkdir -p "${args[2]}/.git"
      printf '%s' "${args[1]}" >"${args[2]}/.git/fake_url"
      ;;
    remote)
      [ -d "$repo/.git" ] || return 128
      [ "${args[1]:-}" = set-url ] && printf '%s' "${args[${#args[@]}-1]}" >"$url_file"
      ;;
    fetch)
      [ -d "$repo/.git" ] || return 128
      local last=${args[${#args[@]}-1]}
      if ((${#last} == 40 && unpushed)); then return 128; fi
      ;;
    cat-file) [ -d "$repo/.git" ] && ((!unpushed)) || return 128 ;;
    checkout) printf '%s' "${args[${#args[@]}-1]}" >"$repo/.git/fake_head" ;;
    rev-parse) if [ -f "$repo/.git/fake_head" ]; then head -c 7 "$repo/.git/fake_head"; echo; else echo 0000000; fi ;;
    *) echo "fake git: unhandled $*" >&2; return 1 ;;
  esac
  return 0
}

stub_python() {
  case "${1:-} ${2:-}" in
    "-V "*) echo "Python 3.12.0 (fake)" ;;
    "-m venv") link_stub "$3/bin/python" ;;
    "-m pip") ;;
    "-c "*)
      case $2 in
        *platform*)
          if [ "${FAKE_PLATFORM:-}" = tpu ]; then echo "4 TPU v4 (fake)"; else
            printf 'Traceback (most recent call last):\nAssertionError: [CpuDevice(id=0)]\n' >&2
            return 1
          fi
          ;;
      esac
      ;;
    "-m mllm_rl.run")
      local run_dir=runs/x prev="" a
      for a in "$@"; do [ "$prev" = --run-dir ] && run_dir=$a; prev=$a; done
      mkdir -p "$run_dir/wandb/offline-run-fake"
      echo "{\"phase\": \"generate_result\", \"worker\": ${FAKE_WORKER:-0}}" >>"$run_dir/phases.jsonl"
      echo 'phase {"phase": "generate_result"} (fake)'
      if [ "${FAKE_RUN_EXIT:-0}" != 0 ]; then echo "error: the fake run failed on worker ${FAKE_WORKER:-0} (exit ${FAKE_RUN_EXIT})"; fi
      return "${FAKE_RUN_EXIT:-0}"
      ;;
    *) echo "fake python: unhandled $*" >&2; return 1 ;;
  esac
  return 0
}

extra=""
case $prog in
  python*)
    if [ "${1:-} ${2:-}" = "-m mllm_rl.run" ]; then
      has=false
      [ -n "${WANDB_API_KEY+x}" ] && has=true
      jstr "${WANDB_MODE:-}"
      extra=", \"wandb_mode\": $J, \"has_wandb_key\": $has"
      # how this process would find the others (backends/jax/distributed.py reads these)
      for v in MLLM_RL_COORDINATOR MLLM_RL_NUM_PROCESSES MLLM_RL_PROCESS_ID; do
        if [ -n "${!v+x}" ]; then jstr "${!v}"; extra+=", \"$v\": $J"; fi
      done
    fi
    ;;
esac
log "$extra" "$@"

case $prog in
  sudo) stub_sudo "$@" ;;
  pgrep | pkill | lsof | ps) exit 1 ;; # no stale process on a fake worker
  curl) stub_curl "$@" ;;
  git) stub_git "$@" ;;
  python*) stub_python "$@" ;;
  *) echo "fake worker: no stub for $prog" >&2; exit 127 ;;
esac
