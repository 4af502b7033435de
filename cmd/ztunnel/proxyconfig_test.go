package main

import (
	"context"
	"log/slog"
	"net"
	"net/netip"
	"slices"
	"testing"

	"github.com/gozt/gozt/hbone"
	"github.com/gozt/gozt/internal/testutil"
	"github.com/gozt/gozt/proxy"
	"github.com/gozt/gozt/xds/state"
)

// nodeProxyConfig is the configuration of the node-level proxy of the settings c.
func nodeProxyConfig(c *config) proxy.Config {
	return newZtunnel(c, nil).proxyConfig(c.local(), nil, nil)
}

// dialRecorder is a pod's sockets as far as a proxy dials through them: it records each
// dial and fails it.
type dialRecorder struct{ dialed []string }

func (d *dialRecorder) Listen(context.Context, string, string) (net.Listener, error) {
	return nil, net.ErrClosed
}

func (d *dialRecorder) Dial(_ context.Context, _ *net.Dialer, _, address string) (net.Conn, error) {
	d.dialed = append(d.dialed, address)
	return nil, net.ErrClosed
}

// TestProxyConfigWiring: proxyConfig decides every part of a proxy's configuration that is
// not a setting, hbone's included: PACKET_MARK on the node's own dials and its pool's, or
// a pod's sockets for both; hbone's hooks counting into the node's metrics, on both sides;
// the store's network gateways as the server's relaying sources.
func TestProxyConfigWiring(t *testing.T) {
	c := testConfig(t, map[string]string{"PACKET_MARK": "1337", "NETWORK": "net1"})
	n := newZtunnel(c, nil)
	quiet := slog.New(slog.DiscardHandler)

	node := n.proxyConfig(n.local, quiet, nil)
	if node.PacketMark != 1337 || node.HBONEClient.Control == nil || node.Sockets != nil || node.HBONEClient.Dial != nil {
		t.Errorf("node proxy: PacketMark %d, pool Control set %v, Sockets %v, pool Dial set %v; want 1337, true, nil, false",
			node.PacketMark, node.HBONEClient.Control != nil, node.Sockets, node.HBONEClient.Dial != nil)
	}
	c.PacketMark = 0
	if unmarked := n.proxyConfig(n.local, nil, nil); unmarked.PacketMark != 0 || unmarked.HBONEClient.Control != nil {
		t.Errorf("PACKET_MARK=0: PacketMark %d, pool Control set %v; want neither", unmarked.PacketMark, unmarked.HBONEClient.Control != nil)
	}
	c.PacketMark = 1337

	sockets := &dialRecorder{}
	pod := n.proxyConfig(n.local.Pod(state.WorkloadRef{Namespace: "default", Name: "app", ServiceAccount: "app"}), nil, sockets)
	if pod.PacketMark != 0 || pod.HBONEClient.Control != nil || pod.Sockets != proxy.Sockets(sockets) || pod.HBONEClient.Dial == nil {
		t.Fatalf("pod proxy: PacketMark %d, pool Control set %v, Sockets %v; want 0, false, the pod's (they mark)", pod.PacketMark, pod.HBONEClient.Control != nil, pod.Sockets)
	}
	pod.HBONEClient.Dial(context.Background(), &net.Dialer{}, "tcp", "10.0.0.9:15008")
	if !slices.Equal(sockets.dialed, []string{"10.0.0.9:15008"}) {
		t.Errorf("the pod's pool dialed %v through the pod's sockets; want 10.0.0.9:15008", sockets.dialed)
	}

	for side, hc := range map[string]hbone.Config{"client": node.HBONEClient.Config, "server": node.HBONEServer.Config} {
		if hc.OnDrop == nil || hc.OnTLS == nil || hc.OnKernelTLSEnd == nil || hc.OnKeyLimit == nil {
			t.Fatalf("%s: a hook of hbone's is not set", side)
		}
		hc.OnDrop(hbone.DropRefused)
	}
	if got, _ := testutil.Gather(t, n.registry).Sum("hbone_dropped_total", map[string]string{"reason": "refused"}); got != 2 {
		t.Errorf("hbone_dropped_total{reason=refused} = %v after a drop on each side; want 2", got)
	}

	relays := node.HBONEServer.Admission.SourceRelays
	gw, other := netip.MustParseAddr("10.2.0.6"), netip.MustParseAddr("10.2.0.7")
	if relays == nil || relays(gw) {
		t.Fatalf("SourceRelays set %v, or it names %v before any workload names it a gateway", relays != nil, gw)
	}
	n.store.Apply(&state.Batch{Workloads: []*state.Workload{{UID: "far", Name: "far", WorkloadMeta: &state.WorkloadMeta{Namespace: "default", Network: "net2",
		NetworkGateway: &state.GatewayAddress{Network: "net1", Address: gw}}}}})
	if !relays(gw) || relays(other) {
		t.Errorf("SourceRelays(%v) = %v, (%v) = %v; want the gateway the store names on NETWORK, and no other", gw, relays(gw), other, relays(other))
	}
}
