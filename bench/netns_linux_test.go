//go:build linux

package bench

import (
	"context"
	"io"
	"net"
	"testing"
	"time"

	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/internal/netns/netnstest"
)

// A listener that exists only inside a namespace: the dialer reaches it, over IPv4 (sockets
// made ahead) and IPv6 (dialed on the namespace thread), from ordinary goroutines, and the
// same address dialed from this process's own namespace does not reach it.
func TestNetnsDialerReachesOnlyItsNamespace(t *testing.T) {
	netnstest.Require(t)
	leaktest.Check(t)
	ns := netnstest.New(t, "dialer")
	d, err := NewNetnsDialer(ns.Name)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()

	const hello = "hello from inside"
	for _, addr := range []string{"127.0.0.1:0", "[::1]:0"} {
		ln, err := d.Listen("tcp", addr)
		if err != nil && addr == "[::1]:0" {
			t.Logf("no IPv6 loopback in the namespace (%v): IPv4 only", err)
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		go func() {
			for {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				io.WriteString(c, hello)
				c.Close()
			}
		}()
		target := ln.Addr().String()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		// More dials than the dialer keeps sockets ready, in parallel.
		errs := make(chan error, 100)
		for range 100 {
			go func() {
				c, err := d.DialContext(ctx, "tcp", target)
				if err != nil {
					errs <- err
					return
				}
				defer c.Close()
				b, err := io.ReadAll(c)
				if err == nil && string(b) != hello {
					t.Errorf("%s: read %q; want %q", target, b, hello)
				}
				errs <- err
			}()
		}
		for range 100 {
			if err := <-errs; err != nil {
				t.Fatalf("dial %s in the namespace: %v", target, err)
			}
		}
		// From the root namespace the port is closed, or someone else's listener.
		if c, err := net.DialTimeout("tcp", target, time.Second); err == nil {
			c.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
			b, _ := io.ReadAll(c)
			c.Close()
			if string(b) == hello {
				t.Errorf("%s reached the namespace's listener from outside it", target)
			}
		}
	}

	if _, err := d.DialContext(context.Background(), "tcp", "localhost:80"); err == nil {
		t.Error("a name was dialed; its lookup would run outside the namespace")
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := d.DialContext(ctx, "tcp", "127.0.0.1:9"); err == nil {
		t.Error("dial with a cancelled context succeeded")
	}
	d.Close()
	d.Close() // idempotent
	if _, err := d.Listen("tcp", "127.0.0.1:0"); err == nil {
		t.Error("listen after Close succeeded")
	}
}

func TestNetnsDialerUnknownNamespace(t *testing.T) {
	if _, err := NewNetnsDialer("gozt-bench-no-such-namespace"); err == nil {
		t.Fatal("dialer started in a namespace that does not exist")
	}
}
