package clustertest

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gozt/gozt/internal/testutil"
)

// TestMigrate is make cluster-migrate (issue 45, docs/MIGRATING.md): Istio ambient with the
// Rust ztunnel on both nodes from Istio's chart, the scenarios 1–4 of make cluster-check
// against it, then the switch to gozt node by node and back under live traffic both ways,
// the way an operator canaries one node: a second release of Istio's ztunnel chart
// (ztunnel-gozt) whose DaemonSet runs on the nodes labelled for it, and a node affinity on
// the Rust release keeping the Rust ztunnel off the nodes labelled gozt. A node is switched
// make-before-break: labelled "both" (the new program starts beside the old one, and
// istio-cni hands it every pod), then labelled for the new program alone (the old pod is
// deleted and drains). The Rust ztunnel's image (RS_HUB/ztunnel:RS_TAG) is made and imported
// by make cluster-migrate from the binary in ZTUNNEL_RS.
func TestMigrate(t *testing.T) {
	setupFor(t, "CLUSTER_MIGRATE", "make cluster-migrate ZTUNNEL_RS=/path/to/ztunnel")
	charts, hub, tag := os.Getenv("ISTIO_CHARTS"), os.Getenv("RS_HUB"), os.Getenv("RS_TAG")
	if charts == "" || hub == "" || tag == "" {
		t.Skip("clustertest: SKIPPED: no ISTIO_CHARTS, RS_HUB or RS_TAG (make cluster-migrate sets them)")
	}
	nodes := []string{"node1", "node2"}
	t.Cleanup(func() {
		if os.Getenv("CLUSTER_KEEP_APPS") == "" {
			kubectl("delete", "namespace", ns, revNS, "--wait=false")
		}
	})
	m := &migration{t: t, charts: charts, rsImage: hub + "/ztunnel:" + tag}

	// The Rust ztunnel on both nodes from Istio's chart, only hub and tag set (a run before
	// this one, or make cluster-up, may have left gozt or the canary release).
	kubectl("label", "node", "node1", "node2", nodeLabel+"-")
	if _, err := run("helm", "status", "ztunnel-gozt", "-n", "istio-system"); err == nil {
		must(t, "helm", "uninstall", "ztunnel-gozt", "-n", "istio-system", "--wait")
	}
	must(t, "helm", "upgrade", "ztunnel", charts+"/ztunnel", "-n", "istio-system", "--reset-values",
		"--set", "hub="+hub, "--set", "tag="+tag, "--wait", "--timeout", "3m")
	for _, n := range nodes {
		m.waitProgram(n, "rust")
	}
	m.rustRevision = m.revision("ztunnel")

	var zt map[string]pod
	if !t.Run("1-4-rust", func(t *testing.T) {
		zt = clusterReady(t, nodes)
		for n, p := range zt {
			if img := p.Spec.Containers[0].Image; img != m.rsImage {
				t.Fatalf("ztunnel on %s runs %s, want %s", n, img, m.rsImage)
			}
		}
		appsReady(t, ns, "node2", "node1")
		appsReady(t, revNS, "node1", "node2")
		client, server := enrolled(t, zt, ns)
		crossNode(t, zt, ns, client, server)
		policy(t, ns)
	}) {
		t.FailNow()
	}

	// Rust → Rust, the baseline: a restart of the same DaemonSet.
	m.baseline("rust→rust on both nodes: kubectl rollout restart ds/ztunnel", nodes, func() {
		old := m.ztunnels()
		must(t, "kubectl", "-n", "istio-system", "rollout", "restart", "ds/ztunnel")
		must(t, "kubectl", "-n", "istio-system", "rollout", "status", "ds/ztunnel", "--timeout=3m")
		m.waitGone(old)
	})

	// The canary set-up: istiod trusts the second DaemonSet's service account to ask for
	// its pods' certificates (what trustedZtunnelName does for one name); the Rust release
	// gains the affinity (a rolling restart of it: measured as a second baseline); the gozt
	// release is installed with no node labelled for it yet, so it has no pod.
	must(t, "helm", "upgrade", "istiod", charts+"/istio-control/istio-discovery", "-n", "istio-system", "--reuse-values",
		"--set", `env.CA_TRUSTED_NODE_ACCOUNTS=istio-system/ztunnel\,istio-system/ztunnel-gozt`, "--wait", "--timeout", "3m")
	must(t, "kubectl", "-n", "istio-system", "rollout", "status", "deploy/istiod", "--timeout=3m")
	rustValues := m.values("rust", `affinity:
  nodeAffinity:
    requiredDuringSchedulingIgnoredDuringExecution:
      nodeSelectorTerms:
      - matchExpressions: [{key: `+nodeLabel+`, operator: NotIn, values: [gozt]}]
`)
	goztValues := m.values("gozt", `resourceName: ztunnel-gozt
hub: localhost/gozt
tag: v1
affinity:
  nodeAffinity:
    requiredDuringSchedulingIgnoredDuringExecution:
      nodeSelectorTerms:
      - matchExpressions: [{key: `+nodeLabel+`, operator: In, values: [gozt, both]}]
`)
	m.baseline("rust→rust on both nodes: helm upgrade ztunnel adding the affinity", nodes, func() {
		old := m.ztunnels()
		must(t, "helm", "upgrade", "ztunnel", charts+"/ztunnel", "-n", "istio-system", "--reuse-values", "-f", rustValues, "--wait", "--timeout", "3m")
		must(t, "kubectl", "-n", "istio-system", "rollout", "status", "ds/ztunnel", "--timeout=3m")
		m.waitGone(old)
	})
	must(t, "helm", "install", "ztunnel-gozt", charts+"/ztunnel", "-n", "istio-system", "-f", goztValues, "--wait", "--timeout", "3m")

	m.step("node2 rust→gozt (label node2 both, then gozt)", []string{"node2"}, func() { m.handover("node2", "gozt", "gozt") })
	m.mixed("node1 rust, node2 gozt")
	m.step("node1 rust→gozt (label node1 both, then gozt)", []string{"node1"}, func() { m.handover("node1", "gozt", "gozt") })
	t.Run("enrolled-gozt-gozt", func(t *testing.T) { m.enrolled(t) })
	m.step("node2 gozt→rust (label node2 both, then removed)", []string{"node2"}, func() { m.handover("node2", "rust", "-") })
	m.mixed("node1 gozt, node2 rust")
	// The rollback, in two steps to tell their figures apart: helm rollback of the Rust
	// release (no affinity: the Rust ztunnel starts on node1 beside gozt and takes its pods;
	// node2's restarts, Rust → Rust), then helm uninstall of the gozt release (gozt leaves node1).
	m.step("node1 gozt→rust (1/2), node2 rust→rust: helm rollback ztunnel", nodes, func() {
		old := m.ztunnels()
		must(t, "helm", "rollback", "ztunnel", fmt.Sprint(m.rustRevision), "-n", "istio-system", "--wait", "--timeout", "3m")
		must(t, "kubectl", "-n", "istio-system", "rollout", "status", "ds/ztunnel", "--timeout=3m")
		m.waitReady("node1", "rust")
		var rustOld []pod
		for _, p := range old {
			if program(p) == "rust" {
				rustOld = append(rustOld, p)
			}
		}
		m.waitGone(rustOld)
	})
	m.step("node1 gozt→rust (2/2): helm uninstall ztunnel-gozt", []string{"node1"}, func() {
		must(t, "helm", "uninstall", "ztunnel-gozt", "-n", "istio-system", "--wait")
		for _, n := range nodes {
			m.waitProgram(n, "rust")
		}
	})
	kubectl("label", "node", "node1", "node2", nodeLabel+"-")
	t.Run("enrolled-rust-rust", func(t *testing.T) { m.enrolled(t) })

	t.Log("migration under traffic (requests: a new connection every 50 ms each way; streams: 3 long-lived connections each way, 16 KiB echoed every 50 ms):")
	for _, r := range m.results {
		t.Logf("  %-90s %5.1fs  requests %4d failed %d slowest %5d ms  streams broken %d (redials failed %d)", r.name, r.took.Seconds(), r.requests, r.failed, r.slowest, r.broken, r.redialFailed)
	}
}

// revNS is the reverse pair of apps: its server on node1, its client on node2, so that
// traffic crosses every mixed pair both ways.
const revNS = "zt-rev"

// nodeLabel selects a node's ztunnel: unset for the Rust ztunnel, "gozt" for gozt, "both"
// while a node is handed from one to the other.
const nodeLabel = "gozt.io/ztunnel"

type migration struct {
	t            *testing.T
	charts       string
	rsImage      string
	rustRevision int
	results      []stepResult
}

type stepResult struct {
	name                                   string
	took                                   time.Duration
	requests, failed, broken, redialFailed int
	slowest                                int // ms
	baseline                               bool
}

// values writes a Helm values file for the test and returns its path.
func (m *migration) values(name, text string) string {
	p := filepath.Join(m.t.TempDir(), name+".yaml")
	if err := os.WriteFile(p, []byte(text), 0o644); err != nil {
		m.t.Fatal(err)
	}
	return p
}

func (m *migration) revision(release string) int {
	out := must(m.t, "helm", "status", release, "-n", "istio-system", "-o", "json")
	var s struct{ Version int }
	if err := json.Unmarshal([]byte(out), &s); err != nil {
		m.t.Fatal(err)
	}
	return s.Version
}

// ztunnels is every ztunnel pod (both releases' DaemonSets label theirs app=ztunnel),
// terminating ones included.
func (m *migration) ztunnels() []pod {
	m.t.Helper()
	ps, err := pods("istio-system", "app=ztunnel")
	if err != nil {
		m.t.Fatal(err)
	}
	return ps
}

func (m *migration) onNode(node string) ([]pod, error) {
	ps, err := pods("istio-system", "app=ztunnel")
	var on []pod
	for _, p := range ps {
		if p.Spec.NodeName == node {
			on = append(on, p)
		}
	}
	return on, err
}

// waitReady waits for a Ready ztunnel pod running program on node.
func (m *migration) waitReady(node, prog string) {
	m.t.Helper()
	eventually(m.t, prog+" Ready on "+node, 3*time.Minute, func() error {
		on, err := m.onNode(node)
		if err != nil {
			return err
		}
		for _, p := range on {
			if program(p) == prog && p.ready() {
				return nil
			}
		}
		return fmt.Errorf("%d ztunnel pods on %s, none a Ready %s", len(on), node, prog)
	})
}

// waitProgram waits until node has exactly one ztunnel pod, Ready and running program: the
// old one is gone (not only terminating).
func (m *migration) waitProgram(node, prog string) {
	m.t.Helper()
	eventually(m.t, "only "+prog+" on "+node, 3*time.Minute, func() error {
		on, err := m.onNode(node)
		if err != nil {
			return err
		}
		if len(on) != 1 || program(on[0]) != prog || !on[0].ready() {
			var s []string
			for _, p := range on {
				s = append(s, fmt.Sprintf("%s (%s, ready %v)", p.Metadata.Name, program(p), p.ready()))
			}
			return fmt.Errorf("ztunnel pods on %s: %v", node, s)
		}
		return nil
	})
}

// waitGone waits until none of the pods in old exists any more (terminated, not only
// terminating: until then an old ztunnel may still carry connections).
func (m *migration) waitGone(old []pod) {
	m.t.Helper()
	eventually(m.t, "old ztunnel pods gone", 3*time.Minute, func() error {
		ps, err := pods("istio-system", "app=ztunnel")
		if err != nil {
			return err
		}
		for _, p := range ps {
			for _, o := range old {
				if p.Metadata.UID == o.Metadata.UID {
					return fmt.Errorf("%s on %s still there", p.Metadata.Name, p.Spec.NodeName)
				}
			}
		}
		return nil
	})
}

// handover switches node to program make-before-break: the label "both" starts the new
// program beside the old one; once it is Ready, the label final ("-" removes it) leaves the
// new program alone, and the old pod is waited out.
func (m *migration) handover(node, prog, final string) {
	m.t.Helper()
	m.t.Logf("%s: labelled both at %s", node, time.Now().UTC().Format("15:04:05.000"))
	must(m.t, "kubectl", "label", "node", node, nodeLabel+"=both", "--overwrite")
	m.waitReady(node, prog)
	m.t.Logf("%s: labelled %s at %s", node, final, time.Now().UTC().Format("15:04:05.000"))
	if final == "-" {
		must(m.t, "kubectl", "label", "node", node, nodeLabel+"-")
	} else {
		must(m.t, "kubectl", "label", "node", node, nodeLabel+"="+final, "--overwrite")
	}
	m.waitProgram(node, prog)
	m.t.Logf("%s: old pod gone at %s", node, time.Now().UTC().Format("15:04:05.000"))
}

// step runs f under traffic both ways between the nodes (ns: node1 → node2, revNS: node2 →
// node1): a request loop and long-lived streams in each client pod, from when every stream
// is open to 3 s after f returned (f waits until the old ztunnel pods are gone, so a stream
// an old pod's drain ends is counted). It records the failed requests and broken streams and
// checks that every pod is still enrolled and Up in its node's ztunnel. nodes are the nodes
// f switches, for the log.
func (m *migration) step(name string, nodes []string, f func()) {
	m.measure(name, nodes, false, f)
}

// baseline is step for a Rust → Rust restart: the same counts, recorded, not checked (the
// Rust ztunnel's own figures, to hold gozt's handovers against).
func (m *migration) baseline(name string, nodes []string, f func()) {
	m.measure(name, nodes, true, f)
}

func (m *migration) measure(name string, nodes []string, baseline bool, f func()) {
	t := m.t
	t.Helper()
	type gen struct {
		cmd  *exec.Cmd
		in   interface{ Close() error }
		out  *testutil.SyncBuffer
		done chan error
	}
	var gens []*gen
	for _, namespace := range []string{ns, revNS} {
		cmd := exec.Command(tool("kubectl"), "-n", namespace, "exec", "-i", "client", "--", "/app", "traffic", addr(namespace), "3")
		cmd.Env = append(os.Environ(), "KUBECONFIG="+kubeconfig)
		in, err := cmd.StdinPipe()
		if err != nil {
			t.Fatal(err)
		}
		g := &gen{cmd: cmd, in: in, out: &testutil.SyncBuffer{}, done: make(chan error, 1)}
		cmd.Stdout, cmd.Stderr = g.out, g.out
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		go func() { g.done <- cmd.Wait() }()
		gens = append(gens, g)
	}
	eventually(t, name+": traffic streaming both ways", time.Minute, func() error {
		for _, g := range gens {
			if !strings.Contains(g.out.String(), "streaming") {
				return fmt.Errorf("traffic: %q", g.out.String())
			}
		}
		return nil
	})
	start := time.Now()
	t.Logf("%s: starts at %s", name, start.UTC().Format("15:04:05.000"))
	f()
	took := time.Since(start)
	time.Sleep(3 * time.Second) // traffic after the switch, counted with it
	r := stepResult{name: name, took: took, baseline: baseline}
	for i, g := range gens {
		g.in.Close()
		select {
		case err := <-g.done:
			if err != nil {
				t.Errorf("%s: traffic from %s: %v: %s", name, []string{ns, revNS}[i], err, g.out.String())
			}
		case <-time.After(30 * time.Second):
			g.cmd.Process.Kill()
			t.Errorf("%s: traffic from %s did not end: %s", name, []string{ns, revNS}[i], g.out.String())
		}
		var req, failed, slowest, streams, broken, redial int
		var streamed int64
		var reqErrs, streamErr string
		out := g.out.String()
		line := out[strings.LastIndex(out, "requests "):]
		if _, err := fmt.Sscanf(line, "requests %d failed %d slowest-ms %d streams %d broken %d redials-failed %d streamed %d request-errors %q stream-error %q",
			&req, &failed, &slowest, &streams, &broken, &redial, &streamed, &reqErrs, &streamErr); err != nil {
			t.Errorf("%s: traffic report %q: %v", name, line, err)
		}
		t.Logf("%s: %s → %s: %d requests, %d failed, slowest %d ms; %d streams, %d broken, %d redials failed, %d MiB streamed; failed requests: %s; first broken stream: %s",
			name, []string{"node1", "node2"}[i], []string{"node2", "node1"}[i], req, failed, slowest, streams, broken, redial, streamed>>20, reqErrs, streamErr)
		r.requests += req
		r.failed += failed
		r.slowest = max(r.slowest, slowest)
		r.broken += broken
		r.redialFailed += redial
		if failed > 0 && !baseline {
			t.Errorf("%s: %d of %d requests failed (%s → %s): %s", name, failed, req, []string{"node1", "node2"}[i], []string{"node2", "node1"}[i], reqErrs)
		}
	}
	m.results = append(m.results, r)
	t.Logf("%s: switched %v in %.1fs", name, nodes, took.Seconds())
	t.Run("enrolled-after "+name, func(t *testing.T) { m.enrolled(t) })
}

// enrolled: every pod of both namespaces annotated by istio-cni and Up in the workloadState
// of its node's newest ztunnel (the one istio-cni hands pods to: with two on a node, the
// program that came last; istio-cni's snapshot reconciled by it), and reachable.
func (m *migration) enrolled(t *testing.T) {
	zt := map[string]pod{}
	for _, p := range m.ztunnels() {
		if cur, ok := zt[p.Spec.NodeName]; p.ready() && p.Metadata.DeletionTimestamp == nil && (!ok || p.Metadata.CreationTimestamp.After(cur.Metadata.CreationTimestamp)) {
			zt[p.Spec.NodeName] = p
		}
	}
	admin := map[string]string{}
	for _, namespace := range []string{ns, revNS} {
		ps, err := pods(namespace, "")
		if err != nil {
			t.Fatal(err)
		}
		for _, p := range ps {
			if p.Metadata.Annotations["ambient.istio.io/redirection"] != "enabled" {
				t.Errorf("%s/%s left unenrolled", namespace, p.Metadata.Name)
			}
			node := p.Spec.NodeName
			if admin[node] == "" {
				admin[node] = forward(t, zt[node], 15000)
			}
			eventually(t, p.Metadata.Namespace+"/"+p.Metadata.Name+" Up in "+program(zt[node])+" on "+node, time.Minute, func() error {
				return workloadUp(admin[node], p)
			})
		}
		if err := echo(namespace, addr(namespace), 1000); err != nil {
			t.Errorf("%s: client → server: %v", namespace, err)
		}
	}
}

// mixed runs the assertions of scenarios 2–4 with one node on each program: enrollment,
// cross-node HBONE with metrics, DNS and access logs, and policy (DENY, ALLOW, STRICT, a DENY
// closing an open connection) both ways, so one direction goes from the Rust ztunnel to gozt
// and the other from gozt to the Rust ztunnel.
func (m *migration) mixed(state string) {
	m.t.Run("mixed "+state, func(t *testing.T) {
		zt, err := onePerNode("istio-system", "app=ztunnel", "node1", "node2")
		if err != nil {
			t.Fatal(err)
		}
		for _, namespace := range []string{ns, revNS} {
			t.Run(namespace, func(t *testing.T) {
				client, server := enrolled(t, zt, namespace)
				t.Logf("%s: client on %s (%s) → server on %s (%s)", namespace, client.Spec.NodeName, program(zt[client.Spec.NodeName]),
					server.Spec.NodeName, program(zt[server.Spec.NodeName]))
				crossNode(t, zt, namespace, client, server)
				policy(t, namespace)
			})
		}
	})
}
