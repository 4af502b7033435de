package proxy_test

import (
	"errors"
	"io"
	"log/slog"
	"net"
	"syscall"
	"testing"
	"time"

	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/internal/testutil"
	"github.com/gozt/gozt/proxy"
)

// startMeshResets is startMesh with reset propagation on (the default) or off on both
// nodes.
func startMeshResets(t *testing.T, on bool) *mesh {
	t.Helper()
	m := newMesh(t)
	bcfg, acfg := m.serverConfig(), m.clientConfig()
	bcfg.DisableResetPropagation, acfg.DisableResetPropagation = !on, !on
	m.b = startNode(t, "node-b", m.caDir, m.yaml, bcfg)
	m.a = startNode(t, "node-a", m.caDir, m.yaml, acfg)
	return m
}

// wantEnd reads c to its end and checks how it ended: a reset (ECONNRESET) or a clean
// FIN (io.EOF).
func wantEnd(t *testing.T, who string, c net.Conn, reset bool) {
	t.Helper()
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	n, err := io.Copy(io.Discard, c)
	switch {
	case reset && !errors.Is(err, syscall.ECONNRESET):
		t.Errorf("%s: read %d more bytes, then %v; want a connection reset", who, n, err)
	case !reset && err != nil:
		t.Errorf("%s: read %d more bytes, then %v; want a clean EOF", who, n, err)
	}
}

func resetConn(c *net.TCPConn) {
	c.SetLinger(0)
	c.Close()
}

// TestResetsCarried: through two nodes (SOCKS5 into node A, HBONE to node B, TCP to the
// backend), a reset at either end reaches the other end as a reset: node B carries the
// backend's as RST_STREAM(CONNECT_ERROR), node A turns that into a reset of its client,
// and the other way round (RFC 9113 §8.5). A half-close stays a half-close, and a
// connection node A accepted but refuses (here: one to its own port) gets a reset. With
// DisableResetPropagation, each reset arrives as a FIN, as from the Rust ztunnel.
func TestResetsCarried(t *testing.T) {
	for _, on := range []bool{true, false} {
		name := "propagated"
		if !on {
			name = "disabled"
		}
		t.Run(name, func(t *testing.T) {
			leaktest.Check(t)
			m := startMeshResets(t, on)
			type backendConn struct {
				c    *net.TCPConn
				done chan struct{}
			}
			conns := make(chan backendConn, 4)
			be := startBackend(t, m.serverIP+":0", func(c *net.TCPConn) {
				buf := make([]byte, 5)
				if _, err := io.ReadFull(c, buf); err != nil {
					return
				}
				c.Write(make([]byte, 1000))
				bc := backendConn{c, make(chan struct{})}
				conns <- bc
				<-bc.done // the test ends this connection its own way
			})
			open := func() (*net.TCPConn, backendConn) {
				t.Helper()
				c, _, err := socksConnect(m.a.socks(t), m.serverIP, be.port())
				if err != nil {
					t.Fatal(err)
				}
				c.Write([]byte("hello"))
				if _, err := io.ReadFull(c, make([]byte, 1000)); err != nil {
					t.Fatal(err)
				}
				return c, <-conns
			}

			t.Run("backend resets", func(t *testing.T) {
				c, bc := open()
				defer c.Close()
				resetConn(bc.c)
				close(bc.done)
				wantEnd(t, "client", c, on)
			})
			t.Run("client resets", func(t *testing.T) {
				c, bc := open()
				defer close(bc.done)
				resetConn(c)
				wantEnd(t, "backend", bc.c, on)
			})
			t.Run("half-close stays a half-close", func(t *testing.T) {
				c, bc := open()
				defer c.Close()
				defer close(bc.done)
				c.CloseWrite()
				bc.c.SetReadDeadline(time.Now().Add(10 * time.Second))
				if n, err := io.Copy(io.Discard, bc.c); n != 0 || err != nil {
					t.Fatalf("backend after the client's FIN: %d bytes, %v; want a clean EOF", n, err)
				}
				if _, err := bc.c.Write([]byte("late answer")); err != nil {
					t.Fatal(err)
				}
				bc.c.CloseWrite()
				c.SetReadDeadline(time.Now().Add(10 * time.Second))
				got, err := io.ReadAll(c)
				if string(got) != "late answer" || err != nil {
					t.Fatalf("client read %q, %v; want the answer sent after its FIN, then EOF", got, err)
				}
			})
			t.Run("refused after accept", func(t *testing.T) {
				c, err := net.Dial("tcp", m.a.addr(t, proxy.ListenerOutbound)) // its own port: refused
				if on && errors.Is(err, syscall.ECONNRESET) {
					return // the reset came before connect(2) returned
				}
				if err != nil {
					t.Fatal(err)
				}
				defer c.Close()
				wantEnd(t, "client of a refused connection", c, on)
			})
		})
	}
}

// TestPeerCancelIsFailure: node B closes a live connection (here a DENY policy; a node
// shutting down does the same) with RST_STREAM(CANCEL) after its backend had already ended
// its side. Node A's client, still sending, must see a reset, and node A must record the
// connection as failed: a write refused by a peer that gave the stream up is no clean end
// and no TCP reset to carry (only CONNECT_ERROR is one). The soak caught node A logging
// such a connection as a success once, when a killed node B's CANCEL beat its closing
// connection.
func TestPeerCancelIsFailure(t *testing.T) {
	leaktest.Check(t)
	checkFDs(t)
	m := newMesh(t)
	m.b = startNode(t, "node-b", m.caDir, m.yaml, m.serverConfig())
	logA := newAccessLog()
	m.a = startNodeLogged(t, "node-a", m.caDir, m.yaml, m.clientConfig(), slog.New(logA))
	be := startBackend(t, m.serverIP+":0", func(c *net.TCPConn) {
		if _, err := c.Write([]byte("hello")); err == nil && c.CloseWrite() == nil {
			io.Copy(io.Discard, c) // until node B closes the connection
		}
	})
	start := time.Now()
	c, _, err := socksConnect(m.a.socks(t), m.serverIP, be.port())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	if got, err := io.ReadAll(c); err != nil || string(got) != "hello" {
		t.Fatalf("read %q, %v; want hello and the backend's FIN", got, err)
	}
	m.b.store.Apply(denyClient("deny-live"))
	var werr error
	for werr == nil {
		_, werr = c.Write(make([]byte, 4096))
	}
	if !errors.Is(werr, syscall.ECONNRESET) && !errors.Is(werr, syscall.EPIPE) {
		t.Errorf("client's write after node B closed the stream: %v; want a reset", werr)
	}
	testutil.EventuallyNil(t, func() error {
		if !logA.flagged(c.LocalAddr().String(), start) {
			return errors.New("node A wrote no ERROR access-log record for the connection node B cancelled")
		}
		return nil
	})
}
