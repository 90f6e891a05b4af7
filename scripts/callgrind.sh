#!/usr/bin/env bash
# Usage: scripts/callgrind.sh [BENCH FLAGS...]
#
# Counts the instructions redis-server spends per decision, for each
# algorithm, a two-claim Book and redis_rate: cmd/bench's callgrind section,
# which starts a redis-server of its own under valgrind's callgrind. Installs
# valgrind with apt-get when it is missing, as redis-env.sh does redis-server.
# SLUICE_CALLGRIND_KEEP=1 keeps callgrind's dumps (one per contender, in
# order) for callgrind_annotate.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v valgrind >/dev/null || ! command -v callgrind_annotate >/dev/null; then
	if [[ $EUID -eq 0 ]]; then
		sudo=()
	elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
		sudo=(sudo)
	else
		echo "sudo apt-get install -y valgrind"
		exit 1
	fi
	echo "callgrind: installing valgrind with apt-get" >&2
	"${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq
	"${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq valgrind
fi
exec scripts/redis-env.sh go run ./cmd/bench -only callgrind "$@"
