package state

import (
	"net/netip"
	"strings"
	"testing"
)

// TestLocal asks each question of Local in each mode against one store: a and b on node-a,
// c on node-b.
func TestLocal(t *testing.T) {
	onNode := func(n string) func(*Workload) { return func(w *Workload) { w.Node = n } }
	s := NewStore()
	s.Apply(&Batch{Workloads: []*Workload{
		wl("a", "10.0.0.1", onNode("node-a")),
		wl("b", "10.0.0.2", onNode("node-a")),
		wl("c", "10.0.0.3", onNode("node-b")),
	}})
	ref := func(name string) WorkloadRef {
		return WorkloadRef{Namespace: "default", Name: name, ServiceAccount: name}
	}
	nodeA := Local{Mode: ModeNode, Node: "node-a"}
	names := func(ws ...*Workload) string {
		var out []string
		for _, w := range ws {
			if w == nil {
				out = append(out, "-")
			} else {
				out = append(out, w.Name)
			}
		}
		return strings.Join(out, ",")
	}
	for _, tc := range []struct {
		name  string
		local Local
		// what each question answers: Workloads; WorkloadAt and Client of 10.0.0.1,
		// 10.0.0.3, 127.0.0.1 and no address; DedicatedWorkload.
		workloads, at, client, dedicated string
	}{
		{"zero: every node", Local{}, "", "a,c,-,-", "a,c,-,-", "-"},
		{"node-a", nodeA, "a,b", "a,-,-,-", "a,-,-,-", "-"},
		{"shared node-a", Local{Mode: ModeShared, Node: "node-a"}, "a,b", "a,-,-,-", "a,-,-,-", "-"},
		{"dedicated c", Local{Mode: ModeDedicated, Workload: ref("c")}, "c", "-,c,c,c", "c,c,c,c", "c"},
		{"pod c off this node", nodeA.Pod(ref("c")), "", "-,-,-,-", "-,-,-,-", "-"},
		{"pod a", nodeA.Pod(ref("a")), "a", "a,-,a,a", "a,a,a,a", "a"},
		{"dedicated, other service account", Local{Mode: ModeDedicated, Workload: WorkloadRef{"default", "a", "other"}}, "", "-,-,-,-", "-,-,-,-", "-"},
		{"dedicated, unknown", Local{Mode: ModeDedicated, Workload: ref("gone")}, "", "-,-,-,-", "-,-,-,-", "-"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			addrs := []netip.Addr{ip("10.0.0.1"), ip("10.0.0.3"), ip("127.0.0.1"), {}}
			var at, client []*Workload
			for _, a := range addrs {
				at = append(at, tc.local.WorkloadAt(s, a))
				client = append(client, tc.local.Client(s, a))
			}
			if got := names(tc.local.Workloads(s)...); got != tc.workloads {
				t.Errorf("Workloads = %q; want %q", got, tc.workloads)
			}
			if got := names(at...); got != tc.at {
				t.Errorf("WorkloadAt = %q; want %q", got, tc.at)
			}
			if got := names(client...); got != tc.client {
				t.Errorf("Client = %q; want %q", got, tc.client)
			}
			if got := names(tc.local.DedicatedWorkload(s)); got != tc.dedicated {
				t.Errorf("DedicatedWorkload = %q; want %q", got, tc.dedicated)
			}
		})
	}
}

func TestParseWorkloadRef(t *testing.T) {
	for _, tc := range []struct {
		in, want string // want is "" when ok is false
		ok       bool
	}{
		{"", "", true},
		{"ns/name/sa", "ns/name/sa", true},
		{"ns/name", "", false},
		{"ns//sa", "", false},
		{"/name/sa", "", false},
		{"ns/name/", "", false},
		{"ns/name/sa/x", "", false},
	} {
		r, err := ParseWorkloadRef(tc.in)
		if (err == nil) != tc.ok || r.String() != tc.want {
			t.Errorf("ParseWorkloadRef(%q) = %q, %v; want %q, ok %v", tc.in, r, err, tc.want, tc.ok)
		}
	}
	for _, m := range Modes {
		if got, err := ParseMode(string(m)); got != m || err != nil {
			t.Errorf("ParseMode(%q) = %q, %v", m, got, err)
		}
	}
	if _, err := ParseMode("sidecar"); err == nil {
		t.Error("ParseMode(sidecar): no error")
	}
}
