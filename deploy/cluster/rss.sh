#!/usr/bin/env bash
# Resident memory of every component of the cluster of deploy/cluster/up.sh: the processes it
# started (from .tmp/cluster/record) and every container of every node (its main process,
# by pod and container name). make cluster-rss.
set -euo pipefail
C=$(pwd)/.tmp/cluster
rss() { awk '/^VmRSS/ {printf "%6.1f MiB", $2/1024}' "${2:-}/proc/$1/status" 2>/dev/null || echo "  gone"; }
while read -r kind pid name; do
	[ "$kind" = pid ] || continue
	# a node's processes run as nsenter's child (nsenter forks to enter the PID namespace)
	if [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = nsenter ]; then pid=$(pgrep -P "$pid" | head -1); fi
	printf '%-52s %s\n' "$name" "$(rss "$pid")"
done < "$C/record"
for sock in "$C"/node*/root/run/containerd/containerd.sock; do
	node=$(basename "$(dirname "$(dirname "$(dirname "$(dirname "$sock")")")")")
	ctr -a "$sock" -n k8s.io tasks ls 2>/dev/null | awk 'NR > 1 && $3 == "RUNNING" {print $1, $2}' | while read -r id pid; do
		labels=$(ctr -a "$sock" -n k8s.io containers info "$id" | python3 -c 'import json,sys; l=json.load(sys.stdin)["Labels"]; print(l.get("io.kubernetes.pod.namespace","")+"/"+l.get("io.kubernetes.pod.name","")+" "+l.get("io.kubernetes.container.name","sandbox"))')
		case $labels in *" sandbox") continue ;; esac
		# containerd's pids are the node's PID namespace's: read them in the node's /proc
		printf '%-52s %s\n' "$node: $labels" "$(nsenter --mount="$C/ns/$node.mnt" awk '/^VmRSS/ {printf "%6.1f MiB", $2/1024}' "/proc/$pid/status")"
	done
done
