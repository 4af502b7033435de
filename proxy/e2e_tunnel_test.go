package proxy_test

// End-to-end tests of the two loopback nodes (e2e_test.go): application tunnels (PROXY
// protocol v2 to the backend).

import (
	"bytes"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strings"
	"testing"

	"github.com/gozt/gozt/internal/leaktest"
)

// TestApplicationTunnelProxyV2: a server workload with an application tunnel gets its
// inbound traffic on localhost:<tunnel port>, prefixed by a PROXY v2 header naming the
// HBONE target and carrying the client's SPIFFE identity in TLV 0xD0.
func TestApplicationTunnelProxyV2(t *testing.T) {
	leaktest.Check(t)
	checkFDs(t)
	m := newMesh(t)
	headers := make(chan proxyHeader, 1)
	tunnel := startBackend(t, "127.0.0.1:0", func(c *net.TCPConn) {
		h, err := readProxyV2(c)
		h.err = err
		headers <- h
		if err == nil {
			echo(c)
		}
	})
	m.yaml = strings.Replace(m.yaml, "serviceAccount: server", fmt.Sprintf("serviceAccount: server\n    applicationTunnel: {protocol: PROXY, port: %d}", tunnel.port()), 1)
	m.start(t)

	c, code, err := socksConnect(m.a.socks(t), m.serverIP, 9999)
	if err != nil {
		t.Fatalf("socks5 connect: code %d: %v", code, err)
	}
	defer c.Close()
	h := <-headers
	if h.err != nil {
		t.Fatalf("PROXY v2 header: %v", h.err)
	}
	if want := m.serverIP + ":9999"; h.dst != want {
		t.Errorf("PROXY header destination %s, want the HBONE target %s", h.dst, want)
	}
	if got, want := h.tlv[0xD0], "spiffe://"+clientPrinc; got != want {
		t.Errorf("TLV 0xD0 = %q, want %q", got, want)
	}
	sendAndCheck(t, c, 10000, 11)
}

// proxyHeader is what readProxyV2 parsed; err is for the test's channel.
type proxyHeader struct {
	dst string
	tlv map[byte]string
	err error
}

// proxyV2Sig opens every PROXY protocol v2 header.
var proxyV2Sig = []byte("\r\n\r\n\x00\r\nQUIT\n")

// readProxyV2 parses a PROXY v2 header over TCP/IPv4, keeping its TLVs by type.
func readProxyV2(r io.Reader) (h proxyHeader, err error) {
	var fixed [16]byte
	if _, err := io.ReadFull(r, fixed[:]); err != nil {
		return h, err
	}
	if !bytes.Equal(fixed[:12], proxyV2Sig) || fixed[12] != 0x21 || fixed[13] != 0x11 {
		return h, fmt.Errorf("not a PROXY v2 TCP/IPv4 header: % x", fixed)
	}
	body := make([]byte, int(fixed[14])<<8|int(fixed[15]))
	if _, err := io.ReadFull(r, body); err != nil || len(body) < 12 {
		return h, fmt.Errorf("header body (%d bytes): %v", len(body), err)
	}
	dst := netip.AddrFrom4([4]byte(body[4:8]))
	h.dst = netip.AddrPortFrom(dst, uint16(body[10])<<8|uint16(body[11])).String()
	h.tlv = map[byte]string{}
	for rest := body[12:]; len(rest) > 0; {
		if len(rest) < 3 {
			return h, fmt.Errorf("truncated TLV % x", rest)
		}
		n := int(rest[1])<<8 | int(rest[2])
		if len(rest) < 3+n {
			return h, fmt.Errorf("TLV %#x of %d bytes overruns the header", rest[0], n)
		}
		h.tlv[rest[0]] = string(rest[3 : 3+n])
		rest = rest[3+n:]
	}
	return h, nil
}
