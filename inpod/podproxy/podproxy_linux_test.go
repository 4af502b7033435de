//go:build linux

package podproxy

import (
	"context"
	"crypto/tls"
	"errors"
	"log/slog"
	"net"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/gozt/gozt/identity"
	"github.com/gozt/gozt/inpod"
	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/internal/netns"
	"github.com/gozt/gozt/internal/netns/netnstest"
	"github.com/gozt/gozt/metrics"
	"github.com/gozt/gozt/proxy"
	"github.com/gozt/gozt/xds/state"
)

// noCerts is a CertSource for pods that serve no HBONE here.
type noCerts struct{}

func (noCerts) ClientConfig(context.Context, identity.ID, []identity.ID) (*tls.Config, error) {
	return nil, errors.New("no certificates in this test")
}

func (noCerts) ServerConfig(func(*tls.ClientHelloInfo) (identity.ID, error)) *tls.Config {
	return &tls.Config{}
}

var _ proxy.CertSource = noCerts{}

// newSet is a Set whose pods listen on 15006 only (their own namespace: no clash).
func newSet(t *testing.T) *Set {
	t.Helper()
	return New(Config{
		Node: state.Local{Mode: state.ModeShared, Node: "node-a"},
		Proxy: func(local state.Local, sockets netns.Sockets, log *slog.Logger) proxy.Config {
			return proxy.Config{Local: local, Sockets: sockets, Logger: log, InboundPlaintextAddr: "127.0.0.1:15006"}
		},
		Store:   state.NewStore(),
		Certs:   noCerts{},
		Metrics: metrics.New(prometheus.NewRegistry(), "test"),
	})
}

func testPod(uid string, ns *netns.NetNS) inpod.Pod {
	return inpod.Pod{UID: uid, Info: inpod.WorkloadInfo{Namespace: "default", Name: "app-" + uid, ServiceAccount: "app"}, NetNS: ns}
}

// dialIn connects to addr from inside ns.
func dialIn(ns *netns.NetNS, addr string) error {
	return ns.Do(func() error {
		c, err := net.Dial("tcp", addr)
		if err == nil {
			c.Close()
		}
		return err
	})
}

// A started pod listens inside its own namespace and is listed; once stopped it is not,
// and Close returns after its shutdown, which released the pod's namespace.
func TestStartStop(t *testing.T) {
	leaktest.Check(t)
	ns := netnstest.NewAnonymous(t)
	s := newSet(t)
	if err := s.Start(testPod("u1", ns)); err != nil {
		t.Fatalf("Start: %v", err)
	}
	if err := dialIn(ns, "127.0.0.1:15006"); err != nil {
		t.Fatalf("dial the pod's 15006 in its namespace: %v", err)
	}
	if _, _, ok := s.Connections("u1"); !ok {
		t.Fatal("Connections(u1): not running; want running")
	}
	s.Stop("u1")
	if _, _, ok := s.Connections("u1"); ok {
		t.Error("Connections(u1) after Stop: running; want gone")
	}
	s.Close()
	if err := ns.Do(func() error { return nil }); !errors.Is(err, netns.ErrClosed) {
		t.Errorf("the pod's namespace after Close: %v; want %v (the Set releases it)", err, netns.ErrClosed)
	}
}

// A pod whose listener cannot bind is not started: Start fails, nothing is listed, and the
// namespace stays the caller's (inpod.Pod: the Manager keeps and closes it).
func TestStartFails(t *testing.T) {
	leaktest.Check(t)
	ns := netnstest.NewAnonymous(t)
	var taken net.Listener
	if err := ns.Do(func() (err error) {
		taken, err = net.Listen("tcp", "127.0.0.1:15006")
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	s := newSet(t)
	defer s.Close()
	if err := s.Start(testPod("u1", ns)); err == nil {
		t.Fatal("Start with 15006 taken: nil error; want the bind error")
	}
	if _, _, ok := s.Connections("u1"); ok {
		t.Error("Connections(u1) after a failed Start: running; want gone")
	}
	if err := ns.Do(func() error { return nil }); err != nil {
		t.Errorf("the pod's namespace after a failed Start: %v; want it open", err)
	}
}
