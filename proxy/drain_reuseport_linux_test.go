//go:build linux

package proxy_test

import (
	"context"
	"fmt"
	"net"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/internal/netns"
	"github.com/gozt/gozt/internal/netns/netnstest"
	"github.com/gozt/gozt/internal/netpoll"
)

// Two proxies share a SOCKS5 listener in one SO_REUSEPORT group inside a namespace with
// tcp_migrate_req, as an old and a new ztunnel share a pod's listeners during an upgrade
// (15001, 15006 and 15008 close the same way). The old one drains in the middle of a stream
// of new connections: every connection of the stream is served, by the old proxy if it
// took it before its listener closed, else by the new one. With a goroutine per listener
// and with the node-wide poller.
func TestDrainLeavesReusePortGroup(t *testing.T) {
	ns := netnstest.NewAnonymous(t)
	if err := ns.Do(func() error {
		return os.WriteFile("/proc/sys/net/ipv4/tcp_migrate_req", []byte("1"), 0)
	}); err != nil {
		t.Fatalf("tcp_migrate_req: %v", err)
	}
	p, err := netpoll.New()
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	for _, tc := range []struct {
		name   string
		poller netpoll.Poller
	}{{"goroutine per listener", netpoll.PerSocket{}}, {"epoll", p}} {
		t.Run(tc.name, func(t *testing.T) {
			leaktest.Check(t)
			testDrainLeavesReusePortGroup(t, ns, tc.poller)
		})
	}
}

func testDrainLeavesReusePortGroup(t *testing.T, ns *netns.NetNS, poller netpoll.Poller) {
	m := newMesh(t)
	var be *backend
	if err := ns.Do(func() error {
		be = startBackend(t, "127.0.0.1:0", echo)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	var nodes [2]*node
	addr := "127.0.0.1:0"
	for i := range nodes {
		cfg := m.clientConfig()
		cfg.OutboundAddr, cfg.InboundAddr, cfg.Socks5Addr = "", "", addr
		sockets := netns.Sockets{NS: ns, ReusePort: true}
		cfg.Sockets, cfg.HBONEClient.Dial = sockets, sockets.Dial
		cfg.Poller = poller
		nodes[i] = startNode(t, fmt.Sprintf("node %d", i), m.caDir, m.yaml, cfg)
		addr = nodes[i].socks(t)
	}
	connect := func(msg string) error {
		var c net.Conn
		if err := ns.Do(func() (err error) {
			c, err = net.DialTimeout("tcp", addr, 5*time.Second)
			return err
		}); err != nil {
			return err
		}
		defer c.Close()
		if code, err := socksHandshake(c, "127.0.0.1", be.port()); err != nil || code != 0 {
			return fmt.Errorf("SOCKS5 reply %d, %v", code, err)
		}
		return pingEcho(c, msg)
	}

	const n = 400
	work := make(chan int)
	var failed atomic.Int32
	var failures sync.Map // error -> count
	var wg sync.WaitGroup
	for range 16 {
		wg.Go(func() {
			for i := range work {
				if err := connect(fmt.Sprint("connection ", i)); err != nil {
					failed.Add(1)
					msg := err.Error()
					if i := strings.LastIndex(msg, ": "); i >= 0 {
						msg = msg[i+2:] // without the addresses
					}
					k, _ := failures.LoadOrStore(msg, new(atomic.Int32))
					k.(*atomic.Int32).Add(1)
				}
			}
		})
	}
	drained := make(chan error, 1)
	for i := range n {
		if i == n/4 {
			go func() {
				ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
				defer cancel()
				drained <- nodes[0].shutdown(ctx)
			}()
		}
		work <- i
	}
	close(work)
	wg.Wait()
	if f := failed.Load(); f > 0 {
		t.Errorf("%d of %d connections failed:", f, n)
		failures.Range(func(k, v any) bool {
			t.Errorf("  %dx %s", v.(*atomic.Int32).Load(), k)
			return true
		})
	}
	if err := <-drained; err != nil {
		t.Errorf("old proxy's shutdown: %v", err)
	}
	if accepted := be.accepted.Load(); accepted != n {
		t.Errorf("backend accepted %d connections; want %d", accepted, n)
	}
	// Both proxies carried some: the stream tested the group.
	for _, nd := range nodes {
		if got := counter(t, nd.reg, "istio_tcp_connections_opened_total", nil); got == 0 || got == n {
			t.Errorf("%s opened %v of the %d connections; want some, not all", nd.name, got, n)
		}
	}
}
