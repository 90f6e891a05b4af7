#!/usr/bin/env bash
# Usage: scripts/redis-env.sh CMD [ARGS...]
#
# Starts a throwaway standalone Redis and a 3-master Redis Cluster on free
# loopback ports, runs CMD with these set:
#   SLUICE_TEST_REDIS_ADDR     127.0.0.1:PORT (standalone)
#   SLUICE_TEST_REDIS_CLUSTER  127.0.0.1:A,127.0.0.1:B,127.0.0.1:C
#   SLUICE_TEST_REDIS_SERVER   path of redis-server (for tests that run their own)
# and exits with CMD's status. Servers and their temp dir are removed on exit,
# including on failure, Ctrl-C or SIGTERM.
set -euo pipefail

if (($# == 0)); then
	echo "usage: $0 CMD [ARGS...]" >&2
	exit 2
fi

log() { echo "redis-env: $*" >&2; }

# --- Make sure redis-server and redis-cli exist. ---------------------------
if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null; then
	if [[ $EUID -eq 0 ]]; then
		sudo=()
	elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
		sudo=(sudo)
	else
		# Cannot install unattended: tell the developer the one thing to run.
		echo "sudo apt-get install -y redis-server redis-tools"
		exit 1
	fi
	log "installing redis-server and redis-tools with apt-get"
	"${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq
	"${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server redis-tools
fi
redis_server=$(command -v redis-server)

# --- Cleanup, installed before anything is started. ------------------------
tmp=$(mktemp -d "${TMPDIR:-/tmp}/sluice-redis.XXXXXX")
servers=() # pids of the redis-servers we started
declare -A pid_of # port -> pid of its redis-server
child=""   # pid of CMD while it runs

# alive PID...: true if any of the processes still exists.
alive() {
	local p
	for p; do kill -0 "$p" 2>/dev/null && return 0; done
	return 1
}

# stop PID...: SIGTERM, give them 5 s, then SIGKILL, then reap.
# The KILL fallback matters for CMDs that ignore TERM, e.g. an interactive bash.
stop() {
	(($#)) || return 0
	kill -TERM "$@" 2>/dev/null || true
	for _ in {1..50}; do
		alive "$@" || break
		sleep 0.1
	done
	kill -KILL "$@" 2>/dev/null || true
	wait "$@" 2>/dev/null || true
}

# tree PID: PID and all its descendants. Signalling only `go` would orphan the
# test binaries it spawned, which would keep running against dead servers.
tree() {
	local p
	echo "$1"
	command -v pgrep >/dev/null || return 0
	for p in $(pgrep -P "$1" || true); do tree "$p"; done
}

cleanup() {
	local rc=$?
	trap - EXIT INT TERM
	if [[ -n $child ]]; then
		# shellcheck disable=SC2046 # word splitting of the pid list is intended
		stop $(tree "$child")
	fi
	stop "${servers[@]}"
	rm -rf "$tmp"
	exit "$rc"
}
trap cleanup EXIT
# Turn signals into an exit so the EXIT trap does the cleanup exactly once.
trap 'exit 130' INT
trap 'exit 143' TERM

# --- Free ports. ------------------------------------------------------------
# pick_ports N: sets ports=(N free ports). Pure bash because python3 and
# similar helpers may be missing on a fresh machine. A port counts as free if
# nothing accepts a connection on it or on PORT+10000, Redis Cluster's bus port.
# Both stay below the kernel's ephemeral range (32768 and up by default), so
# that no outgoing connection of the tests can take them in the meantime.
port_busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
pick_ports() {
	ports=()
	local p taken=" " low=32768
	read -r low _ </proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || true
	local span=$((low - 10000 - 11000))
	((span > 1000)) || span=1000
	while ((${#ports[@]} < $1)); do
		p=$((11000 + RANDOM % span))
		# Also keeps one node's port off another's bus port.
		[[ $taken == *" $p "* ]] && continue
		if ! port_busy "$p" && ! port_busy $((p + 10000)); then
			ports+=("$p")
			taken+="$p $((p + 10000)) $((p - 10000)) "
		fi
	done
}

# --- Servers. ---------------------------------------------------------------
# start PORT [EXTRA ARGS...]: runs redis-server in the background (not
# daemonized, so we own the pid), without persistence, in its own directory.
start() {
	local port=$1 dir=$tmp/$1
	shift
	mkdir -p "$dir"
	"$redis_server" --port "$port" --bind 127.0.0.1 --daemonize no \
		--save '' --appendonly no --dir "$dir" --logfile "$dir/redis.log" "$@" &
	servers+=($!)
	pid_of[$port]=$!
}

# wait_ping PORT: wait up to 10 s for PONG, giving up at once if the server
# died (bad option, port taken); on failure show the server log.
wait_ping() {
	local deadline=$((SECONDS + 10))
	until [[ $(redis-cli -p "$1" ping 2>/dev/null) == PONG ]]; do
		if ! kill -0 "${pid_of[$1]}" 2>/dev/null || ((SECONDS >= deadline)); then
			log "redis-server on port $1 did not come up; tail of $tmp/$1/redis.log:"
			tail -n 20 "$tmp/$1/redis.log" >&2 2>/dev/null || true
			exit 1
		fi
		sleep 0.1
	done
}

pick_ports 4
standalone=${ports[0]}
cluster=("${ports[@]:1}")

start "$standalone"
for p in "${cluster[@]}"; do
	start "$p" --cluster-enabled yes --cluster-config-file "nodes-$p.conf" \
		--cluster-node-timeout 2000
done
for p in "$standalone" "${cluster[@]}"; do wait_ping "$p"; done

if ! redis-cli --cluster create "${cluster[@]/#/127.0.0.1:}" \
	--cluster-replicas 0 --cluster-yes >"$tmp/cluster-create.log" 2>&1; then
	log "redis-cli --cluster create failed:"
	tail -n 20 "$tmp/cluster-create.log" >&2
	exit 1
fi

# `cluster create` returns once the slots are assigned, but every node must
# also have seen the others before cluster-aware clients behave; wait for all
# three to report cluster_state:ok.
deadline=$((SECONDS + 30))
for p in "${cluster[@]}"; do
	until redis-cli -p "$p" cluster info 2>/dev/null | grep -q '^cluster_state:ok'; do
		if ((SECONDS >= deadline)); then
			log "cluster not ok after 30 s; node $p says:"
			redis-cli -p "$p" cluster info >&2 || true
			tail -n 20 "$tmp/$p/redis.log" >&2 || true
			exit 1
		fi
		sleep 0.2
	done
done

export SLUICE_TEST_REDIS_ADDR="127.0.0.1:$standalone"
SLUICE_TEST_REDIS_CLUSTER=$(
	IFS=,
	echo "${cluster[*]/#/127.0.0.1:}"
)
export SLUICE_TEST_REDIS_CLUSTER
export SLUICE_TEST_REDIS_SERVER="$redis_server"
log "standalone $SLUICE_TEST_REDIS_ADDR, cluster $SLUICE_TEST_REDIS_CLUSTER (logs in $tmp)"

# --- Run CMD. ---------------------------------------------------------------
# In the background + `wait`, so a signal sent to this script alone runs the
# trap at once (bash defers traps while a foreground command runs). Bash makes
# background commands ignore SIGINT/SIGQUIT and read /dev/null; undo both so
# CMD behaves as if run in the foreground (Ctrl-C works, `bash` is interactive).
(
	trap - INT QUIT
	exec "$@"
) <&0 &
child=$!
rc=0
wait "$child" || rc=$?
child=""
exit "$rc"
