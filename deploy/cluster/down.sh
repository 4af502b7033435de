#!/usr/bin/env bash
# make cluster-down: undoes what deploy/cluster/up.sh recorded in .tmp/cluster/record, last
# first: the processes it started (each node's containerd first stops its pods' containers),
# then mounts, network namespaces, links, routes, iptables rules and the directories it made;
# then .tmp/cluster itself (images and logs with it; CLUSTER_KEEP=1 keeps the logs).
set -uo pipefail
C=$(pwd)/.tmp/cluster
REC=$C/record
[ -f "$REC" ] || { echo "cluster-down: no $REC: nothing to do"; exit 0; }
# A node's pods: their shims and containers run in the node's namespaces; stop them through
# their containerd before the containerd itself goes.
for sock in "$C"/node*/root/run/containerd/containerd.sock; do
	[ -S "$sock" ] || continue
	for t in $(ctr -a "$sock" -n k8s.io tasks ls -q 2>/dev/null); do ctr -a "$sock" -n k8s.io tasks kill -s SIGKILL "$t" >/dev/null 2>&1; done
done
stop() { # PID NAME: TERM, then KILL after 10 s; its process group with it (started by setsid)
	local pid=$1
	kill -0 "$pid" 2>/dev/null || return 0
	kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid"
	for ((i = 0; i < 50; i++)); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.2; done
	kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid"
}
tac "$REC" | while read -r kind a rest; do
	case $kind in
	pid) stop "$a" ;;
	esac
done
# Shims of the nodes' pods that outlived their containerd (they re-parent to init): only those
# whose working directory is under one of our nodes' containerd state.
for p in $(pgrep -f containerd-shim-runc-v2 || true); do
	if tr '\0' ' ' < "/proc/$p/cmdline" 2>/dev/null | grep -q -- "-address /run/containerd/containerd.sock" &&
		[ "$(readlink "/proc/$p/ns/mnt" 2>/dev/null)" != "$(readlink /proc/self/ns/mnt)" ]; then
		for m in "$C"/ns/*.mnt; do
			# nsfs files compare by inode: the shim is ours if its mount namespace is a node's
			if [ "$(stat -L -c %i "/proc/$p/ns/mnt" 2>/dev/null)" = "$(stat -c %i "$m" 2>/dev/null)" ]; then kill -KILL "$p"; fi
		done
	fi
done
tac "$REC" | while read -r kind a rest; do
	case $kind in
	mount) umount -l "$a" 2>/dev/null ;;
	netns) ip netns del "$a" 2>/dev/null ;;
	link) ip link del "$a" 2>/dev/null ;;
	route) ip route del "$a" 2>/dev/null ;;
	iptables) iptables -w -D $a $rest 2>/dev/null ;;
	dir) rmdir "$a" 2>/dev/null ;;
	cgroup) find "$a" -depth -type d -exec rmdir {} + 2>/dev/null ;;
	esac
done
rm -f "$REC"
if [ "${CLUSTER_KEEP:-}" = 1 ]; then
	find "$C" -mindepth 1 -maxdepth 1 ! -name logs -exec rm -rf {} +
else
	rm -rf "$C"
fi
echo "cluster-down: done"
