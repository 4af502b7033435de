//go:build linux

package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/gozt/gozt/identity/certs"
	"github.com/gozt/gozt/inpod/inpodtest"
	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/internal/netns/netnstest"
	"github.com/gozt/gozt/internal/spiretest"
	"github.com/gozt/gozt/internal/testutil"
)

// spireDelegate is the SPIFFE ID the tests' SPIRE agent accepts as a delegate.
const spireDelegate = "spiffe://cluster.local/ns/istio-system/sa/ztunnel"

// spireCerts is /config_dump's certificates of workload (namespace/name).
func spireCerts(t *testing.T, n *ztunnel, workload string) []certs.CertState {
	t.Helper()
	_, body := get(t, "http://"+n.addrs["ADMIN_ADDR"].String()+"/config_dump")
	var d struct {
		Certificates []certs.CertState `json:"certificates"`
	}
	if err := json.Unmarshal([]byte(body), &d); err != nil {
		t.Fatalf("config_dump: %v", err)
	}
	var out []certs.CertState
	for _, c := range d.Certificates {
		if c.Workload == workload {
			out = append(out, c)
		}
	}
	return out
}

// presented is the certificate the HBONE listener at addr, reached from inside ns,
// presents: the handshake stops at our missing client certificate, after we saw it.
func presented(ns *netnstest.NS, addr string) (*x509.Certificate, error) {
	var leaf *x509.Certificate
	err := ns.Do(func() error {
		c, err := net.DialTimeout("tcp", addr, 5*time.Second)
		if err != nil {
			return err
		}
		defer c.Close()
		tc := tls.Client(c, &tls.Config{InsecureSkipVerify: true, NextProtos: []string{"h2"}, MinVersion: tls.VersionTLS13,
			VerifyConnection: func(cs tls.ConnectionState) error { leaf = cs.PeerCertificates[0]; return nil }})
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		return tc.HandshakeContext(ctx)
	})
	if leaf == nil {
		return nil, fmt.Errorf("no certificate from %s: %v", addr, err)
	}
	return leaf, nil
}

// TestSpireInPod is CA_PROVIDER=spire in in-pod mode against a real SPIRE server and agent:
// ztunnel (this process, an authorized delegate through an entry for its program) subscribes to
// each pod istio-cni hands over by the pod's selectors, and the agent's entries (one per
// pod, by namespace and pod UID, as spire-controller-manager registers them) give each pod
// its own SVID. Pod A reaches pod B over HBONE under those identities; B's SVID (20 s) is
// rotated while A keeps connecting, without one failure; once B's entry is deleted, its
// connections are closed, new ones refused, and readiness and /config_dump say why.
func TestSpireInPod(t *testing.T) {
	netnstest.Require(t, "iptables", "curl")
	sp := spiretest.Start(t, spireDelegate)
	leaktest.Check(t)
	http.DefaultClient.Transport = &http.Transport{DisableKeepAlives: true}
	sp.Register(t, "ztunnel", spireDelegate, 0, spiretest.ProgramSelector(t, ""))
	const (
		client = "spiffe://cluster.local/ns/default/sa/client"
		server = "spiffe://cluster.local/ns/default/sa/server"
	)
	sp.Register(t, "pod-a", client, 0, "k8s:ns:default", "k8s:pod-uid:uid-a")
	sp.Register(t, "pod-b", server, 20*time.Second, "k8s:ns:default", "k8s:pod-uid:uid-b")
	bundle := x509.NewCertPool()
	for _, c := range sp.Bundle(t) {
		bundle.AddCert(c)
	}

	node, nsA, nsB, dir := inPodTopology(t)
	startPodServer(t, nsB, inPodB, "8080")
	agent := inpodtest.NewAgent(t, inpodtest.SocketPath(t))
	env := inPodEnv(agent.Path, dir)
	env["CA_PROVIDER"], env["SPIRE_ADMIN_ENDPOINT_SOCKET"] = "", sp.AdminSocket // auto: spire
	n, _ := startNode(t, testConfig(t, env))
	addClientServer(t, t, agent.Accept(), nsA, nsB)
	if code, body := waitReady(t, n, "ready\n"); code != 200 {
		t.Fatalf("readiness with both pods' SVIDs: %d %q", code, body)
	}

	// Each pod's own SVID, named in /config_dump with how it was asked for.
	for _, w := range []struct{ name, id, uid, sa string }{{"default/client", client, "uid-a", "client"}, {"default/server", server, "uid-b", "server"}} {
		cs := spireCerts(t, n, w.name)
		wantSource := "spire: selectors k8s:ns:default,k8s:sa:" + w.sa + ",k8s:pod-name:" + w.sa + ",k8s:pod-uid:" + w.uid + ",k8s:node-name:node-a"
		if len(cs) != 1 || cs[0].Identity != w.id || cs[0].State != "Available" || cs[0].Source != wantSource || len(cs[0].CertChain) == 0 {
			t.Fatalf("config_dump certificates of %s = %+v; want one Available SVID for %s from %q", w.name, cs, w.id, wantSource)
		}
	}
	serving := func(ip string) *x509.Certificate {
		t.Helper()
		leaf, err := presented(node, net.JoinHostPort(ip, "15008"))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := leaf.Verify(x509.VerifyOptions{Roots: bundle, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}}); err != nil {
			t.Errorf("%s presents a certificate that does not chain to SPIRE's bundle: %v", ip, err)
		}
		return leaf
	}
	if leaf := serving(inPodB); leaf.URIs[0].String() != server || leaf.SerialNumber.String() != spireCerts(t, n, "default/server")[0].CertChain[0].SerialNumber {
		t.Errorf("pod B presents %v serial %s; want its SVID from /config_dump", leaf.URIs, leaf.SerialNumber)
	}
	if leaf := serving(inPodA); leaf.URIs[0].String() != client {
		t.Errorf("pod A presents %v; want %s", leaf.URIs, client)
	}

	curl := func() error {
		out, err := nsA.Exec("curl", "-fsS", "-m", "10", "http://"+inPodB+":8080/spire")
		if err != nil {
			return fmt.Errorf("%v: %s", err, out)
		}
		return nil
	}
	if err := curl(); err != nil {
		t.Fatalf("pod A to pod B: %v", err)
	}
	metrics := func() string {
		_, body := get(t, "http://"+n.addrs["STATS_ADDR"].String()+"/metrics")
		return body
	}
	waitMetricFrom(t, metrics, "node", "istio_tcp_connections_closed_total", map[string]string{
		"reporter": "destination", "connection_security_policy": "mutual_tls",
		"source_principal": client, "destination_principal": server,
	}, 1)

	// Rotation: the agent renews B's SVID at half its life; A keeps connecting meanwhile.
	// (Watched in /config_dump: each look at what B presents is a failed handshake, which
	// B's admission control budgets per source.)
	serial := func() string {
		if cs := spireCerts(t, n, "default/server"); len(cs) == 1 && len(cs[0].CertChain) > 0 {
			return cs[0].CertChain[0].SerialNumber
		}
		return ""
	}
	first := serial()
	connections := 0
	err := testutil.Poll(60*time.Second, func() error {
		if err := curl(); err != nil {
			t.Fatalf("pod A to pod B during B's rotation, after %d connections: %v", connections, err)
		}
		connections++
		if s := serial(); s == first || s == "" {
			return fmt.Errorf("pod B's SVID is still serial %s (now %q)", first, s)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := curl(); err != nil {
		t.Fatalf("pod A to pod B after B's rotation: %v", err)
	}
	if got := serving(inPodB).SerialNumber.String(); got != serial() {
		t.Errorf("after the rotation pod B presents serial %s; want the new SVID's %s", got, serial())
	}
	t.Logf("B's SVID rotated with %d connections from A meanwhile, none failed", connections)

	// B's entry is deleted: B's SVID goes, its HBONE connections close, A's next ones fail.
	sp.Delete(t, "pod-b")
	err = testutil.Poll(30*time.Second, func() error {
		if cs := spireCerts(t, n, "default/server"); len(cs) != 1 || !strings.Contains(cs[0].State, "no SVID") {
			return fmt.Errorf("pod B's certificates: %+v", cs)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	// The withdrawal closes B's connections right after /config_dump shows it: allow for that.
	if testutil.Poll(10*time.Second, func() error {
		if curl() == nil {
			return errors.New("pod A still reaches pod B")
		}
		return nil
	}) != nil {
		t.Error("pod A reached pod B for 10 s after B's entry was deleted")
	}
	for i := range 3 {
		if curl() == nil {
			t.Errorf("attempt %d: pod A reached pod B after B's entry was deleted", i)
		}
	}
	if leaf, err := presented(node, net.JoinHostPort(inPodB, "15008")); err == nil {
		t.Errorf("pod B still presents %v after its entry was deleted", leaf.URIs)
	}
	if code, body := get(t, "http://"+n.addrs["READINESS_ADDR"].String()+"/healthz/ready"); code != 500 || !strings.Contains(body, "default/server") {
		t.Errorf("readiness after B's entry was deleted: %d %q; want 500 naming default/server", code, body)
	}
	if cs := spireCerts(t, n, "default/client"); len(cs) != 1 || cs[0].State != "Available" {
		t.Errorf("pod A's certificates after B's entry was deleted: %+v", cs)
	}
}

// TestSpireNotDelegate: a ztunnel the SPIRE agent does not list among its
// authorized_delegates (another program, whose entry gives it an identity that is not a
// delegate) is refused by the agent, and says so in a WARN naming the refusal.
func TestSpireNotDelegate(t *testing.T) {
	sp := spiretest.Start(t, spireDelegate)
	sp.Register(t, "local", "spiffe://cluster.local/ns/default/sa/default", 0, "k8s:ns:default", "k8s:sa:default")
	bin := buildZtunnel(t)
	sp.Register(t, "intruder", "spiffe://cluster.local/ns/default/sa/intruder", 0, spiretest.ProgramSelector(t, bin))
	p := startProc(t, "ztunnel (not a delegate)", []string{
		"PROXY_MODE=dedicated", "PROXY_WORKLOAD_INFO=default/local/default", "LOCAL_XDS_PATH=../../examples/localhost.yaml",
		"SPIRE_ADMIN_ENDPOINT_SOCKET=" + sp.AdminSocket, "INBOUND_ADDR=127.0.0.1:0",
		"OUTBOUND_ADDR=off", "INBOUND_PLAINTEXT_ADDR=off", "SOCKS5_ADDR=off", "DNS_PROXY_ADDR=off",
		"ADMIN_ADDR=off", "STATS_ADDR=off", "READINESS_ADDR=off",
	}, bin)
	p.waitOutput(t, "caller not configured as an authorized delegate", 30*time.Second)
	if !strings.Contains(p.Output(), "does not accept ztunnel as an authorized delegate") {
		t.Errorf("the refusal is not explained:\n%s", p.Output())
	}
}
