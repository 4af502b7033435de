package bench

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"time"

	"github.com/gozt/gozt/inpod/zdsagent"
	"github.com/gozt/gozt/internal/cnirules"
)

// The capture topology is the production path, in-pod mode: two pods as network namespaces
// joined by a veth pair, each with istio-cni's in-pod rules (internal/cnirules.InPod), and
// two nodes, each a ztunnel in PROXY_MODE=shared in a namespace of its own (loopback only:
// its admin listeners) that a node agent of the suite's (inpod/zdsagent) hands its pod's
// netns over ZDS. Each ztunnel opens its pod's listeners inside the pod and dials from
// there. The client dials the server pod's IP from inside pod A; the rules hand the
// connection to ztunnel A's outbound listener (15001 in pod A), which carries it over HBONE
// across the veth to ztunnel B's 15008 in pod B and on to the echo server on the pod IP. The
// "veth" baseline is the same client dialing the same server on a port both pods exclude
// (one ACCEPT rule ahead of istio-cni's, as the exclude-ports annotations do): the veth's
// own cost, which differs from loopback's, without capture.
const (
	capClientIP     = "10.10.0.1" // pod A, node A; these addresses exist only inside the namespaces
	capServerIP     = "10.10.0.2" // pod B, node B
	capServerPort   = "8080"
	capExcludedPort = "9999" // not redirected in either pod: the veth baseline
	capMark         = "1337" // ztunnel's PACKET_MARK (0x539): its own sockets skip redirection
)

// captureMissing says why the capture path cannot run here, or "" when it can.
func captureMissing() string {
	if runtime.GOOS != "linux" {
		return "network namespaces need Linux"
	}
	if os.Geteuid() != 0 {
		return "needs root to create network namespaces (run zbench suite as root)"
	}
	for _, tool := range []string{"ip", "iptables"} {
		if _, err := exec.LookPath(tool); err != nil {
			return tool + " is not installed (apt-get install -y iproute2 iptables)"
		}
	}
	return ""
}

// captureNamespaces returns the names of the namespaces of this process's capture
// topology for program pg: the two pods', then the two nodes'.
func captureNamespaces(pg program) []string {
	var names []string
	for _, n := range []string{"a", "b", "node-a", "node-b"} {
		if pg.rust {
			n = "rs-" + n
		}
		names = append(names, fmt.Sprintf("gozt-bench-%s-%d", n, os.Getpid()))
	}
	return names
}

// captureName is the name of pg's capture path.
func captureName(pg program) string {
	if pg.rust {
		return "capture-rs"
	}
	return "capture"
}

// startCapture builds the capture topology around program pg's nodes and returns the veth
// and capture paths. Each thing it makes gets its undo step as soon as it exists: on success
// they run when the suite ends, on failure (Ctrl-C included) before startCapture returns, so
// nothing is left behind either way.
func (s *suite) startCapture(ctx context.Context, pg program) (veth, capture *path, err error) {
	var undo []func()
	defer func() { s.settle(undo, err) }()
	names := captureNamespaces(pg)
	nsA, nsB := names[0], names[1]
	if err := makeNamespaces(&undo, names...); err != nil {
		return nil, nil, err
	}
	vethA, vethB := vethNames("b", pg)
	if err := joinVeth(nsA, nsB, vethA, vethB, capClientIP, capServerIP); err != nil {
		return nil, nil, err
	}
	for _, ns := range []string{nsA, nsB} {
		if err := inPodRules(ns); err != nil {
			return nil, nil, err
		}
	}

	dialA, err := NewNetnsDialer(nsA)
	if err != nil {
		return nil, nil, err
	}
	undo = append(undo, func() { dialA.Close() })
	inB, err := NewNetnsDialer(nsB)
	if err != nil {
		return nil, nil, err
	}
	undo = append(undo, func() { inB.Close() })
	// The echo servers' listeners are made inside pod B and served from here.
	for _, port := range []string{capServerPort, capExcludedPort} {
		ln, err := inB.Listen("tcp", net.JoinHostPort(capServerIP, port))
		if err != nil {
			return nil, nil, fmt.Errorf("bench: listen in %s: %w", nsB, err)
		}
		echo, err := Serve(ln, ServerConfig{Mode: ModeEcho})
		if err != nil {
			return nil, nil, err
		}
		undo = append(undo, func() { echo.Close() })
	}

	ca, err := s.meshCA()
	if err != nil {
		return nil, nil, err
	}
	name := captureName(pg)
	dir := filepath.Join(s.work, name)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, nil, fmt.Errorf("bench: %w", err)
	}
	workloads := filepath.Join(dir, "workloads.yaml")
	if err := os.WriteFile(workloads, []byte(localWorkloads(capClientIP, capServerIP)), 0o644); err != nil {
		return nil, nil, fmt.Errorf("bench: %w", err)
	}
	capture = &path{name: name, target: Target{Addr: net.JoinHostPort(capServerIP, capServerPort), DialContext: dialA.DialContext}, baselines: []string{"veth"}}
	if !pg.rust {
		capture.rust = captureName(program{rust: true})
	}
	prefix := "ztunnel-cap-"
	if pg.rust {
		prefix = "ztunnel-rs-cap-"
	}
	for _, n := range []struct {
		name, node, nodeNS string
		pod                zdsagent.Pod
	}{
		{prefix + "a", "node-a", names[2], zdsagent.Pod{UID: "uid-client", Name: "client", Namespace: "default", ServiceAccount: "client", NetNS: "/var/run/netns/" + nsA}},
		{prefix + "b", "node-b", names[3], zdsagent.Pod{UID: "uid-server", Name: "server", Namespace: "default", ServiceAccount: "server", NetNS: "/var/run/netns/" + nsB}},
	} {
		agent, err := zdsagent.Listen(filepath.Join(dir, n.node+".sock"), n.pod)
		if err != nil {
			return nil, nil, err
		}
		replayed := make(chan error, 1)
		served := make(chan struct{})
		go func() {
			defer close(served)
			agent.Serve(func(_ int, err error) {
				select {
				case replayed <- err:
				default: // a reconnect's replay; the node's logs tell
				}
			})
		}()
		undo = append(undo, func() { agent.Close(); <-served })
		admin, err := NewNetnsDialer(n.nodeNS)
		if err != nil {
			return nil, nil, err
		}
		undo = append(undo, func() { admin.Close() })
		if err := ca.serveIn(admin); err != nil {
			return nil, nil, err
		}
		env := pg.sharedEnv(n.node, agent.Path, workloads, ca.ca, capMark)
		// ip netns exec execs the binary, so the child's pid is ztunnel's own and /proc
		// accounting charges the right process.
		c, err := startChild(n.name, filepath.Join(s.work, n.name+".log"), env, dir, "ip", "netns", "exec", n.nodeNS, pg.bin)
		if err != nil {
			return nil, nil, err
		}
		undo = append(undo, stopper(c))
		capture.children = append(capture.children, c)
		if capture.adminDial == nil {
			capture.adminDial = admin.DialContext
		}
		select {
		case err = <-replayed:
		case <-c.Done():
			err = fmt.Errorf("%s exited (%v); its log ends:\n%s", c.Name, c.Err(), c.Tail(10))
		case <-time.After(30 * time.Second):
			err = errors.New("no ZDS connection in 30s")
		case <-ctx.Done():
			err = ctx.Err()
		}
		if err != nil {
			return nil, nil, fmt.Errorf("bench: %s: %w", n.name, err)
		}
		if err := waitReady(ctx, c, "http://127.0.0.1:15021/healthz/ready", admin.DialContext); err != nil {
			return nil, nil, err
		}
		capture.procs = append(capture.procs, Proc{Name: n.name, PID: c.Pid()})
	}
	veth = &path{name: "veth", target: Target{Addr: net.JoinHostPort(capServerIP, capExcludedPort), DialContext: dialA.DialContext}, baselines: []string{"direct"}}
	return veth, capture, nil
}

// checkCaptured returns an error unless ztunnel A (its admin listeners reached through dial,
// from inside node A) has counted an outbound mTLS connection: the probe's, proof that
// iptables handed it over. Without that the "capture" figures would be of some other path.
func checkCaptured(ctx context.Context, dial func(context.Context, string, string) (net.Conn, error)) error {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	client := &http.Client{Transport: &http.Transport{DialContext: dial, DisableKeepAlives: true}}
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://127.0.0.1:15020/metrics", nil)
	resp, err := client.Do(req)
	if err != nil {
		return fmt.Errorf("bench: node A metrics: %w", err)
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, "istio_tcp_connections_opened_total{") &&
			strings.Contains(line, `reporter="source"`) && strings.Contains(line, `connection_security_policy="mutual_tls"`) &&
			!strings.HasSuffix(line, " 0") {
			return nil
		}
	}
	return errors.New("node A counted no outbound mTLS connection: iptables did not capture the client")
}

// inPodRules installs, inside namespace ns, istio-cni's in-pod rules and policy routing
// (cnirules.InPod, InPodRoutes), IPv4 only, with the veth baseline's port excluded both ways
// by an ACCEPT ahead of them.
func inPodRules(ns string) error {
	rules := cnirules.InPod()
	for _, chain := range []string{"ISTIO_PRERT", "ISTIO_OUTPUT"} {
		rules = append(rules, []string{"-t", "nat", "-I", chain, "1", "-p", "tcp", "--dport", capExcludedPort, "-j", "ACCEPT"})
	}
	for _, rule := range rules {
		if err := ipRun(append([]string{"ip", "netns", "exec", ns, "iptables", "-w"}, rule...)...); err != nil {
			return err
		}
	}
	for _, args := range cnirules.InPodRoutes() {
		if err := ipRun(append([]string{"ip", "-n", ns}, args...)...); err != nil {
			return err
		}
	}
	return nil
}

// settle runs a topology's undo steps, in reverse order, now when building it failed (err
// not nil), or when the suite ends.
func (s *suite) settle(undo []func(), err error) {
	all := func() {
		for i := len(undo) - 1; i >= 0; i-- {
			undo[i]()
		}
	}
	if err != nil {
		all()
	} else {
		s.onEnd(all)
	}
}

// makeNamespaces creates network namespaces, each with its loopback up, adding each one's
// removal to undo as soon as it exists.
func makeNamespaces(undo *[]func(), names ...string) error {
	for _, ns := range names {
		if err := ipRun("ip", "netns", "add", ns); err != nil {
			return err
		}
		*undo = append(*undo, func() { exec.Command("ip", "netns", "del", ns).Run() })
		if err := ipRun("ip", "-n", ns, "link", "set", "lo", "up"); err != nil {
			return err
		}
	}
	return nil
}

// vethNames returns the two ends' names of a veth pair of kind (one or two letters) for program pg,
// unique to this process; at most 15 characters for any pid.
func vethNames(kind string, pg program) (a, b string) {
	base := fmt.Sprintf("gz%s%d", kind, os.Getpid())
	if pg.rust {
		base += "r"
	}
	return base + "a", base + "b"
}

// joinVeth links namespaces nsA and nsB by a veth pair, vethA with ipA/24 in nsA and vethB
// with ipB/24 in nsB. It is made inside nsA with its peer inside nsB, so it never exists in
// this machine's own namespace, and goes when they do.
func joinVeth(nsA, nsB, vethA, vethB, ipA, ipB string) error {
	for _, args := range [][]string{
		{"ip", "-n", nsA, "link", "add", vethA, "type", "veth", "peer", "name", vethB, "netns", nsB},
		{"ip", "-n", nsA, "addr", "add", ipA + "/24", "dev", vethA},
		{"ip", "-n", nsB, "addr", "add", ipB + "/24", "dev", vethB},
		{"ip", "-n", nsA, "link", "set", vethA, "up"},
		{"ip", "-n", nsB, "link", "set", vethB, "up"},
	} {
		if err := ipRun(args...); err != nil {
			return err
		}
	}
	return nil
}

// ipRun runs a setup command, returning its output with the error.
func ipRun(args ...string) error {
	if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
		return fmt.Errorf("bench: %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}
