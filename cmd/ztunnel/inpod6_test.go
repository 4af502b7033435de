//go:build linux

package main

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/gozt/gozt/inpod/inpodtest"
	"github.com/gozt/gozt/inpod/zdspb"
	"github.com/gozt/gozt/internal/cnirules"
	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/internal/netns/netnstest"
)

// The in-pod topology's IPv6 addresses, beside its IPv4 ones (inPodTopology6).
const (
	inPodA6, inPodB6 = "fd00:31:1::2", "fd00:31:2::2"
	inPodNodeToA6    = "fd00:31:1::1"
	inPodNodeToB6    = "fd00:31:2::1"
)

// inPodTopology6 is inPodTopology with dual-stack pods: each veth pair also carries an IPv6
// /64, the node forwards IPv6 too, each pod gets istio-cni's rules for both families (v4
// and v6, each the arguments after iptables and ip6tables) and both families' routes, and
// the workloads carry both addresses.
func inPodTopology6(t *testing.T, v4, v6 [][]string) (node, podA, podB *netnstest.NS, dir string) {
	t.Helper()
	node, podA, podB, dir = inPodTopologyWith(t, func(t *testing.T, pod *netnstest.NS) { installPodRules(t, pod, v4) })
	for _, l := range []struct {
		pod          *netnstest.NS
		pod4, pod6   string
		node4, node6 string
	}{{podA, inPodA, inPodA6, inPodNodeToA, inPodNodeToA6}, {podB, inPodB, inPodB6, "10.31.2.1", inPodNodeToB6}} {
		l.pod.AddAddrBeside(t, l.pod4, l.pod6+"/64")
		node.AddAddrBeside(t, l.node4, l.node6+"/64")
		l.pod.MustExec(t, "ip", "-6", "route", "add", "default", "via", l.node6)
		for _, rule := range v6 {
			l.pod.MustExec(t, append([]string{"ip6tables", "-w"}, rule...)...)
		}
		for _, args := range cnirules.InPodRoutes6() {
			l.pod.MustExec(t, append([]string{"ip"}, args...)...)
		}
	}
	node.MustExec(t, "sh", "-c", "echo 1 > /proc/sys/net/ipv6/conf/all/forwarding")
	for _, ns := range []*netnstest.NS{podA, node, podB} {
		ns.WaitDAD(t)
	}
	writeInPodWorkloads(t, dir, inPodA+","+inPodA6, inPodB+","+inPodB6)
	return node, podA, podB, dir
}

// TestNetnsInPodIPv6 is in-pod mode over IPv6 with dual-stack pods, for each shape of
// istio-cni's rules (REDIRECT in nat, istio 1.24 and later; TPROXY in mangle, 1.22 and
// 1.23), both installed for both families as istio-cni does in a dual-stack cluster: pod A's
// connection to pod B's IPv6 address is captured on A's [::]:15001 (its original
// destination read with IP6T_SO_ORIGINAL_DST), carried over HBONE from A's IPv6 address to
// B's 15008 and delivered inside B from B's IPv6 address; plaintext over IPv6 from outside
// the mesh is captured on B's 15006; DNS to an IPv6 server is answered by A's DNS proxy on
// [::1]:15053; IPv4 still flows beside it.
func TestNetnsInPodIPv6(t *testing.T) {
	netnstest.Require(t, "iptables", "ip6tables", "curl")
	for _, shape := range []struct {
		name    string
		v4, v6  [][]string
		tcpDNS  bool // the shape captures DNS over TCP too
		origSrc bool // ENABLE_ORIG_SRC: pod B's proxy dials the app from pod A's address
	}{
		{"REDIRECT", cnirules.InPod(), cnirules.InPod6(), true, false},
		{"TPROXY", cnirules.InPodTPROXY(), cnirules.InPodTPROXY6(), false, false},
		{"REDIRECT with ENABLE_ORIG_SRC", cnirules.InPod(), cnirules.InPod6(), true, true},
	} {
		t.Run(shape.name, func(t *testing.T) {
			leaktest.Check(t)
			http.DefaultClient.Transport = &http.Transport{DisableKeepAlives: true}
			node, nsA, nsB, dir := inPodTopology6(t, shape.v4, shape.v6)
			server6 := startPodServer(t, nsB, inPodB6, "8080")
			server4 := startPodServer(t, nsB, inPodB, "8080")
			agent := inpodtest.NewAgent(t, inpodtest.SocketPath(t))
			env := inPodEnv(agent.Path, dir)
			// The app sees pod B's own address, or with ENABLE_ORIG_SRC pod A's: then its
			// replies reach pod B's proxy by the connection mark and table 100's ::/0.
			from4, from6 := inPodB, inPodB6
			if shape.origSrc {
				env["ENABLE_ORIG_SRC"] = "true"
				from4, from6 = inPodA, inPodA6
			}
			n, _ := startNode(t, testConfig(t, env))
			addClientServer(t, t, agent.Accept(), nsA, nsB)
			if code, body := waitReady(t, n, "ready\n"); code != 200 {
				t.Fatalf("readiness after the snapshot: %d %q", code, body)
			}
			metrics := func() string {
				_, body := get(t, "http://"+n.addrs["STATS_ADDR"].String()+"/metrics")
				return body
			}

			t.Run("pod to pod over IPv6 HBONE", func(t *testing.T) {
				out := strings.TrimSpace(nsA.MustExec(t, "curl", "-sS", "-m", "20", "--data-binary", "over v6", "http://["+inPodB6+"]:8080/sha256"))
				if !strings.HasSuffix(out, " 7") {
					t.Errorf("pod A to pod B over IPv6: server answered %q; want the SHA-256 and length of 7 bytes", out)
				}
				if got := server6.lastClient("8080"); got != from6 {
					t.Errorf("server saw the request from %q; want %s", got, from6)
				}
				waitMetricFrom(t, metrics, "node", "istio_tcp_connections_closed_total", map[string]string{
					"reporter": "destination", "connection_security_policy": "mutual_tls",
					"source_principal": "spiffe://cluster.local/ns/default/sa/client", "destination_workload": "server",
				}, 1)
				checkV6Connection(t, n, nsA)
			})

			t.Run("IPv4 beside it", func(t *testing.T) {
				out := nsA.MustExec(t, "curl", "-sS", "-m", "20", "http://"+inPodB+":8080/v4")
				if want := "server pod port 8080 got GET /v4"; !strings.Contains(out, want) || server4.lastClient("8080") != from4 {
					t.Errorf("pod A to pod B over IPv4: %q from %q; want %q from %s", out, server4.lastClient("8080"), want, from4)
				}
			})

			t.Run("plaintext over IPv6 captured on 15006", func(t *testing.T) {
				checkPlaintextInbound(t, node, server6, inPodB6, metrics)
			})

			t.Run("DNS to an IPv6 server answered on [::1]:15053", func(t *testing.T) {
				networks := []string{"udp"}
				if shape.tcpDNS {
					networks = append(networks, "tcp")
				}
				for _, network := range networks {
					// Nothing listens on the node: the pod's ip6tables rules send port 53 to
					// its own DNS proxy.
					conn, err := dialIn(nsA, network, net.JoinHostPort(inPodNodeToA6, "53"))
					if err != nil {
						t.Fatal(err)
					}
					wantVIPAnswer(t, conn, network, inPodVIP, " over IPv6")
				}
			})
		})
	}
}

// checkV6Connection holds a connection from pod A to pod B's IPv6 address open and reads
// it in /config_dump's workloadState: pod A's proxy names its original destination, and
// pod B's proxy saw the HBONE connection come from pod A's IPv6 address.
func checkV6Connection(t *testing.T, n *ztunnel, nsA *netnstest.NS) {
	t.Helper()
	target := net.JoinHostPort(inPodB6, "8080")
	conn, err := dialIn(nsA, "tcp", target)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(20 * time.Second))
	fmt.Fprintf(conn, "GET /held HTTP/1.1\r\nHost: server\r\n\r\n")
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
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
	if out := dump.WorkloadState["uid-a"].Connections.Outbound; !slices.ContainsFunc(out, func(c connInfo) bool {
		return c.OriginalDst == target && c.Protocol == "HBONE"
	}) {
		t.Errorf("pod A's outbound connections %+v; want one to %s over HBONE", out, target)
	}
	if in := dump.WorkloadState["uid-b"].Connections.Inbound; !slices.ContainsFunc(in, func(c connInfo) bool {
		host, _, _ := net.SplitHostPort(c.Src)
		return host == inPodA6 && c.ActualDst == target && c.Protocol == "HBONE"
	}) {
		t.Errorf("pod B's inbound connections %+v; want one from [%s] to %s over HBONE", in, inPodA6, target)
	}
}

// TestNetnsInPodIPv4Only: a pod whose namespace has IPv6 disabled (an IPv4-only cluster) is
// acknowledged and served, not left pending as the Rust ztunnel once left such pods
// (istio/ztunnel#1707): its [::] listeners still bind and take IPv4, and its DNS proxy
// answers on 127.0.0.1:15053 without the [::1] listener it cannot have.
func TestNetnsInPodIPv4Only(t *testing.T) {
	netnstest.RequireRoot(t)
	leaktest.Check(t)
	http.DefaultClient.Transport = &http.Transport{DisableKeepAlives: true}
	pod := netnstest.NewAnonymous(t)
	if err := pod.Do(func() error {
		for _, conf := range []string{"all", "default", "lo"} {
			if err := os.WriteFile("/proc/sys/net/ipv6/conf/"+conf+"/disable_ipv6", []byte("1"), 0); err != nil {
				return err
			}
		}
		if ln, err := net.Listen("tcp", "[::1]:0"); err == nil {
			ln.Close()
			return errors.New("::1 still bindable with IPv6 disabled")
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	writeInPodWorkloads(t, dir, inPodA, inPodB)
	agent := inpodtest.NewAgent(t, inpodtest.SocketPath(t))
	n, _ := startNode(t, testConfig(t, inPodEnv(agent.Path, dir)))
	c := agent.Accept()
	info := &zdspb.WorkloadInfo{Name: "client", Namespace: "default", ServiceAccount: "client"}
	if nack := c.AddPod("uid-v4only", info, pod); nack != "" {
		t.Fatalf("add a pod without IPv6: NACK %q", nack)
	}
	if nack := c.Send(inpodtest.SnapshotReq()); nack != "" {
		t.Fatalf("snapshot: NACK %q", nack)
	}
	if code, body := waitReady(t, n, "ready\n"); code != 200 {
		t.Fatalf("readiness: %d %q", code, body)
	}
	dial := func(network, addr string) (conn net.Conn, err error) {
		err = pod.Do(func() error {
			conn, err = net.DialTimeout(network, addr, 5*time.Second)
			return err
		})
		return conn, err
	}
	conn, err := dial("tcp", "127.0.0.1:15008")
	if err != nil {
		t.Fatalf("the pod's [::]:15008 over IPv4: %v", err)
	}
	conn.Close()
	for _, network := range []string{"udp", "tcp"} {
		conn, err := dial(network, "127.0.0.1:15053")
		if err != nil {
			t.Fatal(err)
		}
		wantVIPAnswer(t, conn, network, inPodVIP, "")
	}
}
