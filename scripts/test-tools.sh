#!/usr/bin/env bash
# Usage: scripts/test-tools.sh
#
# Makes sure the tools the tests run, beyond redis-server (see
# redis-env.sh), are installed: Prometheus and promtool (the dashboard's
# queries and the rules, against the real thing) and a headless Chromium
# (the limits page, opened as a browser opens it). Installs the missing ones
# from Debian's packages; does nothing when all are there.
set -euo pipefail

missing=()
command -v prometheus >/dev/null || missing+=(prometheus)
command -v promtool >/dev/null || missing+=(prometheus)
if ! command -v chromium-headless-shell >/dev/null && ! command -v chromium >/dev/null; then
	missing+=(chromium-headless-shell)
fi
((${#missing[@]})) || exit 0

if [[ $EUID -eq 0 ]]; then
	sudo=()
elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
	sudo=(sudo)
else
	# Cannot install unattended: tell the developer the one thing to run.
	echo "sudo apt-get install -y ${missing[*]}"
	exit 1
fi
echo "test-tools: installing ${missing[*]} with apt-get" >&2
"${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq
"${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
