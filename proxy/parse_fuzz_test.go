package proxy

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/binary"
	"net/netip"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/gozt/gozt/identity"
	"github.com/gozt/gozt/metrics"
	"github.com/gozt/gozt/xds"
	"github.com/gozt/gozt/xds/state"
)

// FuzzParseBaggage feeds a peer's baggage header to parseBaggage: it must not panic, every
// key and value it returns must come from one comma-separated member, and the baggage we
// send must read back as the values it was built from.
func FuzzParseBaggage(f *testing.F) {
	f.Add("k8s.cluster.name=c1,k8s.namespace.name=default,service.name=echo")
	f.Add(" a = b ,,=,c=d=e,")
	f.Add("")
	f.Fuzz(func(t *testing.T, h string) {
		b := parseBaggage(h)
		for _, v := range []string{b.cluster, b.namespace, b.workload, b.service, b.version, b.region, b.zone} {
			if strings.Contains(v, ",") {
				t.Fatalf("parseBaggage(%q): %+v: a value spans members", h, b)
			}
		}
		// Round trip: our own header, with the fuzzed value as the namespace.
		ns := strings.NewReplacer(",", "", "=", "").Replace(strings.TrimSpace(h))
		if ns != strings.TrimSpace(ns) || ns == "" {
			return
		}
		w := &state.Workload{WorkloadMeta: &state.WorkloadMeta{Namespace: ns, ClusterID: "c1"}}
		if got := parseBaggage(baggage(w)).namespace; got != ns {
			t.Fatalf("baggage round trip: namespace %q came back %q", ns, got)
		}
	})
}

// FuzzProxyV2Header builds PROXY v2 headers from arbitrary addresses and identities and
// decodes them as a receiving application would: signature, version/command, family,
// length, addresses, ports and the identity TLV must all read back.
func FuzzProxyV2Header(f *testing.F) {
	f.Add([]byte{10, 0, 0, 1}, uint16(1234), []byte{10, 0, 0, 2}, uint16(8080), "spiffe://cluster.local/ns/default/sa/client")
	f.Add(netip.MustParseAddr("::1").AsSlice(), uint16(1), []byte{127, 0, 0, 1}, uint16(2), "")
	f.Fuzz(func(t *testing.T, s []byte, sp uint16, d []byte, dp uint16, id string) {
		sa, ok1 := netip.AddrFromSlice(s)
		da, ok2 := netip.AddrFromSlice(d)
		if !ok1 || !ok2 {
			return
		}
		peer, err := identity.Parse(id)
		if err != nil {
			peer = identity.ID{}
		}
		src, dst := netip.AddrPortFrom(sa, sp), netip.AddrPortFrom(da, dp)
		b := proxyV2Header(src, dst, peer)
		if !bytes.HasPrefix(b, proxyV2Signature[:]) || len(b) < 16 || b[12] != 0x21 {
			t.Fatalf("bad signature or version/command: % x", b)
		}
		if n := int(binary.BigEndian.Uint16(b[14:16])); n != len(b)-16 {
			t.Fatalf("length field %d, payload %d bytes", n, len(b)-16)
		}
		body := b[16:]
		var gs, gd netip.Addr
		switch b[13] {
		case 0x11:
			gs, gd = netip.AddrFrom4([4]byte(body[0:4])), netip.AddrFrom4([4]byte(body[4:8]))
			body = body[8:]
		case 0x21:
			gs, gd = netip.AddrFrom16([16]byte(body[0:16])), netip.AddrFrom16([16]byte(body[16:32]))
			body = body[32:]
		default:
			t.Fatalf("family byte %#x", b[13])
		}
		if gs.Unmap() != sa.Unmap() || gd.Unmap() != da.Unmap() {
			t.Fatalf("addresses %v %v came back %v %v", sa, da, gs, gd)
		}
		if binary.BigEndian.Uint16(body[0:2]) != sp || binary.BigEndian.Uint16(body[2:4]) != dp {
			t.Fatalf("ports %d %d came back % x", sp, dp, body[:4])
		}
		body = body[4:]
		if peer.IsZero() {
			if len(body) != 0 {
				t.Fatalf("no identity, but %d TLV bytes", len(body))
			}
			return
		}
		if len(body) < 3 || body[0] != tlvPeerIdentity || int(binary.BigEndian.Uint16(body[1:3])) != len(body)-3 || string(body[3:]) != peer.String() {
			t.Fatalf("identity TLV % x, want %q", body, peer.String())
		}
	})
}

// noCerts is a CertSource for tests that never reach a handshake.
type noCerts struct{}

func (noCerts) ClientConfig(context.Context, identity.ID, []identity.ID) (*tls.Config, error) {
	return nil, context.Canceled
}
func (noCerts) ServerConfig(func(*tls.ClientHelloInfo) (identity.ID, error)) *tls.Config {
	return &tls.Config{}
}

// FuzzInboundAuthority gives node B's inbound side arbitrary CONNECT authorities: it must
// not panic, and what it accepts must have a target address.
func FuzzInboundAuthority(f *testing.F) {
	data, err := os.ReadFile("../examples/two-nodes.yaml")
	if err != nil {
		f.Fatal(err)
	}
	batch, err := xds.ParseFile("two-nodes.yaml", data)
	if err != nil {
		f.Fatal(err)
	}
	store := state.NewStore()
	store.Apply(batch)
	p := New(Config{Local: state.Local{Mode: state.ModeDedicated, Workload: state.WorkloadRef{Namespace: "default", Name: "server", ServiceAccount: "server"}}, WorkloadWait: time.Millisecond},
		store, noCerts{}, metrics.New(prometheus.NewRegistry(), "fuzz"))
	connDst := netip.MustParseAddr("127.0.0.3")
	for _, a := range []string{"127.0.0.3:8080", "[::ffff:127.0.0.3]:8080", "echo.default.svc.cluster.local:80", "127.0.0.3:99999", ":", "127.0.0.4:1", "[::1%eth0]:80"} {
		f.Add(a)
	}
	f.Fuzz(func(t *testing.T, authority string) {
		if tg, ierr := p.inboundTarget(context.Background(), authority, connDst); ierr == nil && !tg.addr.IsValid() {
			t.Fatalf("accepted %q with no target address", authority)
		}
	})
}
