package bench

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/gozt/gozt/internal/child"
)

// A path is one way from the client to the echo server, with the processes that make it.
type path struct {
	name     string
	target   Target
	procs    []Proc
	children []*child.Process // processes the suite started for this path; their exit ends it
	// baselines are the paths the report compares this one with; nil: the defaults.
	baselines []string
	// rust is the Rust ztunnel's path of the same shape, which the report shows this one's
	// figures as a ratio to ("× ztunnel-rs"); "" for none.
	rust string
	// adminDial reaches the first proxy's admin listeners (capture only: they are in its
	// node's namespace, not the client pod's).
	adminDial func(ctx context.Context, network, addr string) (net.Conn, error)
}

// dead returns an error describing the first of the path's processes that has exited.
func (p *path) dead() error {
	for _, c := range p.children {
		if c.Exited() {
			return fmt.Errorf("%s exited (%v); its log ends:\n%s", c.Name, c.Err(), c.Tail(10))
		}
	}
	return nil
}

// childGrace is how long a child has to exit after SIGTERM before it is killed.
const childGrace = 3 * time.Second

// startChild starts bin with args and extra environment, output to logPath, in a process
// group of its own so that stopping it also stops anything it started.
func startChild(name, logPath string, env []string, dir, bin string, args ...string) (*child.Process, error) {
	c, err := child.Start(child.Spec{Name: name, Args: append([]string{bin}, args...), Env: append(os.Environ(), env...), Dir: dir, Log: logPath, Group: true})
	if err != nil {
		return nil, fmt.Errorf("bench: %w", err)
	}
	return c, nil
}

// stopper is c's Stop, for an undo list.
func stopper(c *child.Process) func() { return func() { c.Stop(childGrace) } }

// stopAll stops children in the reverse of their start order.
func stopAll(children []*child.Process) {
	for i := len(children) - 1; i >= 0; i-- {
		children[i].Stop(childGrace)
	}
}

// findRepo returns the nearest directory at or above the working directory whose go.mod
// declares this module.
func findRepo() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", fmt.Errorf("bench: %w", err)
	}
	for {
		b, err := os.ReadFile(filepath.Join(dir, "go.mod"))
		if err == nil && bytes.Contains(b, []byte("module github.com/gozt/gozt\n")) {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("bench: not inside the gozt repository (set the repository root)")
		}
		dir = parent
	}
}

// ztunnelNode is one node's fixed addresses and identity in the two-node topology.
type ztunnelNode struct {
	name, ip, workload string
	socks5             bool
}

var ztunnelNodes = []ztunnelNode{
	{name: "ztunnel-a", ip: "127.0.0.2", workload: "default/client/client", socks5: true},
	{name: "ztunnel-b", ip: "127.0.0.3", workload: "default/server/server"},
}

// A ztunnelPair is one two-node ztunnel path: its nodes, the topology they load (the
// example file, with their addresses when they differ), and KERNEL_TLS.
type ztunnelPair struct {
	name      string
	nodes     []ztunnelNode
	kernelTLS bool
}

// The ztunnel path keeps TLS in user space, so that the kernel TLS path, on its own
// addresses (the topology's workloads moved there), compares with it in the same run.
var (
	userTLSPair   = ztunnelPair{name: "ztunnel", nodes: ztunnelNodes}
	kernelTLSPair = ztunnelPair{name: "ztunnel-ktls", kernelTLS: true, nodes: []ztunnelNode{
		{name: "ztunnel-ktls-a", ip: "127.0.0.4", workload: "default/client/client", socks5: true},
		{name: "ztunnel-ktls-b", ip: "127.0.0.5", workload: "default/server/server"},
	}}
)

// topology writes the pair's topology into work (the example's, addresses replaced) and
// returns its path.
func (zp ztunnelPair) topology(repo, work string) (string, error) {
	src := filepath.Join(repo, "examples", "two-nodes.yaml")
	if zp.nodes[0].ip == ztunnelNodes[0].ip {
		return src, nil
	}
	b, err := os.ReadFile(src)
	if err != nil {
		return "", err
	}
	r := strings.NewReplacer(ztunnelNodes[0].ip, zp.nodes[0].ip, ztunnelNodes[1].ip, zp.nodes[1].ip)
	dst := filepath.Join(work, zp.name+"-two-nodes.yaml")
	return dst, os.WriteFile(dst, []byte(r.Replace(string(b))), 0o644)
}

// echoAddr is echo's address moved to the pair's server node.
func (zp ztunnelPair) echoAddr(echo string) string {
	_, port, _ := net.SplitHostPort(echo)
	return net.JoinHostPort(zp.nodes[1].ip, port)
}

// ztunnelPorts maps each listener's variable to its port; every node uses its own IP.
var ztunnelPorts = []struct{ env, port string }{
	{"ADMIN_ADDR", "15000"}, {"STATS_ADDR", "15020"}, {"READINESS_ADDR", "15021"},
	{"OUTBOUND_ADDR", "15001"}, {"INBOUND_PLAINTEXT_ADDR", "15006"}, {"INBOUND_ADDR", "15008"},
	{"DNS_PROXY_ADDR", "15053"},
}

// addrs returns the TCP addresses the node listens on.
func (n ztunnelNode) addrs() []string {
	var a []string
	for _, p := range ztunnelPorts {
		a = append(a, n.ip+":"+p.port)
	}
	if n.socks5 {
		a = append(a, n.ip+":15080")
	}
	return a
}

// waitPortsFree waits up to 15 s for every address to be free: the nodes' addresses are
// fixed, and another ztunnel on this machine (a test, an earlier run still draining) may
// hold them for a while.
func waitPortsFree(ctx context.Context, addrs []string) error {
	deadline := time.Now().Add(15 * time.Second)
	for _, a := range addrs {
		for {
			ln, err := net.Listen("tcp", a)
			if err == nil {
				ln.Close()
				break
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("bench: %s stays in use (another ztunnel on this machine?): %w", a, err)
			}
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(200 * time.Millisecond):
			}
		}
	}
	return nil
}

func (n ztunnelNode) env(zp ztunnelPair, topology, work string) []string {
	env := []string{
		"PROXY_MODE=dedicated",
		"PROXY_WORKLOAD_INFO=" + n.workload,
		"LOCAL_XDS_PATH=" + topology,
		"CA_PROVIDER=builtin",
		"CA_DIR=" + filepath.Join(work, "ca"),
		"XDS_ADDRESS=",
		"KERNEL_TLS=" + strconv.FormatBool(zp.kernelTLS),
	}
	for _, p := range ztunnelPorts {
		env = append(env, p.env+"="+n.ip+":"+p.port)
	}
	if n.socks5 {
		env = append(env, "SOCKS5_ADDR="+n.ip+":15080")
	}
	return env
}

// buildZtunnel builds the ztunnel binary into work and returns its path.
func buildZtunnel(ctx context.Context, repo, work string) (string, error) {
	bin := filepath.Join(work, "ztunnel")
	if err := child.BuildZtunnel(ctx, repo, bin, false); err != nil {
		return "", fmt.Errorf("bench: %w", err)
	}
	return bin, nil
}

// startZtunnel starts the two ztunnel nodes of binary bin, one after the other so that the
// first creates the shared built-in CA, and waits until both are ready. The client reaches
// the echo server through node A's SOCKS5 listener, HBONE to node B, and node B's inbound.
func startZtunnel(ctx context.Context, zp ztunnelPair, repo, bin, work, echoAddr string, track func(*child.Process)) (*path, error) {
	p := &path{name: zp.name, target: Target{Addr: echoAddr, SOCKS5: zp.nodes[0].ip + ":15080"}}
	topology, err := zp.topology(repo, work)
	if err != nil {
		return nil, err
	}
	for _, n := range zp.nodes {
		if err := waitPortsFree(ctx, n.addrs()); err != nil {
			return nil, err
		}
	}
	for _, n := range zp.nodes {
		c, err := startChild(n.name, filepath.Join(work, n.name+".log"), n.env(zp, topology, work), repo, bin)
		if err != nil {
			return nil, err
		}
		track(c)
		p.children = append(p.children, c)
		if err := waitReady(ctx, c, "http://"+n.ip+":15021/healthz/ready", nil); err != nil {
			return nil, err
		}
		p.procs = append(p.procs, Proc{Name: n.name, PID: c.Pid()})
	}
	return p, nil
}

// waitReady polls url until it answers 200, the process exits, or 30 s pass. dial, when
// not nil, opens the connections (from inside the node's network namespace).
func waitReady(ctx context.Context, c *child.Process, url string, dial func(context.Context, string, string) (net.Conn, error)) error {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	client := &http.Client{Timeout: time.Second}
	if dial != nil {
		client.Transport = &http.Transport{DialContext: dial, DisableKeepAlives: true}
	}
	if err := c.WaitReady(ctx, 100*time.Millisecond, child.HTTPReady(client, url)); err != nil {
		return fmt.Errorf("bench: %w", err)
	}
	return nil
}

// peers runs peers.sh: "up" starts its chains in front of the echo server; stop runs "down".
type peers struct {
	script, state string
}

// up starts the chains and returns one path per chain that came up. The chains' processes
// are read from the script's pid file: "PID NAME-s" and "PID NAME-c" lines per chain.
func (pr *peers) up(ctx context.Context, echoAddr string, log io.Writer) ([]*path, error) {
	cmd := exec.CommandContext(ctx, "bash", pr.script, "up", echoAddr, pr.state)
	cmd.Stderr = log
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("bench: %s up: %w", pr.script, err)
	}
	chains := make(map[string][]Proc)
	if b, err := os.ReadFile(filepath.Join(pr.state, "pids")); err == nil {
		for line := range strings.SplitSeq(string(b), "\n") {
			f := strings.Fields(line)
			if len(f) != 2 {
				continue
			}
			pid, err := strconv.Atoi(f[0])
			if err != nil {
				continue
			}
			chain := strings.TrimSuffix(strings.TrimSuffix(f[1], "-s"), "-c")
			chains[chain] = append(chains[chain], Proc{Name: f[1], PID: pid})
		}
	}
	var paths []*path
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) != 2 || !strings.Contains(f[1], ":") {
			continue
		}
		paths = append(paths, &path{name: f[0], target: Target{Addr: f[1]}, procs: chains[f[0]]})
	}
	return paths, nil
}

// down stops what up started. It runs even after the suite's context is cancelled.
func (pr *peers) down(log io.Writer) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, "bash", pr.script, "down", pr.state)
	cmd.Stdout, cmd.Stderr = log, log
	cmd.Run()
}

// kernelTLSCount says how node A of the kernel TLS path (SOCKS5 on socks) carried its
// HBONE connections, from its hbone_kernel_tls_connections_total: "kernel" for every
// one, or it was not the path it claims to be.
func kernelTLSCount(ctx context.Context, socks string) string {
	host, _, _ := net.SplitHostPort(socks)
	req, err := http.NewRequestWithContext(ctx, "GET", "http://"+net.JoinHostPort(host, "15020")+"/metrics", nil)
	if err != nil {
		return "ztunnel-ktls: " + err.Error()
	}
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		return "ztunnel-ktls: metrics: " + err.Error()
	}
	defer res.Body.Close()
	var counts []string
	sc := bufio.NewScanner(res.Body)
	for sc.Scan() {
		if l := sc.Text(); strings.HasPrefix(l, "hbone_kernel_tls_connections_total{") {
			counts = append(counts, strings.TrimPrefix(l, "hbone_kernel_tls_connections_total"))
		}
	}
	if len(counts) == 0 {
		return "ztunnel-ktls: node A counted no HBONE connections"
	}
	return "ztunnel-ktls: node A's HBONE connections by where TLS ran: " + strings.Join(counts, ", ")
}
