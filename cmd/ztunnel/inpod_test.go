//go:build linux

package main

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/gozt/gozt/inpod/inpodtest"
	"github.com/gozt/gozt/inpod/zdspb"
	"github.com/gozt/gozt/internal/cnirules"
	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/internal/netns"
	"github.com/gozt/gozt/internal/netns/netnstest"
	"github.com/gozt/gozt/internal/testutil"
)

// inPodRules installs istio-cni's in-pod rules in a pod's namespace, as its node agent does
// before it hands the pod to ztunnel.
func inPodRules(t *testing.T, pod *netnstest.NS) { installPodRules(t, pod, cnirules.InPod()) }

// installPodRules installs rules (each the arguments after `iptables -w`) and istio-cni's
// in-pod routes in pod.
func installPodRules(t *testing.T, pod *netnstest.NS, rules [][]string) {
	t.Helper()
	for _, rule := range rules {
		pod.MustExec(t, append([]string{"iptables", "-w"}, rule...)...)
	}
	for _, args := range cnirules.InPodRoutes() {
		pod.MustExec(t, append([]string{"ip"}, args...)...)
	}
}

// The in-pod topology's addresses (inPodTopology).
const (
	inPodA, inPodB = "10.31.1.2", "10.31.2.2" // pods default/client and default/server
	inPodNodeToA   = "10.31.1.1"              // the node's end of pod A's veth
	inPodVIP       = "10.96.0.12"             // the echo service
)

// inPodTopology builds two pods as network namespaces behind veth pairs from a node
// namespace that routes between them, each pod with istio-cni's in-pod rules, and writes
// dir/workloads.yaml (writeWorkloads) with both pods on node-a.
func inPodTopology(t *testing.T) (node, podA, podB *netnstest.NS, dir string) {
	t.Helper()
	return inPodTopologyWith(t, inPodRules)
}

// inPodTopologyWith is inPodTopology with the pods' rules installed by rules.
func inPodTopologyWith(t *testing.T, rules func(*testing.T, *netnstest.NS)) (node, podA, podB *netnstest.NS, dir string) {
	t.Helper()
	node = netnstest.New(t, "inpod-node")
	podA, podB = netnstest.New(t, "pod-a"), netnstest.New(t, "pod-b")
	netnstest.Link(t, podA, inPodA+"/24", node, inPodNodeToA+"/24")
	netnstest.Link(t, podB, inPodB+"/24", node, "10.31.2.1/24")
	podA.MustExec(t, "ip", "route", "add", "default", "via", inPodNodeToA)
	podB.MustExec(t, "ip", "route", "add", "default", "via", "10.31.2.1")
	node.MustExec(t, "sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward")
	rules(t, podA)
	rules(t, podB)

	dir = t.TempDir()
	writeInPodWorkloads(t, dir, inPodA, inPodB)
	return node, podA, podB, dir
}

// writeInPodWorkloads is writeWorkloads with both pods on node-a, the in-pod topology's one
// node.
func writeInPodWorkloads(t *testing.T, dir, clientIPs, serverIPs string) {
	t.Helper()
	writeWorkloads(t, dir, clientIPs, serverIPs, inPodVIP)
	file := filepath.Join(dir, "workloads.yaml")
	yaml, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(file, []byte(strings.ReplaceAll(string(yaml), "node: node-b", "node: node-a")), 0o644); err != nil {
		t.Fatal(err)
	}
}

// inPodEnv is the settings of a node of the in-pod topology: node-a, in-pod mode with the
// node agent on uds, the pods' listeners on their default ports.
func inPodEnv(uds, dir string) map[string]string {
	return map[string]string{
		"PROXY_MODE": "shared", "NODE_NAME": "node-a", "INPOD_UDS": uds,
		"LOCAL_XDS_PATH": filepath.Join(dir, "workloads.yaml"), "CA_DIR": filepath.Join(dir, "ca"),
		"OUTBOUND_ADDR": "[::]:15001", "INBOUND_PLAINTEXT_ADDR": "[::]:15006", "INBOUND_ADDR": "[::]:15008",
		"DNS_PROXY_ADDR": "localhost:15053",
	}
}

// openNS opens a handle on a named namespace, closed when the test ends.
func openNS(t *testing.T, ns *netnstest.NS) *netns.NetNS {
	t.Helper()
	h, err := netns.Open("/var/run/netns/" + ns.Name)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Close() })
	return h
}

// dialIn connects from inside ns.
func dialIn(ns *netnstest.NS, network, addr string) (net.Conn, error) {
	var c net.Conn
	err := ns.Do(func() (err error) {
		c, err = net.DialTimeout(network, addr, 5*time.Second)
		return err
	})
	return c, err
}

// TestNetnsInPodTPROXY runs the in-pod topology with the rules of the istio-cni releases
// that hand inbound TCP over with TPROXY (cnirules.InPodTPROXY): the pods' 15008 and 15006
// listeners are transparent, so pod A's connection reaches pod B over HBONE and plaintext
// from outside the mesh is captured on B's 15006, as with REDIRECT.
func TestNetnsInPodTPROXY(t *testing.T) {
	netnstest.Require(t, "iptables", "curl")
	leaktest.Check(t)
	http.DefaultClient.Transport = &http.Transport{DisableKeepAlives: true}
	node, nsA, nsB, dir := inPodTopologyWith(t, func(t *testing.T, pod *netnstest.NS) {
		installPodRules(t, pod, cnirules.InPodTPROXY())
	})
	server := startPodServer(t, nsB, inPodB, "8080", "8081")
	agent := inpodtest.NewAgent(t, inpodtest.SocketPath(t))
	n, _ := startNode(t, testConfig(t, inPodEnv(agent.Path, dir)))
	addClientServer(t, t, agent.Accept(), nsA, nsB)
	if code, body := waitReady(t, n, "ready\n"); code != 200 {
		t.Fatalf("readiness after the snapshot: %d %q", code, body)
	}
	metrics := func() string {
		_, body := get(t, "http://"+n.addrs["STATS_ADDR"].String()+"/metrics")
		return body
	}
	if out := strings.TrimSpace(nsA.MustExec(t, "curl", "-sS", "-m", "20", "--data-binary", "tproxy", "http://"+inPodB+":8080/sha256")); !strings.HasSuffix(out, " 6") {
		t.Errorf("pod A to pod B: server answered %q; want the SHA-256 and length of 6 bytes", out)
	}
	waitMetricFrom(t, metrics, "node", "istio_tcp_connections_closed_total", map[string]string{
		"reporter": "destination", "connection_security_policy": "mutual_tls",
		"source_principal": "spiffe://cluster.local/ns/default/sa/client", "destination_workload": "server",
	}, 1)
	checkPlaintextInbound(t, node, server, inPodB, metrics)
}

// TestNetnsInPod is in-pod mode end to end: two pods as network namespaces behind veth
// pairs from a node namespace, each with istio-cni's in-pod rules exactly, and one ztunnel
// (in this process, PROXY_MODE=shared) that a real SOCK_SEQPACKET node agent hands both
// pods' namespaces. Each pod gets its listeners inside its own namespace: pod A's curl is
// captured on A's 15001 and carried over HBONE from A's IP to B's 15008, plain TCP from
// outside the mesh is captured on B's 15006, a DNS query is redirected to A's 15053, and
// DelWorkload closes B's listeners only.
func TestNetnsInPod(t *testing.T) {
	netnstest.Require(t, "iptables", "curl")
	leaktest.Check(t)
	http.DefaultClient.Transport = &http.Transport{DisableKeepAlives: true}

	const (
		podA, podB = inPodA, inPodB
		nodeToA    = inPodNodeToA
		vip        = inPodVIP
	)
	node, nsA, nsB, dir := inPodTopology(t)
	server := startPodServer(t, nsB, podB, "8080", "8081")

	agent := inpodtest.NewAgent(t, inpodtest.SocketPath(t))
	n, _ := startNode(t, testConfig(t, inPodEnv(agent.Path, dir)))
	ready := "http://" + n.addrs["READINESS_ADDR"].String() + "/healthz/ready"
	if code, body := get(t, ready); code != 500 || !strings.Contains(body, "workload manager") {
		t.Errorf("readiness before the snapshot: %d %q; want 500 naming the workload manager", code, body)
	}
	// addPods replays both pods and the snapshot, as the agent does on each connection. The
	// namespace handles live as long as the whole test.
	top := t
	addPods := func(t *testing.T, c *inpodtest.AgentConn) { addClientServer(t, top, c, nsA, nsB) }
	c := agent.Accept()
	addPods(t, c)
	if code, body := waitReady(t, n, "ready\n"); code != 200 {
		t.Fatalf("readiness after the snapshot: %d %q", code, body)
	}

	metrics := func() string {
		_, body := get(t, "http://"+n.addrs["STATS_ADDR"].String()+"/metrics")
		return body
	}
	clientID := "spiffe://cluster.local/ns/default/sa/client"
	serverID := "spiffe://cluster.local/ns/default/sa/server"

	t.Run("pod to pod over HBONE", func(t *testing.T) {
		upload := filepath.Join(dir, "upload")
		f, err := os.Create(upload)
		if err != nil {
			t.Fatal(err)
		}
		h := sha256.New()
		const size = 4 << 20
		if _, err := io.CopyN(io.MultiWriter(f, h), &patternReader{}, size); err != nil {
			t.Fatal(err)
		}
		f.Close()
		out := strings.TrimSpace(nsA.MustExec(t, "curl", "-sS", "-m", "20", "--data-binary", "@"+upload, "http://"+podB+":8080/sha256"))
		if want := fmt.Sprintf("%x %d", h.Sum(nil), size); out != want {
			t.Errorf("upload through the mesh: server got %q; want %q", out, want)
		}
		// Pod B's proxy dialed the app from inside pod B (ENABLE_ORIG_SRC unset).
		if got := server.lastClient("8080"); got != podB {
			t.Errorf("server saw the request from %s; want pod B's own %s", got, podB)
		}
		// B's side names the peer by its certificate and the pod IP the connection came
		// from: outbound HBONE left from inside pod A.
		waitMetricFrom(t, metrics, "node", "istio_tcp_connections_closed_total", map[string]string{
			"reporter": "destination", "connection_security_policy": "mutual_tls", "response_flags": "-",
			"source_principal": clientID, "source_workload": "client", "destination_principal": serverID, "destination_workload": "server",
		}, 1)
		waitMetricFrom(t, metrics, "node", "istio_tcp_connections_closed_total", map[string]string{
			"reporter": "source", "connection_security_policy": "mutual_tls", "source_workload": "client", "destination_workload": "server",
		}, 1)
	})

	t.Run("pod to service VIP over HBONE", func(t *testing.T) { checkVIP(t, nsA, vip, metrics) })

	t.Run("idle keep-alive connection parks and resumes", func(t *testing.T) {
		// Both pods' copies park in the node's poller 100–300 ms after the last byte
		// (proxy/idle.go); each request after a pause must wake them.
		c, err := dialIn(nsA, "tcp", podB+":8080")
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		br := bufio.NewReader(c)
		for i := range 3 {
			if i > 0 {
				time.Sleep(600 * time.Millisecond)
				// The node runs in this process: no copy may be on a goroutine now.
				buf := make([]byte, 1<<20)
				if st := string(buf[:runtime.Stack(buf, true)]); strings.Contains(st, "proxy.(*streamCopy).run") {
					t.Errorf("after 600 ms idle a copy still holds a goroutine:\n%s", st)
				}
			}
			c.SetDeadline(time.Now().Add(10 * time.Second))
			const size = 200_000
			if _, err := fmt.Fprintf(c, "GET /bytes?n=%d HTTP/1.1\r\nHost: pod-b\r\n\r\n", size); err != nil {
				t.Fatal(err)
			}
			resp, err := http.ReadResponse(br, nil)
			if err != nil {
				t.Fatalf("request %d: %v", i, err)
			}
			got := sha256.New()
			n, err := io.Copy(got, resp.Body)
			resp.Body.Close()
			want := sha256.New()
			io.CopyN(want, &patternReader{}, size)
			if err != nil || n != size || !bytes.Equal(got.Sum(nil), want.Sum(nil)) {
				t.Fatalf("request %d after an idle pause: %d bytes, %v; want the %d-byte pattern", i, n, err, size)
			}
		}
	})

	t.Run("DNS redirected to the pod's DNS proxy", func(t *testing.T) {
		for _, network := range []string{"udp", "tcp"} {
			// To the node's address: the pod's rules send port 53 to its own 15053.
			conn, err := dialIn(nsA, network, nodeToA+":53")
			if err != nil {
				t.Fatal(err)
			}
			wantVIPAnswer(t, conn, network, vip, "")
		}
	})

	t.Run("plaintext from outside the mesh captured on 15006", func(t *testing.T) {
		checkPlaintextInbound(t, node, server, podB, metrics)
	})

	t.Run("deny policy", func(t *testing.T) {
		checkDenyPolicy(t, nsA, node, server, podB)
		waitMetricFrom(t, metrics, "node", "istio_tcp_connections_failed_total", map[string]string{
			"reporter": "destination", "response_flags": "DENY", "connection_security_policy": "mutual_tls", "source_principal": clientID,
		}, 1)
	})

	t.Run("resets carried as resets", func(t *testing.T) { checkResetsInPod(t, nsA, node, nsB, podB, "8083", "8081") })

	t.Run("workloadState in config_dump", func(t *testing.T) {
		_, body := get(t, "http://"+n.addrs["ADMIN_ADDR"].String()+"/config_dump")
		var dump struct {
			WorkloadState map[string]struct {
				State string
				Info  struct{ Name, Namespace, ServiceAccount string }
			}
		}
		if err := json.Unmarshal([]byte(body), &dump); err != nil {
			t.Fatal(err)
		}
		if got := dump.WorkloadState["uid-b"]; got.State != "Up" || got.Info.Name != "server" || got.Info.ServiceAccount != "server" || len(dump.WorkloadState) != 2 {
			t.Errorf("workloadState %+v; want uid-a and uid-b Up, uid-b the server", dump.WorkloadState)
		}
	})

	t.Run("node agent restart keeps live connections", func(t *testing.T) {
		// A keep-alive HTTP connection from pod A, captured and tunneled.
		conn, err := dialIn(nsA, "tcp", podB+":8080")
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		conn.SetDeadline(time.Now().Add(20 * time.Second))
		br := bufio.NewReader(conn)
		roundTrip := func(path string) error {
			if _, err := fmt.Fprintf(conn, "GET %s HTTP/1.1\r\nHost: server\r\n\r\n", path); err != nil {
				return err
			}
			resp, err := http.ReadResponse(br, nil)
			if err != nil {
				return err
			}
			defer resp.Body.Close()
			b, err := io.ReadAll(resp.Body)
			if err == nil && !strings.Contains(string(b), "GET "+path) {
				err = fmt.Errorf("response %q", b)
			}
			return err
		}
		if err := roundTrip("/before-restart"); err != nil {
			t.Fatal(err)
		}
		// The live connection shows under both pods in workloadState, as istioctl reads it.
		_, body := get(t, "http://"+n.addrs["ADMIN_ADDR"].String()+"/config_dump")
		type connInfo struct{ Src, OriginalDst, ActualDst, Protocol string }
		var dump struct {
			WorkloadState map[string]struct {
				Connections struct{ Inbound, Outbound []connInfo }
			}
		}
		if err := json.Unmarshal([]byte(body), &dump); err != nil {
			t.Fatal(err)
		}
		has := func(cs []connInfo, want func(connInfo) bool) bool { return slices.ContainsFunc(cs, want) }
		if out := dump.WorkloadState["uid-a"].Connections.Outbound; !has(out, func(c connInfo) bool {
			return c.OriginalDst == podB+":8080" && c.Protocol == "HBONE"
		}) {
			t.Errorf("pod A's outbound connections %+v; want one to %s:8080 over HBONE", out, podB)
		}
		if in := dump.WorkloadState["uid-b"].Connections.Inbound; !has(in, func(c connInfo) bool {
			return c.OriginalDst == podB+":8080" && c.ActualDst == podB+":8080" && c.Protocol == "HBONE"
		}) {
			t.Errorf("pod B's inbound connections %+v; want one to %s:8080 over HBONE", in, podB)
		}
		c.C.Close()
		agent.Close()
		testutil.Eventually(t, "not ready while the node agent is away", func() bool { code, _ := get(t, ready); return code == 500 })
		agent = inpodtest.NewAgent(top, agent.Path) // outlives the subtest
		c = agent.Accept()
		addPods(t, c) // the same netns again: no-op ACKs
		if code, body := waitReady(t, n, "ready\n"); code != 200 {
			t.Fatalf("readiness after the new snapshot: %d %q", code, body)
		}
		if err := roundTrip("/after-restart"); err != nil {
			t.Errorf("live connection after the agent restarted: %v", err)
		}
	})

	t.Run("DelWorkload closes only that pod's listeners", func(t *testing.T) {
		// The test holds a handle per addPods; ztunnel holds one, having closed the fd of the
		// repeated Add.
		const testHandles = 2
		if got := nsFDs(t, nsB); got != testHandles+1 {
			t.Errorf("%d fds of pod B's netns before Del; want %d", got, testHandles+1)
		}
		if nack := c.Send(inpodtest.DelReq("uid-b")); nack != "" {
			t.Fatalf("del: NACK %q", nack)
		}
		testutil.Eventually(t, "pod B's 15008 to stop accepting after DelWorkload", func() bool {
			conn, err := dialIn(node, "tcp", podB+":15008")
			if err != nil {
				return true
			}
			conn.Close()
			return false
		})
		conn, err := dialIn(node, "tcp", podA+":15008")
		if err != nil {
			t.Fatalf("pod A's 15008 after pod B's DelWorkload: %v", err)
		}
		conn.Close()
		// ztunnel closed its fd of pod B's namespace; the test's own handles remain.
		testutil.Eventually(t, "ztunnel to release pod B's netns", func() bool { return nsFDs(t, nsB) == testHandles })
		if _, err := plainGet(node, 0, podB+":8080", "/after-del"); err == nil {
			t.Error("plaintext to pod B still served after DelWorkload")
		}
	})
}

// nsFDs counts this process's fds that refer to ns.
func nsFDs(t *testing.T, ns *netnstest.NS) int {
	t.Helper()
	var st syscall.Stat_t
	if err := syscall.Stat("/var/run/netns/"+ns.Name, &st); err != nil {
		t.Fatal(err)
	}
	return idFDs(t, netns.ID{Dev: st.Dev, Ino: st.Ino})
}

// idFDs counts this process's fds that refer to the namespace id.
func idFDs(t testing.TB, id netns.ID) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, e := range ents {
		var fst syscall.Stat_t
		if syscall.Stat("/proc/self/fd/"+e.Name(), &fst) == nil && fst.Dev == id.Dev && fst.Ino == id.Ino {
			n++
		}
	}
	return n
}

// TestNetnsInPodStartFails: a pod whose port 15008 is taken by a socket without
// SO_REUSEPORT is NACKed with "failure to start proxy", shows Pending and keeps the node
// unready until the retry, 5 s later, succeeds once the port is free.
func TestNetnsInPodStartFails(t *testing.T) {
	netnstest.RequireRoot(t)
	leaktest.Check(t)
	http.DefaultClient.Transport = &http.Transport{DisableKeepAlives: true}
	pod := netnstest.NewAnonymous(t)
	blocker, err := (netns.Sockets{NS: pod}).Listen(context.Background(), "tcp", "[::]:15008")
	if err != nil {
		t.Fatal(err)
	}
	defer blocker.Close()

	agent := inpodtest.NewAgent(t, inpodtest.SocketPath(t))
	n, _ := startNode(t, testConfig(t, map[string]string{
		"PROXY_MODE": "shared", "INPOD_UDS": agent.Path,
		"OUTBOUND_ADDR": "[::]:15001", "INBOUND_PLAINTEXT_ADDR": "[::]:15006", "INBOUND_ADDR": "[::]:15008",
		"DNS_PROXY_ADDR": "localhost:15053",
	}))
	c := agent.Accept()
	info := &zdspb.WorkloadInfo{Name: "busy", Namespace: "default", ServiceAccount: "default"}
	if nack := c.AddPod("uid-busy", info, pod); !strings.HasPrefix(nack, "failure to start proxy : ") || !strings.Contains(nack, "15008") {
		t.Fatalf("add with 15008 taken: %q; want a start failure naming the port", nack)
	}
	if nack := c.Send(inpodtest.SnapshotReq()); nack != "" {
		t.Fatalf("snapshot: NACK %q", nack)
	}
	if code, body := waitReady(t, n, "failed to start"); code != 500 {
		t.Errorf("readiness with a pending pod: %d %q; want 500 saying a proxy failed to start", code, body)
	}
	if st := n.inpod.WorkloadState()["uid-busy"]; st.State != "Pending" {
		t.Errorf("workloadState %+v; want Pending", st)
	}
	blocker.Close()
	if code, body := waitReady(t, n, "ready\n"); code != 200 {
		t.Errorf("readiness after the port was freed: %d %q; want ready after the retry", code, body)
	}
}

// addClientServer sends the agent's messages for pod A (default/client, uid-a, in nsA) and pod B
// (default/server, uid-b, in nsB), then the snapshot, over c, failing t on a NACK; the pods'
// namespace handles live as long as top.
func addClientServer(t, top *testing.T, c *inpodtest.AgentConn, nsA, nsB *netnstest.NS) {
	t.Helper()
	for _, p := range []struct {
		uid  string
		info *zdspb.WorkloadInfo
		ns   *netnstest.NS
	}{
		{"uid-a", &zdspb.WorkloadInfo{Name: "client", Namespace: "default", ServiceAccount: "client"}, nsA},
		{"uid-b", &zdspb.WorkloadInfo{Name: "server", Namespace: "default", ServiceAccount: "server"}, nsB},
	} {
		if nack := c.AddPod(p.uid, p.info, openNS(top, p.ns)); nack != "" {
			t.Fatalf("add %s: NACK %q", p.uid, nack)
		}
	}
	if nack := c.Send(inpodtest.SnapshotReq()); nack != "" {
		t.Fatalf("snapshot: NACK %q", nack)
	}
}

// wantVIPAnswer asks conn (network "udp" or "tcp") for echo.default.svc.cluster.local's A
// record, closes conn, and fails t unless the one answer is vip; how names the path in errors.
func wantVIPAnswer(t *testing.T, conn net.Conn, network, vip, how string) {
	t.Helper()
	req := new(dns.Msg)
	req.SetQuestion("echo.default.svc.cluster.local.", dns.TypeA)
	resp, _, err := (&dns.Client{Net: network, Timeout: 5 * time.Second}).ExchangeWithConn(req, &dns.Conn{Conn: conn})
	conn.Close()
	if err != nil {
		t.Fatalf("%s query%s: %v", network, how, err)
	}
	if len(resp.Answer) != 1 || !strings.HasSuffix(resp.Answer[0].String(), vip) {
		t.Errorf("%s answer%s %v; want the service VIP %s", network, how, resp.Answer, vip)
	}
}
