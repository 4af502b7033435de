// Package inpod is ztunnel's side of in-pod ("shared") mode: the ZDS client that learns from
// the istio-cni node agent which pods on this node are in the mesh, each with its network
// namespace, and the state machine that decides when each pod's proxy starts, drains and
// stops. It hands every pod to a Proxies implementation; it opens no socket in a pod itself,
// knows nothing of xDS or certificates, and never blocks a pod's acknowledgement on them.
//
// Both are Manager, which the Rust ztunnel calls the workload manager: that is the name its
// readiness task ("workload manager") and metric families (workload_manager_*) carry, here
// as there. inpod/zdsagent is the other end, a node agent stand-in for tests and demos.
//
// # Wire protocol (ZDS, istio.workload.zds; messages in inpod/zdspb)
//
// The agent listens on a SOCK_SEQPACKET unix socket (INPOD_UDS, default
// /var/run/ztunnel/ztunnel.sock); ztunnel connects, retrying with a backoff of 10 ms doubling
// to 15 s. Every packet holds exactly one protobuf message; reads use a 1 KiB buffer.
//
//	ztunnel -> agent  ZdsHello{version: V1}           (the bytes 08 01)
//	agent -> ztunnel  WorkloadRequest                 one per packet, each waiting for its answer
//	ztunnel -> agent  WorkloadResponse{ack{error}}    one per request, in order; error "" = ACK
//
// A request is one of Add{uid, workload_info} (carrying the pod's netns as the packet's only
// SCM_RIGHTS fd), Keep{uid}, Del{uid} (uid is field 2) or SnapshotSent. On each connection the
// agent first replays every pod it knows, as Add (netns still held) or Keep (netns lost), then
// sends SnapshotSent; after that only Add and Del follow. ztunnel never sends anything
// unsolicited: the agent drops a connection that does.
//
// What ztunnel answers, with the Rust ztunnel's error strings:
//   - ACK: the request is done. A repeated Add with the same netns (device, inode) is one.
//   - "failure to start proxy : ...": Add's proxy did not start (e.g. a bind error). The pod
//     stays pending, is retried every 5 s, and the connection stays up.
//   - "failure to read message : ...": the packet was malformed (truncated, not protobuf, no
//     payload, a missing, extra or non-netns fd). The connection is dropped and redialed.
//   - "failure to process message : ...": a protocol error (Add without workload_info, Keep
//     after the snapshot, a second SnapshotSent). The Rust ztunnel exits; this one drops the
//     connection and redials with backoff, so the agent replays its snapshot.
//
// On SnapshotSent the manager reconciles: proxies of pods the snapshot did not name are
// drained, the others keep running untouched. Del after the snapshot stops the pod's proxy at
// once (the pod is gone); before it, it only forgets the pod for this snapshot. Close drains
// every proxy gracefully. Ready holds once a snapshot is reconciled on the current connection
// and no pod is pending.
package inpod

import (
	"github.com/gozt/gozt/internal/netns"
)

// WorkloadInfo is the pod's Kubernetes identity as ZDS gives it; its JSON is the Rust
// ztunnel's in workloadState.
type WorkloadInfo struct {
	Name           string `json:"name"`
	Namespace      string `json:"namespace"`
	ServiceAccount string `json:"serviceAccount"`
}

// Pod is one pod handed to Proxies.Start.
type Pod struct {
	UID  string // Kubernetes pod UID
	Info WorkloadInfo
	// NetNS is the pod's network namespace. Start owns it once it returns nil and must close
	// it when the pod's proxy has stopped; when Start fails the Manager keeps and closes it.
	NetNS *netns.NetNS
}

// Proxies runs the per-pod proxies. The Manager calls it from one goroutine, never twice at
// once, and waits for each call before acknowledging the request that caused it, so every
// method must return promptly (istio-cni gives each request 5 s).
type Proxies interface {
	// Start binds the pod's listeners in p.NetNS and starts serving. It must not wait for
	// xDS or the CA. An error NACKs the pod, which is retried every 5 s.
	Start(p Pod) error
	// Drain shuts the pod's proxy down gracefully, in the background: its pod left the
	// snapshot, or ztunnel is shutting down.
	Drain(uid string)
	// Stop shuts the pod's proxy down at once, in the background: the pod is gone (Del, or
	// Add with a new netns, which is followed by Start for the same uid).
	Stop(uid string)
}

// State is a pod's proxy state in workloadState.
type State string

// States as the Rust ztunnel names them.
const (
	StatePending State = "Pending" // Start failed; retried every 5 s
	StateUp      State = "Up"
)

// PodState is one entry of WorkloadState, keyed by pod UID.
type PodState struct {
	State State        `json:"state"`
	Info  WorkloadInfo `json:"info"`
}

// Stats are the workload manager's counters (the workload_manager_* metric families).
type Stats struct {
	Active, Pending  int    // pods whose proxy runs; pods whose Start failed
	Started, Stopped uint64 // Start successes; Drain and Stop calls
}
