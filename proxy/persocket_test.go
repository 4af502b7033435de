//go:build linux

package proxy_test

import (
	"testing"
	"time"

	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/proxy"
)

// TestPerSocket runs end-to-end tests again with every node on netpoll.PerSocket, the
// poller of a proxy given none and of every node off Linux: a goroutine per listener, and
// copies that keep their goroutines. The other tests run on the epoll poller, as a node
// on Linux does.
func TestPerSocket(t *testing.T) {
	perSocket = true
	defer func() { perSocket = false }()
	for name, test := range map[string]func(*testing.T){
		"PayloadsThroughHBONE": TestPayloadsThroughHBONE, "HalfClose": TestHalfClose,
		"ResetsCarried": TestResetsCarried, "PeerKillResetsClient": TestPeerKillResetsClient,
		"PassthroughUnknownDestination":      TestPassthroughUnknownDestination,
		"PlaintextListenerDirect":            TestPlaintextListenerDirect,
		"SelectorPolicyClosesLiveConnection": TestSelectorPolicyClosesLiveConnection,
		"DrainWithLiveConnection":            TestDrainWithLiveConnection,
		"DrainWithIdleSocksClient":           TestDrainWithIdleSocksClient,
		"AcceptOutOfFileDescriptors":         TestAcceptOutOfFileDescriptors,
		"InboundHandshakeFailures":           TestInboundHandshakeFailures,
		"NeverParks":                         testNeverParks,
	} {
		t.Run(name, test)
	}
}

// testNeverParks: with PerSocket an idle connection keeps its copy goroutine on each node
// (no sweep wakes it to park) and still carries bytes both ways after the idle spell.
func testNeverParks(t *testing.T) {
	leaktest.Check(t)
	proxy.SetIdleSweep(t, idleSweep, false)
	m := startMesh(t)
	be, backends := heldBackend(t, m)
	c, bc := dialIdle(t, m, be, backends)
	exchange(t, c, bc, 1<<10)
	time.Sleep(4 * idleSweep) // parked by now, had the poller parked
	if a, b := m.a.proxy.Parked(), m.b.proxy.Parked(); a != 0 || b != 0 {
		t.Errorf("parked: node A %d, node B %d; want none", a, b)
	}
	if n := stacksWith("(*pump).run"); n != 2 {
		t.Errorf("%d goroutines run a copy direction; want 2 (one per node)", n)
	}
	exchange(t, c, bc, 1<<10)
}
