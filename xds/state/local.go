package state

import (
	"errors"
	"net/netip"
	"strings"
)

// Mode is PROXY_MODE: how a ztunnel finds the workloads it serves.
type Mode string

const (
	// ModeShared is in-pod mode, as in Istio: istio-cni hands over each pod of the node and
	// the pod gets a proxy of its own, whose Local is the node's made [Local.Pod].
	ModeShared Mode = "shared"
	// ModeNode serves every workload on Local.Node from the proxy's own network namespace
	// (node-level redirection, for hosts without istio-cni). The zero Mode means ModeNode.
	ModeNode Mode = "node"
	// ModeDedicated serves the one workload Local.Workload names: a dedicated ztunnel.
	ModeDedicated Mode = "dedicated"
	// ModePod serves the one workload Local.Workload names, as ModeDedicated does: one
	// pod's proxy in in-pod mode ([Local.Pod]). It is no PROXY_MODE value; it keeps a
	// pod's proxy from passing for a dedicated ztunnel wherever the mode is shown or
	// compared.
	ModePod Mode = "pod"
)

// Modes are the values of PROXY_MODE, the default first.
var Modes = []Mode{ModeShared, ModeNode, ModeDedicated}

// ParseMode reads a PROXY_MODE value.
func ParseMode(s string) (Mode, error) {
	for _, m := range Modes {
		if s == string(m) {
			return m, nil
		}
	}
	return "", errors.New("unknown value")
}

// WorkloadRef names a workload: PROXY_WORKLOAD_INFO, namespace/name/serviceaccount.
type WorkloadRef struct{ Namespace, Name, ServiceAccount string }

// ParseWorkloadRef reads namespace/name/serviceaccount, each part non-empty; "" is the zero
// WorkloadRef.
func ParseWorkloadRef(s string) (WorkloadRef, error) {
	if s == "" {
		return WorkloadRef{}, nil
	}
	parts := strings.Split(s, "/")
	if len(parts) != 3 || parts[0] == "" || parts[1] == "" || parts[2] == "" {
		return WorkloadRef{}, errors.New("want three non-empty parts")
	}
	return WorkloadRef{Namespace: parts[0], Name: parts[1], ServiceAccount: parts[2]}, nil
}

// IsZero reports whether r names no workload.
func (r WorkloadRef) IsZero() bool { return r == WorkloadRef{} }

// String is namespace/name/serviceaccount, or "" for the zero WorkloadRef.
func (r WorkloadRef) String() string {
	if r.IsZero() {
		return ""
	}
	return r.Namespace + "/" + r.Name + "/" + r.ServiceAccount
}

// MarshalText shows r as PROXY_WORKLOAD_INFO is written (in /config_dump).
func (r WorkloadRef) MarshalText() ([]byte, error) { return []byte(r.String()), nil }

// Local is what one proxy serves: PROXY_MODE, NODE_NAME, NETWORK and PROXY_WORKLOAD_INFO in
// one value, with the questions the data plane, the DNS proxy and certificate prefetch ask
// of the store about it. The zero value serves every workload (ModeNode, any node) on the
// default network.
type Local struct {
	Mode Mode // [ModeNode]
	// Node, when set, restricts what is served to the workloads on that node: NODE_NAME in
	// shared and node mode and for a pod's proxy; a dedicated ztunnel leaves it empty.
	Node     string
	Network  string      // the local network
	Workload WorkloadRef // the workload of ModeDedicated and ModePod
}

// Dedicated reports whether l serves one named workload rather than a node's: a dedicated
// ztunnel's (ModeDedicated) or a pod's proxy's (ModePod).
func (l Local) Dedicated() bool { return l.Mode == ModeDedicated || l.Mode == ModePod }

// Pod is the Local of one pod's proxy in in-pod mode: the pod's workload, if it is on l's
// node, on l's network.
func (l Local) Pod(w WorkloadRef) Local {
	return Local{Mode: ModePod, Node: l.Node, Network: l.Network, Workload: w}
}

// DedicatedWorkload is the workload a dedicated Local serves, nil while the store does not
// have it (and when l is not dedicated). It matches as the Rust ztunnel's find_by_info
// does: same namespace and service account (when given), then name, and on Node when set.
// Names are unique in a namespace, so the name index finds it.
func (l Local) DedicatedWorkload(s *Store) *Workload {
	if !l.Dedicated() {
		return nil
	}
	ref := l.Workload
	w := s.FindWorkload(ref.Namespace, ref.Name)
	if w == nil || (ref.ServiceAccount != "" && w.ServiceAccount != ref.ServiceAccount) || !l.onNode(w) {
		return nil
	}
	return w
}

// WorkloadAt is the served workload at ip, nil if none: by IP on Network and Node, or the
// dedicated workload when ip is one of its addresses, loopback, unspecified or invalid
// (connections a dedicated proxy's own listeners take are its workload's).
func (l Local) WorkloadAt(s *Store, ip netip.Addr) *Workload {
	if l.Dedicated() {
		w := l.DedicatedWorkload(s)
		if w == nil || (ip.IsValid() && !w.HasAddress(ip) && !ip.IsLoopback() && !ip.IsUnspecified()) {
			return nil
		}
		return w
	}
	w := s.WorkloadByIP(l.Network, ip)
	if w == nil || !l.onNode(w) {
		return nil
	}
	return w
}

// Client is the served workload a connection or DNS query from ip comes from, nil if it is
// not local: the dedicated workload whatever ip is, else WorkloadAt.
func (l Local) Client(s *Store, ip netip.Addr) *Workload {
	if l.Dedicated() {
		return l.DedicatedWorkload(s)
	}
	return l.WorkloadAt(s, ip)
}

// Workloads are every workload l serves now, as certificate prefetch wants them: the
// dedicated one if the store has it, else those the store places on Node, by uid.
func (l Local) Workloads(s *Store) []*Workload {
	if l.Dedicated() {
		if w := l.DedicatedWorkload(s); w != nil {
			return []*Workload{w}
		}
		return nil
	}
	return s.WorkloadsOnNode(l.Node)
}

func (l Local) onNode(w *Workload) bool { return l.Node == "" || w.Node == l.Node }
