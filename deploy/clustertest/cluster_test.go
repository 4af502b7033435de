// Package clustertest is make cluster-check: Istio ambient with gozt as its ztunnel on the
// two-node cluster of make cluster-up (deploy/cluster), checked the way a user would look at
// it — kubectl, istioctl, helm, gozt's admin and metrics ports through kubectl port-forward,
// and traffic between pods. The scenarios run in the order of issue 44 as subtests of one
// test, since each builds on the cluster the one before left. Without CLUSTER_CHECK=1 (set by
// make cluster-check), root, the tools in .tools/ and a cluster, it skips.
package clustertest

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/gozt/gozt/internal/testutil"
)

const ns = "zt-check" // the ambient namespace the scenarios make and remove

var root, kubeconfig string

func tool(name string) string { return filepath.Join(root, ".tools", name) }

func setup(t *testing.T) { setupFor(t, "CLUSTER_CHECK", "make cluster-check") }

// setupFor skips unless env is 1 (set by the make target named), the test runs as root and
// the tools and a cluster are there.
func setupFor(t *testing.T, env, target string) {
	t.Helper()
	if os.Getenv(env) != "1" {
		t.Skipf("clustertest: SKIPPED: runs against a cluster from make cluster-up, with %s (%s=1)", target, env)
	}
	if os.Geteuid() != 0 {
		t.Skip("clustertest: SKIPPED: needs root")
	}
	wd, _ := os.Getwd()
	root = filepath.Clean(filepath.Join(wd, "../.."))
	kubeconfig = filepath.Join(root, ".tmp/cluster/kubeconfig")
	for _, f := range []string{kubeconfig, tool("kubectl"), tool("istioctl"), tool("helm")} {
		if _, err := os.Stat(f); err != nil {
			t.Skipf("clustertest: SKIPPED: no %s (make cluster-up)", f)
		}
	}
}

// run runs a tool with the cluster's kubeconfig and returns its combined output.
func run(name string, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, tool(name), args...)
	cmd.Env = append(os.Environ(), "KUBECONFIG="+kubeconfig)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, out)
	}
	return string(out), nil
}

func kubectl(args ...string) (string, error) { return run("kubectl", args...) }

func must(t *testing.T, name string, args ...string) string {
	t.Helper()
	out, err := run(name, args...)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// eventually polls f until it returns nil or the time is up, then fails with f's last error.
func eventually(t *testing.T, what string, d time.Duration, f func() error) {
	t.Helper()
	start := time.Now()
	var err error
	for time.Since(start) < d {
		if err = f(); err == nil {
			t.Logf("%s: after %.1fs", what, time.Since(start).Seconds())
			return
		}
		time.Sleep(500 * time.Millisecond)
	}
	t.Fatalf("%s: not within %s: %v", what, d, err)
}

type pod struct {
	Metadata struct {
		Name, Namespace, UID string
		CreationTimestamp    time.Time
		DeletionTimestamp    *time.Time
		Annotations          map[string]string
		Labels               map[string]string
	}
	Spec struct {
		NodeName   string
		Containers []struct{ Image string }
	}
	Status struct {
		PodIP      string
		Phase      string
		Conditions []struct{ Type, Status string }
	}
}

func (p pod) ready() bool {
	for _, c := range p.Status.Conditions {
		if c.Type == "Ready" {
			return c.Status == "True"
		}
	}
	return false
}

func pods(namespace, selector string) ([]pod, error) {
	args := []string{"get", "pods", "-o", "json", "-n", namespace}
	if selector != "" {
		args = append(args, "-l", selector)
	}
	out, err := kubectl(args...)
	if err != nil {
		return nil, err
	}
	var l struct{ Items []pod }
	if err := json.Unmarshal([]byte(out), &l); err != nil {
		return nil, err
	}
	return l.Items, nil
}

// onePerNode is the selector's pods, one Ready pod per node, by node name.
func onePerNode(namespace, selector string, nodes ...string) (map[string]pod, error) {
	ps, err := pods(namespace, selector)
	if err != nil {
		return nil, err
	}
	by := map[string]pod{}
	for _, p := range ps {
		if !p.ready() {
			return nil, fmt.Errorf("%s/%s on %s not Ready (%s)", namespace, p.Metadata.Name, p.Spec.NodeName, p.Status.Phase)
		}
		if _, dup := by[p.Spec.NodeName]; dup {
			return nil, fmt.Errorf("%s: two pods on %s", selector, p.Spec.NodeName)
		}
		by[p.Spec.NodeName] = p
	}
	for _, n := range nodes {
		if _, ok := by[n]; !ok {
			return nil, fmt.Errorf("%s: no pod on %s (have %d)", selector, n, len(by))
		}
	}
	return by, nil
}

// forward is kubectl port-forward to a pod's port; it returns the local address.
func forward(t *testing.T, p pod, port int) string {
	t.Helper()
	cmd := exec.Command(tool("kubectl"), "-n", p.Metadata.Namespace, "port-forward", "--address", "127.0.0.1", "pod/"+p.Metadata.Name, fmt.Sprintf(":%d", port))
	cmd.Env = append(os.Environ(), "KUBECONFIG="+kubeconfig)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = io.Discard
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil {
		t.Fatalf("port-forward %s:%d: %v", p.Metadata.Name, port, err)
	}
	m := regexp.MustCompile(`127\.0\.0\.1:(\d+)`).FindStringSubmatch(line)
	if m == nil {
		t.Fatalf("port-forward %s:%d: %q", p.Metadata.Name, port, line)
	}
	go io.Copy(io.Discard, out)
	return "127.0.0.1:" + m[1]
}

func get(url string) (string, error) {
	c := http.Client{Timeout: 10 * time.Second}
	resp, err := c.Get(url)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 {
		return string(b), fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	return string(b), err
}

// apply is kubectl apply of a manifest given as text.
func apply(t *testing.T, manifest string) {
	t.Helper()
	cmd := exec.Command(tool("kubectl"), "apply", "-f", "-")
	cmd.Env = append(os.Environ(), "KUBECONFIG="+kubeconfig)
	cmd.Stdin = strings.NewReader(manifest)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("kubectl apply: %v: %s", err, out)
	}
}

// apps is the scenarios' workloads: an echo server Deployment pinned to serverNode behind a
// Service, and a client pod pinned to clientNode, each with its own service account (so each
// has its own SPIFFE identity), in an ambient namespace.
func apps(namespace, mode, serverNode, clientNode string) string {
	return fmt.Sprintf(`apiVersion: v1
kind: Namespace
metadata: {name: %[1]s, labels: {istio.io/dataplane-mode: %[2]s}}
---
apiVersion: v1
kind: ServiceAccount
metadata: {name: server, namespace: %[1]s}
---
apiVersion: v1
kind: ServiceAccount
metadata: {name: client, namespace: %[1]s}
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: server, namespace: %[1]s}
spec:
  replicas: 1
  selector: {matchLabels: {app: server}}
  template:
    metadata: {labels: {app: server}}
    spec:
      serviceAccountName: server
      nodeSelector: {kubernetes.io/hostname: %[3]s}
      terminationGracePeriodSeconds: 2
      containers:
      - name: server
        image: localhost/gozt/app:v1
        imagePullPolicy: Never
        args: [serve, ":8080"]
        ports: [{containerPort: 8080}]
        readinessProbe: {tcpSocket: {port: 8080}, periodSeconds: 2}
---
apiVersion: v1
kind: Service
metadata: {name: server, namespace: %[1]s}
spec:
  selector: {app: server}
  ports: [{name: tcp-echo, port: 8080}]
---
apiVersion: v1
kind: Pod
metadata: {name: client, namespace: %[1]s, labels: {app: client}}
spec:
  serviceAccountName: client
  nodeSelector: {kubernetes.io/hostname: %[4]s}
  terminationGracePeriodSeconds: 1
  containers:
  - name: client
    image: localhost/gozt/app:v1
    imagePullPolicy: Never
    args: [pause]
`, namespace, mode, serverNode, clientNode)
}

// echo runs the app's echo client in the client pod of namespace and checks what it prints.
func echo(namespace, addr string, n int) error {
	out, err := kubectl("-n", namespace, "exec", "client", "--", "/app", "echo", addr, fmt.Sprint(n))
	if err != nil {
		return err
	}
	if strings.TrimSpace(out) != fmt.Sprintf("ok %d", n) {
		return fmt.Errorf("echo %s: %q", addr, out)
	}
	return nil
}

// metric sums the samples of family whose labels include every one of want.
func metric(text, family string, want map[string]string) (float64, int) {
	var sum float64
	var n int
	for _, line := range strings.Split(text, "\n") {
		if !strings.HasPrefix(line, family+"{") && !strings.HasPrefix(line, family+" ") {
			continue
		}
		ok := true
		for k, v := range want {
			if !strings.Contains(line, fmt.Sprintf(`%s="%s"`, k, v)) {
				ok = false
				break
			}
		}
		if !ok {
			continue
		}
		var v float64
		fmt.Sscan(line[strings.LastIndexByte(line, ' ')+1:], &v)
		sum += v
		n++
	}
	return sum, n
}

type configDump struct {
	WorkloadState map[string]struct {
		State string
		Info  struct{ Name, Namespace string }
	}
	Workloads []struct {
		Name, Namespace, Protocol, Node string
		UID                             string
	}
}

func TestCluster(t *testing.T) {
	setup(t)
	nodes := []string{"node1", "node2"}
	t.Cleanup(func() {
		if os.Getenv("CLUSTER_KEEP_APPS") == "" {
			kubectl("delete", "namespace", ns, "--wait=false")
		}
	})
	var zt map[string]pod

	if !t.Run("1-ready", func(t *testing.T) {
		zt = clusterReady(t, nodes)
		for n, p := range zt {
			if img := p.Spec.Containers[0].Image; !strings.HasPrefix(img, "localhost/gozt/ztunnel:") {
				t.Errorf("ztunnel on %s runs %s, not gozt's image", n, img)
			}
		}
		appsReady(t, ns, "node2", "node1")
	}) {
		t.FailNow()
	}

	var client, server pod
	t.Run("2-enrolled", func(t *testing.T) {
		client, server = enrolled(t, zt, ns)
		if client.Spec.NodeName != "node1" || server.Spec.NodeName != "node2" {
			t.Fatalf("client on %q, server on %q: want node1 and node2", client.Spec.NodeName, server.Spec.NodeName)
		}
	})

	t.Run("3-cross-node-hbone", func(t *testing.T) {
		if client.Metadata.UID == "" {
			t.Skip("needs 2-enrolled's pods")
		}
		crossNode(t, zt, ns, client, server)
	})

	t.Run("4-policy", func(t *testing.T) {
		if client.Metadata.UID == "" {
			t.Skip("needs 2-enrolled's pods")
		}
		policy(t, ns)
	})
	t.Run("5-scale", func(t *testing.T) {
		if client.Metadata.UID == "" {
			t.Skip("needs 2-enrolled's pods")
		}
		scale(t, zt["node2"])
	})
	t.Run("6-upgrade", func(t *testing.T) {
		if client.Metadata.UID == "" {
			t.Skip("needs 2-enrolled's pods")
		}
		upgrade(t)
	})
	t.Run("7-istioctl", func(t *testing.T) {
		out := must(t, "istioctl", "ztunnel-config", "all", "-n", "istio-system")
		if !strings.Contains(out, ns) {
			t.Errorf("istioctl ztunnel-config all names no workload of %s:\n%s", ns, out)
		}
		must(t, "istioctl", "x", "precheck")
		out = must(t, "istioctl", "analyze", "-A")
		if regexp.MustCompile(`(?m)^Error`).MatchString(out) {
			t.Errorf("istioctl analyze -A reports errors:\n%s", out)
		}
		t.Logf("istioctl analyze -A:\n%s", out)
	})
}

// clusterReady waits for both nodes Ready, istiod, istio-cni and one ztunnel per node (whichever
// program it runs) and CoreDNS; it returns the ztunnel pods by node.
func clusterReady(t *testing.T, nodes []string) map[string]pod {
	t.Helper()
	eventually(t, "nodes Ready", 2*time.Minute, func() error {
		out, err := kubectl("get", "nodes", "-o", `jsonpath={range .items[*]}{.metadata.name}={.status.conditions[?(@.type=="Ready")].status} {end}`)
		if err != nil {
			return err
		}
		if strings.TrimSpace(out) != "node1=True node2=True" {
			return fmt.Errorf("nodes: %s", out)
		}
		return nil
	})
	eventually(t, "istiod Ready", 3*time.Minute, func() error {
		ps, err := pods("istio-system", "app=istiod")
		if err != nil {
			return err
		}
		if len(ps) != 1 || !ps[0].ready() {
			return fmt.Errorf("istiod pods: %d, want 1 Ready", len(ps))
		}
		return nil
	})
	eventually(t, "istio-cni on both nodes Ready", 3*time.Minute, func() error {
		_, err := onePerNode("istio-system", "k8s-app=istio-cni-node", nodes...)
		return err
	})
	var zt map[string]pod
	eventually(t, "ztunnel on both nodes Ready", 3*time.Minute, func() error {
		var err error
		zt, err = onePerNode("istio-system", "app=ztunnel", nodes...)
		return err
	})
	eventually(t, "coredns Ready", 2*time.Minute, func() error {
		_, err := onePerNode("kube-system", "k8s-app=kube-dns")
		return err
	})
	return zt
}

// appsReady (re)creates apps(namespace, ...) and waits for its two pods to be Ready.
func appsReady(t *testing.T, namespace, serverNode, clientNode string) {
	t.Helper()
	// A run before this one deletes its namespaces without waiting: wait for them to go.
	must(t, "kubectl", "delete", "namespace", namespace, namespace+"-plain", "--ignore-not-found", "--wait=true", "--timeout=3m")
	apply(t, apps(namespace, "ambient", serverNode, clientNode))
	eventually(t, namespace+" apps Ready", 3*time.Minute, func() error {
		ps, err := pods(namespace, "")
		if err != nil {
			return err
		}
		if len(ps) != 2 {
			return fmt.Errorf("%d pods in %s, want 2", len(ps), namespace)
		}
		for _, p := range ps {
			if !p.ready() {
				return fmt.Errorf("%s not Ready (%s)", p.Metadata.Name, p.Status.Phase)
			}
		}
		return nil
	})
}

// enrolled: istio-cni annotated namespace's pods, the ztunnel of each pod's node has it Up in
// its workloadState (/config_dump, a field gozt and the Rust ztunnel share) with protocol
// HBONE, and istioctl ztunnel-config workloads shows both HBONE. It returns the client and
// server pods.
func enrolled(t *testing.T, zt map[string]pod, namespace string) (client, server pod) {
	t.Helper()
	ps, err := pods(namespace, "")
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range ps {
		if got := p.Metadata.Annotations["ambient.istio.io/redirection"]; got != "enabled" {
			t.Errorf("%s: annotation ambient.istio.io/redirection = %q, want enabled (istio-cni did not enroll it)", p.Metadata.Name, got)
		}
		switch p.Metadata.Labels["app"] {
		case "client":
			client = p
		case "server":
			server = p
		}
	}
	for _, p := range []pod{client, server} {
		node := p.Spec.NodeName
		admin := forward(t, zt[node], 15000)
		eventually(t, p.Metadata.Name+" Up in the workloadState of "+program(zt[node])+" on "+node, time.Minute, func() error {
			return workloadUp(admin, p)
		})
	}
	// istioctl asks each node's ztunnel (by name: with two programs in the cluster it must
	// read both kinds of config dump).
	for _, node := range []string{client.Spec.NodeName, server.Spec.NodeName} {
		z := zt[node].Metadata.Name + ".istio-system"
		eventually(t, "istioctl ztunnel-config workloads "+z+" ("+program(zt[node])+") shows both HBONE", time.Minute, func() error {
			out, err := run("istioctl", "ztunnel-config", "workloads", z)
			if err != nil {
				return err
			}
			for _, p := range []pod{client, server} {
				re := regexp.MustCompile(`(?m)^` + namespace + `\s+` + regexp.QuoteMeta(p.Metadata.Name) + `\s.*\sHBONE\s*$`)
				if !re.MatchString(out) {
					return fmt.Errorf("no HBONE row for %s in:\n%s", p.Metadata.Name, out)
				}
			}
			return nil
		})
	}
	return client, server
}

// readConfigDump reads and decodes the /config_dump of the ztunnel whose admin port is at
// admin.
func readConfigDump(admin string) (configDump, error) {
	var d configDump
	body, err := get("http://" + admin + "/config_dump")
	if err != nil {
		return d, err
	}
	return d, json.Unmarshal([]byte(body), &d)
}

// workloadUp checks that the ztunnel whose admin port is at admin has p Up in its
// workloadState and its workload with protocol HBONE.
func workloadUp(admin string, p pod) error {
	d, err := readConfigDump(admin)
	if err != nil {
		return err
	}
	ws, ok := d.WorkloadState[p.Metadata.UID]
	if !ok || ws.State != "Up" || ws.Info.Name != p.Metadata.Name {
		return fmt.Errorf("workloadState[%s] = %+v (present %v)", p.Metadata.UID, ws, ok)
	}
	for _, w := range d.Workloads {
		if w.Name == p.Metadata.Name && w.Namespace == p.Metadata.Namespace {
			if w.Protocol != "HBONE" {
				return fmt.Errorf("workload %s protocol %q, want HBONE", w.Name, w.Protocol)
			}
			return nil
		}
	}
	return fmt.Errorf("workload %s/%s not in /config_dump workloads", p.Metadata.Namespace, p.Metadata.Name)
}

// program names what a ztunnel pod runs, from its image: "rust" for the Rust ztunnel's
// (RS_HUB/ztunnel:RS_TAG under make cluster-migrate, or any image not gozt's), "gozt" for gozt's.
func program(p pod) string {
	img := ""
	if len(p.Spec.Containers) > 0 {
		img = p.Spec.Containers[0].Image
	}
	if img == os.Getenv("RS_HUB")+"/ztunnel:"+os.Getenv("RS_TAG") || !strings.HasPrefix(img, "localhost/gozt/") {
		return "rust"
	}
	return "gozt"
}

// crossNode: the client echoes 1 MiB through the server's Service name (resolved by the
// client node's ztunnel DNS proxy); both ztunnels' istio_tcp metrics and access logs show the
// connection with both identities, over mutual TLS.
func crossNode(t *testing.T, zt map[string]pod, namespace string, client, server pod) {
	t.Helper()
	host := "server." + namespace + ".svc.cluster.local:8080"
	const n = 1 << 20
	eventually(t, "client on "+client.Spec.NodeName+" echoes 1 MiB through "+host, time.Minute, func() error {
		return echo(namespace, host, n)
	})
	src := "spiffe://cluster.local/ns/" + namespace + "/sa/client"
	dst := "spiffe://cluster.local/ns/" + namespace + "/sa/server"
	for _, c := range []struct{ node, reporter string }{{client.Spec.NodeName, "source"}, {server.Spec.NodeName, "destination"}} {
		stats := forward(t, zt[c.node], 15020)
		eventually(t, "istio_tcp metrics on "+c.node+" ("+program(zt[c.node])+", "+c.reporter+")", 30*time.Second, func() error {
			body, err := get("http://" + stats + "/metrics")
			if err != nil {
				return err
			}
			want := map[string]string{"reporter": c.reporter, "connection_security_policy": "mutual_tls",
				"source_principal": src, "destination_principal": dst}
			if v, k := metric(body, "istio_tcp_connections_opened_total", want); k == 0 || v < 1 {
				return fmt.Errorf("istio_tcp_connections_opened_total%v: %v in %d series", want, v, k)
			}
			if v, _ := metric(body, "istio_tcp_received_bytes_total", want); v < n {
				return fmt.Errorf("istio_tcp_received_bytes_total%v = %v, want >= %d", want, v, n)
			}
			if v, _ := metric(body, "istio_tcp_sent_bytes_total", want); v < n {
				return fmt.Errorf("istio_tcp_sent_bytes_total%v = %v, want >= %d", want, v, n)
			}
			return nil
		})
		if c.reporter == "source" {
			// istio-cni's in-pod rules send the client's DNS to the ztunnel's proxy (15053),
			// which answers the service's name from xDS.
			body, err := get("http://" + stats + "/metrics")
			if err != nil {
				t.Fatal(err)
			}
			if v, k := metric(body, "istio_dns_requests_total", nil); v < 1 {
				t.Errorf("istio_dns_requests_total on %s = %v (%d series): the client's DNS did not go through the ztunnel", c.node, v, k)
			} else {
				t.Logf("the DNS proxy of %s on %s answered %v requests", program(zt[c.node]), c.node, v)
			}
		}
		logs := must(t, "kubectl", "-n", "istio-system", "logs", zt[c.node].Metadata.Name)
		if !strings.Contains(logs, src) || !strings.Contains(logs, dst) {
			t.Errorf("ztunnel on %s (%s): no access log naming %s and %s", c.node, program(zt[c.node]), src, dst)
		}
	}
}

// addr is the echo server's Service address in namespace.
func addr(namespace string) string { return "server." + namespace + ".svc.cluster.local:8080" }

// fails and works: the client pod in namespace from echoes through the Service of to.
func fails(from, to string) func() error {
	return func() error {
		if err := echo(from, addr(to), 1000); err == nil {
			return fmt.Errorf("echo from %s succeeded", from)
		}
		return nil
	}
}

func works(from, to string) func() error {
	return func() error { return echo(from, addr(to), 1000) }
}

// policy: AuthorizationPolicy DENY and ALLOW, PeerAuthentication STRICT against a client
// outside the mesh, and a DENY applied while a connection is open, which closes it; for the
// client and server of apps in namespace ns (the parameter shadows the package's constant).
func policy(t *testing.T, ns string) {
	t.Helper()
	deny := `apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: deny-client, namespace: ` + ns + `}
spec:
  selector: {matchLabels: {app: server}}
  action: DENY
  rules: [{from: [{source: {principals: ["cluster.local/ns/` + ns + `/sa/client"]}}]}]
`
	allow := func(sa string) string {
		return `apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: allow, namespace: ` + ns + `}
spec:
  selector: {matchLabels: {app: server}}
  action: ALLOW
  rules: [{from: [{source: {principals: ["cluster.local/ns/` + ns + `/sa/` + sa + `"]}}]}]
`
	}
	apply(t, deny)
	eventually(t, "DENY of the client's identity enforced", time.Minute, fails(ns, ns))
	must(t, "kubectl", "-n", ns, "delete", "authorizationpolicy", "deny-client")
	eventually(t, "DENY removed: traffic again", time.Minute, works(ns, ns))
	apply(t, allow("nobody"))
	eventually(t, "ALLOW of another identity only: client refused", time.Minute, fails(ns, ns))
	apply(t, allow("client"))
	eventually(t, "ALLOW of the client's identity: traffic again", time.Minute, works(ns, ns))
	must(t, "kubectl", "-n", ns, "delete", "authorizationpolicy", "allow")

	// A pod outside the mesh: plaintext reaches the server until STRICT.
	plain := ns + "-plain"
	must(t, "kubectl", "delete", "namespace", plain, "--ignore-not-found", "--wait=true", "--timeout=3m") // a run before this one may have left it terminating
	t.Cleanup(func() { kubectl("delete", "namespace", plain, "--wait=false") })
	apply(t, `apiVersion: v1
kind: Namespace
metadata: {name: `+plain+`}
---
apiVersion: v1
kind: Pod
metadata: {name: client, namespace: `+plain+`}
spec:
  nodeSelector: {kubernetes.io/hostname: node1}
  terminationGracePeriodSeconds: 1
  containers: [{name: client, image: "localhost/gozt/app:v1", imagePullPolicy: Never, args: [pause]}]
`)
	must(t, "kubectl", "-n", plain, "wait", "--for=condition=Ready", "pod/client", "--timeout=2m")
	eventually(t, "plaintext from outside the mesh accepted (PERMISSIVE)", time.Minute, works(plain, ns))
	apply(t, `apiVersion: security.istio.io/v1
kind: PeerAuthentication
metadata: {name: strict, namespace: `+ns+`}
spec: {mtls: {mode: STRICT}}
`)
	eventually(t, "PeerAuthentication STRICT refuses plaintext", time.Minute, fails(plain, ns))
	if err := echo(ns, addr(ns), 1000); err != nil {
		t.Errorf("STRICT: mesh client refused too: %v", err)
	}
	must(t, "kubectl", "-n", ns, "delete", "peerauthentication", "strict")

	// A policy that denies an open connection closes it.
	cmd := exec.Command(tool("kubectl"), "-n", ns, "exec", "client", "--", "/app", "hold", addr(ns), "60s")
	cmd.Env = append(os.Environ(), "KUBECONFIG="+kubeconfig)
	var out testutil.SyncBuffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	eventually(t, "long-lived connection open", 30*time.Second, func() error {
		if strings.Contains(out.String(), "connected") {
			return nil
		}
		return fmt.Errorf("hold: %q", out.String())
	})
	// gozt closes it; the Rust ztunnel (make cluster-migrate) was seen to leave it open
	// (docs/MIGRATING.md), which is logged, not failed, when it serves the server's node.
	serverProgram := "gozt"
	if ps, err := pods(ns, "app=server"); err == nil && len(ps) == 1 {
		if zt, err := onePerNode("istio-system", "app=ztunnel", ps[0].Spec.NodeName); err == nil {
			serverProgram = program(zt[ps[0].Spec.NodeName])
		}
	}
	wait := 45 * time.Second
	if serverProgram == "rust" {
		wait = 10 * time.Second
	}
	applied := time.Now()
	apply(t, deny)
	select {
	case err := <-done:
		if err == nil || !strings.Contains(out.String(), "closed after") {
			t.Errorf("open connection under a new DENY: %v: %s", err, out.String())
		} else {
			t.Logf("open connection closed %.1fs after the DENY was applied (server's node: %s): %s", time.Since(applied).Seconds(), serverProgram, strings.TrimSpace(out.String()))
		}
	case <-time.After(wait):
		cmd.Process.Kill()
		if serverProgram == "rust" {
			t.Logf("DIFFERENCE: the Rust ztunnel serving the server's node left an open connection open %s after a DENY of its identity (new connections refused); gozt closes it", wait)
		} else {
			t.Errorf("open connection still open %s after a DENY of its identity: %s", wait, out.String())
		}
	}
	must(t, "kubectl", "-n", ns, "delete", "authorizationpolicy", "deny-client")
	eventually(t, "traffic again", time.Minute, works(ns, ns))
}

// gozt's process figures from its /metrics.
func procStats(t *testing.T, stats string) (fds, goroutines float64) {
	t.Helper()
	body, err := get("http://" + stats + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	fds, _ = metric(body, "process_open_fds", nil)
	goroutines, _ = metric(body, "go_goroutines", nil)
	return
}

// scale: the server deployment 1 -> 10 -> 1 on node2; each new pod enrolled and reachable
// by its pod IP over HBONE; the deleted pods gone from gozt's workloadState; fds and
// goroutines back where they were.
func scale(t *testing.T, zt2 pod) {
	admin, stats := forward(t, zt2, 15000), forward(t, zt2, 15020)
	fds0, gr0 := procStats(t, stats)
	must(t, "kubectl", "-n", ns, "scale", "deploy/server", "--replicas=10")
	must(t, "kubectl", "-n", ns, "rollout", "status", "deploy/server", "--timeout=3m")
	ps, err := pods(ns, "app=server")
	if err != nil {
		t.Fatal(err)
	}
	if len(ps) != 10 {
		t.Fatalf("%d server pods, want 10", len(ps))
	}
	uids := map[string]bool{}
	for _, p := range ps {
		uids[p.Metadata.UID] = true
		p := p
		eventually(t, "server pod "+p.Metadata.Name+" reachable at "+p.Status.PodIP, time.Minute, func() error {
			return echo(ns, p.Status.PodIP+":8080", 10000)
		})
	}
	eventually(t, "all 10 server pods Up in gozt's workloadState on node2", time.Minute, func() error {
		return upPods(admin, uids, 10)
	})
	fds1, gr1 := procStats(t, stats)
	must(t, "kubectl", "-n", ns, "scale", "deploy/server", "--replicas=1")
	eventually(t, "back to one server pod", 2*time.Minute, func() error {
		ps, err := pods(ns, "app=server")
		if err != nil {
			return err
		}
		if len(ps) != 1 {
			return fmt.Errorf("%d server pods", len(ps))
		}
		return nil
	})
	eventually(t, "deleted pods gone from gozt's workloadState", time.Minute, func() error {
		return upPods(admin, uids, 1)
	})
	eventually(t, "fds and goroutines back to before the scale-up", time.Minute, func() error {
		fds2, gr2 := procStats(t, stats)
		t.Logf("gozt on node2: fds %v -> %v (10 pods) -> %v; goroutines %v -> %v -> %v", fds0, fds1, fds2, gr0, gr1, gr2)
		if fds2 > fds0+2 || gr2 > gr0+5 {
			return fmt.Errorf("fds %v (before %v), goroutines %v (before %v)", fds2, fds0, gr2, gr0)
		}
		return nil
	})
	eventually(t, "service traffic after the scale-down", time.Minute, works(ns, ns))
}

// upPods checks that exactly want of the pods in uids are in workloadState, all Up.
func upPods(admin string, uids map[string]bool, want int) error {
	d, err := readConfigDump(admin)
	if err != nil {
		return err
	}
	n := 0
	for uid, ws := range d.WorkloadState {
		if !uids[uid] {
			continue
		}
		if ws.State != "Up" {
			return fmt.Errorf("%s (%s) is %s", ws.Info.Name, uid, ws.State)
		}
		n++
	}
	if n != want {
		return fmt.Errorf("%d of the server pods in workloadState, want %d", n, want)
	}
	return nil
}

// loop starts the app's request loop (a new connection every 50 ms through the service)
// in the client pod; the returned func ends it, waits for it and returns its output and error.
func loop(t *testing.T) func() (string, error) {
	cmd := exec.Command(tool("kubectl"), "-n", ns, "exec", "-i", "client", "--", "/app", "loop", addr(ns), "10000", "stdin")
	cmd.Env = append(os.Environ(), "KUBECONFIG="+kubeconfig)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	return func() (string, error) {
		stdin.Close()
		err := cmd.Wait()
		return strings.TrimSpace(out.String()), err
	}
}

func ztunnelPods(t *testing.T) map[string]pod {
	t.Helper()
	var zt map[string]pod
	eventually(t, "one Ready ztunnel per node", 3*time.Minute, func() error {
		ps, err := pods("istio-system", "app=ztunnel")
		if err != nil {
			return err
		}
		if len(ps) != 2 {
			return fmt.Errorf("%d ztunnel pods", len(ps))
		}
		zt, err = onePerNode("istio-system", "app=ztunnel", "node1", "node2")
		return err
	})
	return zt
}

// upgrade: helm upgrade of ztunnel to a new tag, a restart of istio-cni's agent, and the
// swap to deploy/charts/ztunnel, each under a request loop that must not lose one request;
// then a ztunnel pod deleted, and the time until new connections work again.
func upgrade(t *testing.T) {
	charts := os.Getenv("ISTIO_CHARTS")
	if charts == "" {
		t.Skip("no ISTIO_CHARTS (make cluster-check sets it)")
	}
	// under runs f with requests going on from 3 s before it to 5 s after it.
	under := func(what string, f func()) {
		t.Helper()
		stop := loop(t)
		time.Sleep(3 * time.Second)
		start := time.Now()
		f()
		t.Logf("%s: done in %.1fs", what, time.Since(start).Seconds())
		time.Sleep(5 * time.Second)
		out, err := stop()
		if err != nil {
			t.Errorf("%s: requests failed: %v: %s", what, err, out)
		} else {
			t.Logf("%s: no failed request (%s)", what, out)
		}
	}
	// Istio's chart with only hub and tag set, to the tag the pods do not run (v2 after
	// cluster-up; a run before this one may have left v2).
	old := ztunnelPods(t)
	next := "v2"
	if strings.HasSuffix(old["node1"].Spec.Containers[0].Image, ":v2") {
		next = "v1"
	}
	under("helm upgrade of Istio's ztunnel chart to tag "+next, func() {
		must(t, "helm", "upgrade", "ztunnel", charts+"/ztunnel", "-n", "istio-system", "--reset-values",
			"--set", "hub=localhost/gozt", "--set", "tag="+next, "--wait", "--timeout", "3m")
		must(t, "kubectl", "-n", "istio-system", "rollout", "status", "ds/ztunnel", "--timeout=3m")
	})
	cur := ztunnelPods(t)
	for n, p := range cur {
		if p.Spec.Containers[0].Image != "localhost/gozt/ztunnel:"+next {
			t.Errorf("ztunnel on %s runs %s after the upgrade", n, p.Spec.Containers[0].Image)
		}
		if p.Metadata.UID == old[n].Metadata.UID {
			t.Errorf("ztunnel on %s: the old pod still runs", n)
		}
	}
	under("istio-cni agent restart", func() {
		must(t, "kubectl", "-n", "istio-system", "rollout", "restart", "ds/istio-cni-node")
		must(t, "kubectl", "-n", "istio-system", "rollout", "status", "ds/istio-cni-node", "--timeout=3m")
	})
	// deploy/charts/ztunnel as the README's "Run on Kubernetes" says.
	under("helm upgrade to deploy/charts/ztunnel", func() {
		must(t, "helm", "upgrade", "ztunnel", filepath.Join(root, "deploy/charts/ztunnel"), "-n", "istio-system", "--reset-then-reuse-values", "--set", "image=localhost/gozt/ztunnel:v1", "--wait", "--timeout", "3m")
		must(t, "kubectl", "-n", "istio-system", "rollout", "status", "ds/ztunnel", "--timeout=3m")
	})
	cur = ztunnelPods(t)
	if img := cur["node1"].Spec.Containers[0].Image; img != "localhost/gozt/ztunnel:v1" {
		t.Errorf("after the swap to deploy/charts/ztunnel, ztunnel runs %s", img)
	}
	// and back to Istio's ztunnel as the README says: helm rollback to the revision before.
	under("helm rollback ztunnel (back to Istio's chart)", func() {
		must(t, "helm", "rollback", "ztunnel", "-n", "istio-system", "--wait", "--timeout", "3m")
		must(t, "kubectl", "-n", "istio-system", "rollout", "status", "ds/ztunnel", "--timeout=3m")
	})
	if out := must(t, "helm", "list", "-n", "istio-system", "-f", "^ztunnel$", "-o", "json"); !strings.Contains(out, `"chart":"ztunnel-1.0.0"`) {
		t.Errorf("after helm rollback the release is not Istio's chart (ztunnel-1.0.0): %s", out)
	}
	cur = ztunnelPods(t)
	// kubectl delete pod of node1's ztunnel: how long until new connections work again.
	start := time.Now()
	must(t, "kubectl", "-n", "istio-system", "delete", "pod", cur["node1"].Metadata.Name, "--wait=false")
	// docs/CLUSTER.md states 30 s (measured: about 2 s).
	eventually(t, "new connections after the ztunnel pod on node1 was deleted", 30*time.Second, works(ns, ns))
	t.Logf("ztunnel pod deleted: new connections worked again after %.1fs", time.Since(start).Seconds())
	ztunnelPods(t)
	ps, err := pods(ns, "")
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range ps {
		if p.Metadata.Annotations["ambient.istio.io/redirection"] != "enabled" {
			t.Errorf("%s left unenrolled", p.Metadata.Name)
		}
	}
}
