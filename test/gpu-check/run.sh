#!/usr/bin/env bash
# test/gpu-check/run.sh: berth's check on a real single-GPU Linux host with the NVIDIA driver and
# PyTorch, no network and possibly no Go. It runs binaries built beforehand (see README.md):
#   1. inventory, topology (berth's and `nvidia-smi topo -m`) and fingerprint;
#   2. host<->device copy bandwidth (PyTorch, pinned memory);
#   3. a PyTorch process holding --gib GiB of known content: lock, checkpoint, restore, unlock
#      through berth's CUDA driver (gpu/cuda), content verified after, GB/s of each step;
#   4. with --criu: lock + checkpoint, criu dump, criu restore, restore + unlock, verified again.
# Everything is bounded by timeouts; the whole run takes about 8 minutes at most.
set -euo pipefail

usage() {
	cat <<'USAGE'
usage: run.sh --bundle DIR [--gib N] [--criu PATH] [--criu-plugins] [--python PATH]
              [--out DIR] [--lock-timeout SEC] [--dry-run]
  --bundle DIR     directory with gpucheck (and optionally berthctl, berth-shim-helper) built per README.md
                   (default: this script's directory when gpucheck is beside it)
  --gib N          device memory the workload holds, GiB (default 4)
  --criu PATH      also dump and restore the workload with this CRIU binary (needs root)
  --criu-plugins   let CRIU load its plugins (default: --libdir to an empty dir, so CRIU's own
                   CUDA plugin does not act; berth's driver does the GPU steps)
  --python PATH    python with PyTorch (default python3)
  --out DIR        keep logs, JSON and CRIU images here (default a new temp dir)
  --lock-timeout S seconds cuCheckpointProcessLock may wait (default 10)
  --dry-run        print the plan, run nothing
USAGE
}

BUNDLE="" GIB=4 CRIU="" CRIU_PLUGINS=0 PY=python3 OUT="" LOCK_TIMEOUT=10 DRY=0
while [[ $# -gt 0 ]]; do
	case "$1" in
	--bundle) BUNDLE=$2; shift 2 ;;
	--gib) GIB=$2; shift 2 ;;
	--criu) CRIU=$2; shift 2 ;;
	--criu-plugins) CRIU_PLUGINS=1; shift ;;
	--python) PY=$2; shift 2 ;;
	--out) OUT=$2; shift 2 ;;
	--lock-timeout) LOCK_TIMEOUT=$2; shift 2 ;;
	--dry-run) DRY=1; shift ;;
	-h | --help) usage; exit 0 ;;
	*) echo "run.sh: unknown argument $1" >&2; usage >&2; exit 2 ;;
	esac
done
if [[ -z $BUNDLE && -x $(dirname "${BASH_SOURCE[0]}")/gpucheck ]]; then BUNDLE=$(dirname "${BASH_SOURCE[0]}"); fi
[[ -n $BUNDLE ]] || { echo "run.sh: --bundle is required" >&2; usage >&2; exit 2; }
[[ $GIB =~ ^[1-9][0-9]*$ ]] || { echo "run.sh: --gib must be a positive integer" >&2; exit 2; }
[[ $LOCK_TIMEOUT =~ ^[1-9][0-9]*$ ]] || { echo "run.sh: --lock-timeout must be a positive integer" >&2; exit 2; }

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
exec 3>&1 # the plan of a dry run goes here even where stdout is redirected
WORKLOAD=$HERE/workload.py
GPUCHECK=$BUNDLE/gpucheck
BERTHCTL=$BUNDLE/berthctl
SHIMHELPER=$BUNDLE/berth-shim-helper
BYTES=$((GIB << 30))
START=$SECONDS
DEADLINE=$((START + 480)) # 8 minutes
WPID=""
FAIL=0

if [[ -z $OUT ]]; then
	if [[ $DRY == 1 ]]; then OUT=/tmp/berth-gpu-check.DRYRUN; else OUT=$(mktemp -d /tmp/berth-gpu-check.XXXXXX); fi
fi

# outf NAME: where to keep an output file ($OUT/NAME; /dev/null in a dry run).
outf() { if [[ $DRY == 1 ]]; then echo /dev/null; else echo "$OUT/$1"; fi; }
# elapsed T0 T1: seconds between two $EPOCHREALTIME values.
elapsed() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.3f", b - a }'; }

say() { printf '\n== %s (t=%ds)\n' "$*" $((SECONDS - START)); }
note() { printf '   %s\n' "$*"; }

# run SECONDS CMD...: run CMD with a timeout (or print it in a dry run).
run() {
	local t=$1; shift
	if [[ $DRY == 1 ]]; then
		printf '   + timeout %s %s\n' "$t" "$*" >&3
		return 0
	fi
	local left=$((DEADLINE - SECONDS))
	if ((left < 5)); then
		echo "run.sh: out of time before: $*" >&2
		return 124
	fi
	((t > left)) && t=$left
	timeout --kill-after=5 "$t" "$@"
}

# jget FILE EXPR: a value from a JSON file (python, since jq may be absent).
jget() {
	"$PY" -c 'import json,sys; d=json.load(open(sys.argv[1])); print(eval(sys.argv[2], {}, {"d": d}))' "$1" "$2"
}

# wait_file PATH SECONDS: wait until PATH exists.
wait_file() {
	local f=$1 t=$2
	if [[ $DRY == 1 ]]; then note "wait up to ${t}s for $f"; return 0; fi
	local end=$((SECONDS + t))
	while [[ ! -e $f ]]; do
		if ((SECONDS >= end)) || { [[ -n $WPID ]] && ! kill -0 "$WPID" 2>/dev/null && [[ ! -e $f ]]; }; then
			echo "run.sh: $f did not appear within ${t}s" >&2
			return 1
		fi
		sleep 0.2
	done
}

N_VERIFY=0
# verify LABEL: have the workload check its device memory against the known pattern.
verify() {
	N_VERIFY=$((N_VERIFY + 1))
	local f=$OUT/w/verify.$N_VERIFY
	if [[ $DRY == 1 ]]; then note "+ kill -USR1 \$WPID; expect 'ok' in $f ($1)"; return 0; fi
	kill -USR1 "$WPID"
	wait_file "$f" 120
	local res
	res=$(cat "$f")
	if [[ $res == ok* ]]; then
		note "verify ($1): content intact, ${res#ok } s"
	else
		note "verify ($1): CONTENT WRONG: $res"
		FAIL=1
		return 1
	fi
}

# steps NAME STEPS: run gpucheck steps on the workload; JSON in $OUT/NAME.json; prints a line per step.
steps() {
	local name=$1 list=$2 rc=0
	run 120 "$GPUCHECK" steps --pid "${WPID:-PID}" --steps "$list" --bytes "$BYTES" --timeout "${LOCK_TIMEOUT}s" >"$(outf "$name.json")" || rc=$?
	[[ $DRY == 1 ]] && return 0
	"$PY" - "$OUT/$name.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print("   load (dlopen + cuInit): %.3f s" % d["loadSeconds"])
for s in d["steps"]:
    print("   %-10s %8.3f s  %7.2f GB/s  -> %s%s" % (s["step"], s["seconds"], s.get("gbps", 0), s.get("state", "?"),
          ("  ERROR " + s["error"]) if s.get("error") else ""))
if d.get("error"):
    print("   error:", d["error"])
PY
	if ((rc != 0)); then
		FAIL=1
		return 1
	fi
}

cleanup() {
	if [[ -n $WPID ]] && kill -0 "$WPID" 2>/dev/null; then
		# A locked or checkpointed process cannot exit cleanly; try to bring it back first.
		"$GPUCHECK" steps --pid "$WPID" --steps restore >/dev/null 2>&1 || true
		"$GPUCHECK" steps --pid "$WPID" --steps unlock >/dev/null 2>&1 || true
		kill -TERM "$WPID" 2>/dev/null || true
		sleep 1
		kill -KILL "$WPID" 2>/dev/null || true
	fi
}
trap cleanup EXIT

say "berth gpu-check: bundle $BUNDLE, ${GIB} GiB, out $OUT$([[ $DRY == 1 ]] && echo ' (DRY RUN)')"
if [[ $DRY != 1 ]]; then
	[[ -x $GPUCHECK ]] || { echo "run.sh: $GPUCHECK missing or not executable (see README.md)" >&2; exit 2; }
	command -v nvidia-smi >/dev/null || { echo "run.sh: nvidia-smi not found: no NVIDIA driver?" >&2; exit 2; }
	[[ -z $CRIU || -x $CRIU ]] || { echo "run.sh: CRIU binary $CRIU not executable" >&2; exit 2; }
	[[ -z $CRIU || $EUID == 0 ]] || { echo "run.sh: --criu needs root" >&2; exit 2; }
	mkdir -p "$OUT/w"
	uname -a
fi

say "1. inventory, topology, fingerprint"
run 60 "$GPUCHECK" inventory | tee "$(outf inventory.json)" || FAIL=1
run 60 "$GPUCHECK" topology | tee "$(outf topology.txt)" || FAIL=1
note "nvidia-smi topo -m:"
run 60 nvidia-smi topo -m | tee "$(outf nvidia-smi-topo.txt)" || true
run 60 "$GPUCHECK" fingerprint | tee "$(outf fingerprint.json)" || FAIL=1
if [[ -x $BERTHCTL || $DRY == 1 ]]; then
	run 60 "$BERTHCTL" fingerprint ${CRIU:+--criu "$CRIU"} | tee "$(outf berthctl-fingerprint.json)" || note "berthctl fingerprint failed (see above)"
fi
if [[ -x $SHIMHELPER || $DRY == 1 ]]; then
	note "the shim's inventory (berth-shim-helper gpu-inventory) against NVML in gpucheck's process:"
	run 60 "$GPUCHECK" helper-inventory --helper "$SHIMHELPER" | tee "$(outf helper-inventory.json)" || FAIL=1
fi

say "2. host<->device copy bandwidth (PyTorch, pinned, $GIB GiB)"
run 120 "$PY" "$WORKLOAD" bw --gib "$GIB" | tee "$(outf bw.json)" || FAIL=1

say "3. lock / checkpoint / restore / unlock of a PyTorch process holding $GIB GiB"
if [[ $DRY == 1 ]]; then
	note "+ setsid $PY $WORKLOAD hold --gib $GIB --dir $OUT/w </dev/null >/dev/null 2>$OUT/w/workload.err &"
else
	setsid "$PY" "$WORKLOAD" hold --gib "$GIB" --dir "$OUT/w" </dev/null >/dev/null 2>"$OUT/w/workload.err" &
	WPID=$!
fi
wait_file "$OUT/w/ready" 180 || { cat "$OUT/w/workload.err" >&2; exit 1; }
[[ $DRY == 1 ]] || note "workload pid $WPID: $(cat "$OUT/w/ready")"
verify "before" || true
steps state state || true
if steps cycle lock,checkpoint,restore,unlock; then verify "after lock/checkpoint/restore/unlock" || true; fi

if [[ -n $CRIU ]]; then
	say "4. GPU checkpoint + CRIU dump, CRIU restore + GPU restore"
	IMG=$OUT/criu-images
	EMPTY=$OUT/criu-no-plugins
	CRIU_LIB=()
	[[ $CRIU_PLUGINS == 1 ]] || CRIU_LIB=(--libdir "$EMPTY")
	[[ $DRY == 1 ]] || mkdir -p "$IMG" "$EMPTY"
	if steps criu-gpu-checkpoint lock,checkpoint; then
		tn0=$EPOCHREALTIME
		if run 180 "$CRIU" dump -t "${WPID:-PID}" -D "$IMG" -o dump.log -v4 "${CRIU_LIB[@]}"; then
			tn1=$EPOCHREALTIME
			if [[ $DRY != 1 ]]; then
				sz=$(du -sb "$IMG" | cut -f1)
				note "criu dump: $(elapsed "$tn0" "$tn1") s, images $((sz >> 20)) MiB, $(awk -v s="$sz" -v t="$(elapsed "$tn0" "$tn1")" 'BEGIN { printf "%.2f", s / t / 1e9 }') GB/s"
			fi
			tn0=$EPOCHREALTIME
			if run 180 "$CRIU" restore -D "$IMG" -o restore.log -v4 --restore-detached --pidfile "$OUT/restored.pid" "${CRIU_LIB[@]}"; then
				tn1=$EPOCHREALTIME
				[[ $DRY == 1 ]] || note "criu restore: $(elapsed "$tn0" "$tn1") s, pid $(cat "$OUT/restored.pid")"
				if steps criu-gpu-restore restore,unlock; then verify "after CRIU dump/restore" || true; fi
			else
				note "criu restore failed: see $IMG/restore.log"; tail -20 "$IMG/restore.log" 2>/dev/null || true; FAIL=1
			fi
		else
			note "criu dump failed: see $IMG/dump.log"; tail -20 "$IMG/dump.log" 2>/dev/null || true; FAIL=1
			if steps criu-rollback restore,unlock; then verify "after failed dump, rolled back" || true; fi
		fi
	fi
fi

say "summary"
if [[ $DRY == 1 ]]; then
	note "dry run: nothing was run"
	exit 0
fi
"$PY" - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
def load(name):
    try:
        return json.load(open(os.path.join(out, name)))
    except Exception:
        return None
bw = load("bw.json") or {}
print("   host->device %s GB/s, device->host %s GB/s (PyTorch copy, pinned)" % (bw.get("h2d_gbps", "?"), bw.get("d2h_gbps", "?")))
for name in ("cycle", "criu-gpu-checkpoint", "criu-gpu-restore"):
    d = load(name + ".json")
    if not d:
        continue
    for s in d["steps"]:
        print("   %-22s %-10s %8.3f s %8.2f GB/s" % (name, s["step"], s["seconds"], s.get("gbps", 0)))
PY
note "logs and JSON in $OUT; total $((SECONDS - START)) s"
if ((FAIL)); then
	echo "RESULT: FAIL"
	exit 1
fi
echo "RESULT: PASS"
