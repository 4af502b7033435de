//go:build linux

package main

import (
	"context"
	"crypto/rand"
	"crypto/rsa"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"net"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/gozt/gozt/identity"
	"github.com/gozt/gozt/identity/ca/catest"
	"github.com/gozt/gozt/internal/netns/netnstest"
)

// TestFIPSNodes runs FIPS nodes (the binary make image FIPS=1 builds: GOFIPS140=v1.0.0)
// beside default ones as separate processes, since FIPS 140-3 mode is process-wide: pod to
// pod over HBONE, with certificates from an Istio CA over TLS, for a FIPS node to a FIPS
// node and to a default node, both ways; how a FIPS node refuses to be turned off; what its
// 15008 negotiates with peers offering what a default gozt and an older Rust ztunnel offer,
// and the WARN it logs for peers offering only what FIPS mode refuses; and a FIPS node
// dialing a server that accepts X25519 alone.
func TestFIPSNodes(t *testing.T) {
	netnstest.Require(t, "iptables", "curl")
	bin, fipsBin := buildZtunnel(t), buildZtunnelFIPS(t)

	a := netnstest.New(t, "fips-a")
	b := netnstest.New(t, "fips-b")
	netnstest.Link(t, a, nsClientIP+"/24", b, nsServerIP+"/24")
	redirect(t, a)
	redirect(t, b)
	dir := t.TempDir()
	writeWorkloads(t, dir, nsClientIP, nsServerIP, nsEchoVIP)
	// One Istio-protocol CA over TLS, inside each node's namespace on 127.0.0.1:15012: the
	// nodes' CA client runs in FIPS mode too.
	root := catest.NewRoot(t, "fips-root")
	caCert := root.ServingCert(t, "127.0.0.1")
	istioCA := catest.NewIstio(root, &caCert)
	t.Cleanup(istioCA.Stop)
	for _, ns := range []*netnstest.NS{a, b} {
		var ln net.Listener
		if err := ns.Do(func() (err error) { ln, err = net.Listen("tcp", "127.0.0.1:15012"); return err }); err != nil {
			t.Fatal(err)
		}
		istioCA.Serve(ln)
	}
	caEnv := []string{"CA_PROVIDER=istio", "CA_ADDRESS=127.0.0.1:15012", "CA_ROOT_CA=" + root.WriteRootFile(t)}
	server := startPodServer(t, b, nsServerIP, "8080")
	clientID := identity.MustParse("spiffe://cluster.local/ns/default/sa/client")
	serverID := identity.MustParse("spiffe://cluster.local/ns/default/sa/server")

	node := func(t *testing.T, ns *netnstest.NS, bin, workload string, env ...string) *proc {
		return startNodeIn(t, bin, ns, dir, slices.Concat(caEnv, []string{"PROXY_MODE=dedicated", "PROXY_WORKLOAD_INFO=" + workload}, env)...)
	}
	for _, pair := range []struct {
		name           string
		client, server string
	}{
		{"FIPS to FIPS", fipsBin, fipsBin},
		{"FIPS to default", fipsBin, bin},
		{"default to FIPS", bin, fipsBin},
	} {
		t.Run(pair.name, func(t *testing.T) {
			nodeB := node(t, b, pair.server, "default/server/server")
			nodeA := node(t, a, pair.client, "default/client/client")
			for _, n := range []struct {
				ns   *netnstest.NS
				p    *proc
				fips bool
			}{{a, nodeA, pair.client == fipsBin}, {b, nodeB, pair.server == fipsBin}} {
				want := fipsState{Build: "off", Module: "latest"}
				if n.fips {
					want = fipsState{Enabled: true, Module: fipsModule, Build: fipsModule + "-"}
				}
				checkFIPSReported(t, n.ns, n.p, want)
			}
			before := server.count("8080")
			out := a.MustExec(t, "curl", "-sS", "-m", "10", "--data-binary", "fips", "http://"+nsServerIP+":8080/"+strings.ReplaceAll(pair.name, " ", "-"))
			if !strings.Contains(out, "server pod port 8080 got POST") || server.count("8080") != before+1 {
				t.Fatalf("curl through the pair: %q (server saw %d requests, want %d)", out, server.count("8080"), before+1)
			}
			waitMetric(t, b, "B", "istio_tcp_connections_closed_total", map[string]string{
				"reporter": "destination", "connection_security_policy": "mutual_tls", "source_principal": clientID.String(),
			}, 1)
		})
	}

	// The mode cannot be turned off by accident: a FIPS build refuses GODEBUG=fips140=off,
	// and KERNEL_TLS=true. A default build runs in FIPS mode with GODEBUG=fips140=on, on
	// the toolchain's own module.
	t.Run("start-up", func(t *testing.T) {
		for _, env := range [][]string{{"GODEBUG=fips140=off"}, {"KERNEL_TLS=true", "PROXY_MODE=dedicated", "PROXY_WORKLOAD_INFO=default/server/server"}} {
			cmd := exec.Command(fipsBin)
			cmd.Env = append([]string{raceEnv}, env...)
			out, err := cmd.CombinedOutput()
			if code := cmd.ProcessState.ExitCode(); code != 2 || !strings.Contains(string(out), "FIPS 140-3 mode is") {
				t.Errorf("FIPS build with %v: exit %d (%v); want 2 and a refusal naming FIPS 140-3 mode:\n%s", env, code, err, out)
			}
		}
		p := node(t, b, bin, "default/server/server", "GODEBUG=fips140=on")
		checkFIPSReported(t, b, p, fipsState{Enabled: true, Module: "latest", Build: "off"})
	})

	// Peers as the test process (not in FIPS mode) offers them, against node B's 15008 as a
	// FIPS node and as a default one, dialed inside B on loopback (which B's redirection
	// leaves alone).
	now := time.Now()
	meshCert := root.Issue(t, clientID, now.Add(-time.Minute), now.Add(time.Hour)).Certificate
	rsa1024 := root.IssueKey(t, clientID, must(rsa.GenerateKey(rand.Reader, 1024))).Certificate
	type offer struct {
		name   string
		cert   tls.Certificate
		max    uint16
		curves []tls.CurveID
	}
	offers := []offer{
		{"default gozt", meshCert, tls.VersionTLS13, []tls.CurveID{tls.X25519MLKEM768, tls.X25519, tls.CurveP256, tls.CurveP384}},
		{"no ML-KEM", meshCert, tls.VersionTLS13, []tls.CurveID{tls.X25519, tls.CurveP256}},
		{"X25519 alone", meshCert, tls.VersionTLS13, []tls.CurveID{tls.X25519}},
		{"RSA 1024 certificate", rsa1024, tls.VersionTLS13, nil},
	}
	want := map[string][2]string{ // offer -> outcome at a default node, at a FIPS node
		"default gozt":         {"TLS 1.3 X25519MLKEM768", "TLS 1.3 X25519MLKEM768"},
		"no ML-KEM":            {"TLS 1.3 X25519", "TLS 1.3 CurveP256"},
		"X25519 alone":         {"TLS 1.3 X25519", "refused"},
		"RSA 1024 certificate": {"TLS 1.3 X25519MLKEM768", "refused"},
	}
	for i, serverBin := range []string{bin, fipsBin} {
		t.Run(fmt.Sprintf("peers of a node with FIPS %v", i == 1), func(t *testing.T) {
			nodeB := node(t, b, serverBin, "default/server/server")
			for _, o := range offers {
				got := dialTLSFrom(t, b, "127.0.0.1:15008", &tls.Config{
					MaxVersion: o.max, CurvePreferences: o.curves, Certificates: []tls.Certificate{o.cert},
					InsecureSkipVerify: true, NextProtos: []string{"h2"},
				})
				if got != want[o.name][i] {
					t.Errorf("%s: %s; want %s", o.name, got, want[o.name][i])
				}
			}
			if i == 0 {
				return
			}
			// The refusals are counted and the first is logged as a WARN that names the rule (the
			// next of the same reason only later: proxy/handshake.go), the RSA key's included.
			nodeB.waitOutput(t, `level=WARN msg="proxy: inbound TLS handshake failed" peer=127.0.0.1:`, 10*time.Second)
			if want := `reason=not_fips_approved err="tls: no key exchanges supported by both client and server"`; !strings.Contains(nodeB.Output(), want) {
				t.Errorf("node B's WARN lacks %q:\n%s", want, nodeB.Output())
			}
			notApproved := map[string]string{"reason": "not_fips_approved"}
			waitMetric(t, b, "B", "hbone_tls_handshake_failures_total", notApproved, 2)
			// TLS 1.3 with ChaCha20-Poly1305 alone: Go's client cannot offer that, OpenSSL can.
			if _, err := exec.LookPath("openssl"); err != nil {
				t.Log("openssl is not installed: the ChaCha20-only peer is not tried")
				return
			}
			out, err := b.Exec("openssl", "s_client", "-connect", "127.0.0.1:15008", "-tls1_3",
				"-ciphersuites", "TLS_CHACHA20_POLY1305_SHA256", "-groups", "P-256")
			if err == nil || !strings.Contains(string(out), "alert handshake failure") {
				t.Errorf("openssl s_client with ChaCha20 alone: %v\n%s", err, out)
			}
			waitMetric(t, b, "B", "hbone_tls_handshake_failures_total", notApproved, 3)
		})
	}

	// A FIPS node dialing a server that accepts X25519 alone (the test process, on node B's
	// 15008 in B's namespace): the connection fails, and node A says so.
	t.Run("FIPS client to an X25519-only server", func(t *testing.T) {
		srvCert := root.Issue(t, serverID, now.Add(-time.Minute), now.Add(time.Hour)).Certificate
		var ln net.Listener
		if err := b.Do(func() (err error) { ln, err = net.Listen("tcp", net.JoinHostPort(nsServerIP, "15008")); return err }); err != nil {
			t.Fatal(err)
		}
		handshakes := make(chan error, 4)
		done := make(chan struct{})
		go func() {
			defer close(done)
			for {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				tc := tls.Server(c, &tls.Config{Certificates: []tls.Certificate{srvCert}, CurvePreferences: []tls.CurveID{tls.X25519},
					ClientAuth: tls.RequireAnyClientCert, NextProtos: []string{"h2"}})
				tc.SetDeadline(time.Now().Add(10 * time.Second))
				select {
				case handshakes <- tc.Handshake():
				default:
				}
				tc.Close()
			}
		}()
		t.Cleanup(func() { ln.Close(); <-done })
		nodeA := node(t, a, fipsBin, "default/client/client")
		out, err := a.Exec("curl", "-sS", "-m", "10", "http://"+nsServerIP+":8080/x25519-only")
		if err == nil {
			t.Errorf("curl through a FIPS node to an X25519-only server succeeded: %s", out)
		}
		select {
		case err := <-handshakes:
			if err == nil || !strings.Contains(err.Error(), "no key exchanges supported") {
				t.Errorf("server's handshake: %v; want no key exchange in common", err)
			}
		case <-time.After(10 * time.Second):
			t.Error("node A never reached the server")
		}
		nodeA.waitOutput(t, "tls handshake: remote error: tls: handshake failure (FIPS 140-3 mode: this node offered only approved parameters, key exchange [X25519MLKEM768 CurveP256 CurveP384]", 10*time.Second)
	})
}

// checkFIPSReported checks that node p in ns reports FIPS 140-3 mode as want says (Build:
// a prefix) in its start-up line and /config_dump, and kernel TLS off in FIPS mode.
func checkFIPSReported(t *testing.T, ns *netnstest.NS, p *proc, want fipsState) {
	t.Helper()
	fips := want.Enabled
	p.waitOutput(t, fmt.Sprintf("fips140.enabled=%v fips140.module=%s fips140.build=%s", fips, want.Module, want.Build), 10*time.Second)
	var dump struct {
		Version struct {
			FIPS fipsState `json:"fips140"`
		} `json:"version"`
		Config    struct{ KernelTLS bool }
		KernelTLS struct {
			Enabled bool `json:"enabled"`
		} `json:"kernelTls"`
	}
	if err := json.Unmarshal([]byte(ns.MustExec(t, "curl", "-fsS", "-m", "5", "http://127.0.0.1:15000/config_dump")), &dump); err != nil {
		t.Fatal(err)
	}
	f := dump.Version.FIPS
	if f.Enabled != fips || f.Enforced || f.Module != want.Module || !strings.HasPrefix(f.Build, want.Build) || dump.Config.KernelTLS == fips || dump.KernelTLS.Enabled == fips {
		t.Errorf("%s /config_dump: version.fips140 %+v, config.KernelTLS %v, kernelTls.enabled %v; want FIPS 140-3 mode %v and kernel TLS %v",
			p.Name, f, dump.Config.KernelTLS, dump.KernelTLS.Enabled, fips, !fips)
	}
}

// dialTLSFrom handshakes with addr from inside ns with cfg and says what was negotiated
// ("TLS 1.3 X25519MLKEM768"), or "refused". In TLS 1.3 the server judges the client's
// certificate after the client's side of the handshake is done, so the client also reads
// the server's HTTP/2 SETTINGS to learn whether it was kept.
func dialTLSFrom(t *testing.T, ns *netnstest.NS, addr string, cfg *tls.Config) string {
	t.Helper()
	var raw net.Conn
	if err := ns.Do(func() (err error) {
		raw, err = (&net.Dialer{Timeout: 5 * time.Second}).Dial("tcp", addr)
		return err
	}); err != nil {
		t.Fatalf("dial %s: %v", addr, err)
	}
	defer raw.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c := tls.Client(raw, cfg)
	c.SetDeadline(time.Now().Add(10 * time.Second))
	if err := c.HandshakeContext(ctx); err != nil {
		t.Logf("handshake: %v", err)
		return "refused"
	}
	if _, err := c.Write([]byte("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")); err != nil {
		return "refused"
	}
	if _, err := c.Read(make([]byte, 1)); err != nil {
		t.Logf("read after the handshake: %v", err)
		return "refused"
	}
	cs := c.ConnectionState()
	return tls.VersionName(cs.Version) + " " + cs.CurveID.String()
}

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}
