package bench

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
)

// The namespace pairs are the SOCKS5 path in the shape the Rust ztunnel needs: its listeners
// are fixed (15001/15006/15008 on the wildcard, SOCKS5 on 127.0.0.1:15080), so two of its
// nodes on one machine need a network namespace each. Each pair is two namespaces joined by
// a veth pair (nsClientIP in A, nsServerIP in B; the addresses exist only inside them), a
// dedicated node in each, and the echo server inside B on nsServerIP. The client dials node
// A's SOCKS5 listener from inside A; node A carries the connection over HBONE across the
// veth to node B's 15008 and node B on to the echo server. Every pair has the same shape
// and the same CA (meshCA); only the programs on the two nodes differ.
const (
	nsClientIP   = "10.30.0.1" // node A's workload, default/client
	nsServerIP   = "10.30.0.2" // node B's workload, default/server; the echo server
	nsServerPort = "8080"
)

// An nsPair is one namespace path: its name, a short tag for its namespaces' names, and the
// programs on node A (SOCKS5, client side) and node B (server side).
type nsPair struct {
	name, tag string
	a, b      program
}

// nsPairs returns the namespace paths to run: gozt's pair, and with the Rust ztunnel's
// binary (rs.bin not empty) the Rust pair and both mixed pairs, which double as interop.
func nsPairs(gozt, rs program) []nsPair {
	pairs := []nsPair{{name: "ztunnel-ns", tag: "ns", a: gozt, b: gozt}}
	if rs.bin == "" {
		return pairs
	}
	return append(pairs,
		nsPair{name: "ztunnel-rs", tag: "rs", a: rs, b: rs},
		nsPair{name: "gozt→rs", tag: "gr", a: gozt, b: rs},
		nsPair{name: "rs→gozt", tag: "rg", a: rs, b: gozt},
	)
}

// localWorkloads is the LOCAL_XDS_PATH file of the namespace paths, pairs and capture: the
// client workload (default/client) on node-a at clientIP, the server (default/server) on
// node-b at serverIP. Every workload names its services, if only as {}: the Rust ztunnel
// refuses one without; and its trust domain: left out, the Rust ztunnel's is empty
// (spiffe:///ns/…) and gozt's cluster.local, and the two then refuse each other's
// certificates.
func localWorkloads(clientIP, serverIP string) string {
	var b strings.Builder
	b.WriteString("workloads:\n")
	for _, w := range []struct{ name, ip, node string }{{"client", clientIP, "node-a"}, {"server", serverIP, "node-b"}} {
		fmt.Fprintf(&b, `  - uid: Kubernetes//v1/Pod/default/%[1]s
    name: %[1]s
    namespace: default
    serviceAccount: %[1]s
    workloadIps: ["%[2]s"]
    protocol: HBONE
    node: %[3]s
    services: {}
    trustDomain: cluster.local
`, w.name, w.ip, w.node)
	}
	return b.String()
}

// startNsPair builds pair pr's namespaces, echo server and nodes and returns its path. As in
// startCapture, each thing it makes gets its undo step as soon as it exists; they run when
// the suite ends, or before startNsPair returns when it fails.
func (s *suite) startNsPair(ctx context.Context, pr nsPair) (p *path, err error) {
	var undo []func()
	defer func() { s.settle(undo, err) }()
	ca, err := s.meshCA()
	if err != nil {
		return nil, err
	}
	dir := filepath.Join(s.work, "ns-"+pr.tag)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("bench: %w", err)
	}
	workloads := filepath.Join(dir, "workloads.yaml")
	if err := os.WriteFile(workloads, []byte(localWorkloads(nsClientIP, nsServerIP)), 0o644); err != nil {
		return nil, fmt.Errorf("bench: %w", err)
	}
	nsA := fmt.Sprintf("gozt-bench-p%s-a-%d", pr.tag, os.Getpid())
	nsB := fmt.Sprintf("gozt-bench-p%s-b-%d", pr.tag, os.Getpid())
	if err := makeNamespaces(&undo, nsA, nsB); err != nil {
		return nil, err
	}
	vethA, vethB := vethNames(pr.tag, program{})
	if err := joinVeth(nsA, nsB, vethA, vethB, nsClientIP, nsServerIP); err != nil {
		return nil, err
	}
	dialers := make([]*NetnsDialer, 2)
	for i, ns := range []string{nsA, nsB} {
		d, err := NewNetnsDialer(ns)
		if err != nil {
			return nil, err
		}
		undo = append(undo, func() { d.Close() })
		if err := ca.serveIn(d); err != nil {
			return nil, err
		}
		dialers[i] = d
	}
	ln, err := dialers[1].Listen("tcp", net.JoinHostPort(nsServerIP, nsServerPort))
	if err != nil {
		return nil, fmt.Errorf("bench: listen in %s: %w", nsB, err)
	}
	echo, err := Serve(ln, ServerConfig{Mode: ModeEcho})
	if err != nil {
		return nil, err
	}
	undo = append(undo, func() { echo.Close() })

	p = &path{
		name:   pr.name,
		target: Target{Addr: net.JoinHostPort(nsServerIP, nsServerPort), SOCKS5: "127.0.0.1:15080", DialContext: dialers[0].DialContext},
		// Its links are a veth pair, as the capture path's: veth is the same client and
		// server with no proxy between.
		baselines: []string{"veth"},
	}
	if pr.name != "ztunnel-rs" {
		p.rust = "ztunnel-rs"
	}
	for i, n := range []struct {
		name, node, ns, workload string
		pg                       program
	}{
		{fmt.Sprintf("ztunnel-%s-a-%s", pr.tag, pr.a.tag()), "node-a", nsA, "default/client/client", pr.a},
		{fmt.Sprintf("ztunnel-%s-b-%s", pr.tag, pr.b.tag()), "node-b", nsB, "default/server/server", pr.b},
	} {
		env := n.pg.dedicatedEnv(n.node, n.workload, workloads, ca.ca, i == 0)
		// ip netns exec execs the binary, so the child's pid is the node's own.
		c, err := startChild(n.name, filepath.Join(s.work, n.name+".log"), env, dir, "ip", "netns", "exec", n.ns, n.pg.bin)
		if err != nil {
			return nil, err
		}
		undo = append(undo, stopper(c))
		p.children = append(p.children, c)
		if err := waitReady(ctx, c, "http://127.0.0.1:15021/healthz/ready", dialers[i].DialContext); err != nil {
			return nil, err
		}
		if i == 0 {
			p.adminDial = dialers[0].DialContext
		}
		p.procs = append(p.procs, Proc{Name: n.name, PID: c.Pid()})
	}
	return p, nil
}
