package hbone

import (
	"bytes"
	"crypto/sha256"
	"io"
	"net"
	"sync"
	"testing"

	"github.com/gozt/gozt/internal/leaktest"
)

// tcpEcho is a loopback TCP echo backend; it returns its address and a stop function.
func tcpEcho(t testing.TB) (string, func()) {
	return tcpBackend(t, func(c *net.TCPConn) {
		io.Copy(c, c)
		c.CloseWrite()
	})
}

// tcpBackend serves each connection with handle, then closes it; it returns the
// listener's address and a stop function that waits for the handlers.
func tcpBackend(t testing.TB, handle func(*net.TCPConn)) (string, func()) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				handle(c.(*net.TCPConn))
			}()
		}
	}()
	return ln.Addr().String(), func() { ln.Close(); wg.Wait() }
}

// acceptTo dials backend and accepts r, or rejects it with 503 when the dial fails. The
// caller closes both on success.
func acceptTo(r *Request, backend string) (*Stream, *net.TCPConn, bool) {
	up, err := net.Dial("tcp", backend)
	if err != nil {
		r.Reject(503)
		return nil, nil, false
	}
	s, err := r.Accept(nil)
	if err != nil {
		up.Close()
		return nil, nil, false
	}
	return s, up.(*net.TCPConn), true
}

// proxyTo is an inbound-proxy-like handler: CONNECT to a TCP backend, copy both ways
// with half-close, as the proxy package does (WriteTo into *net.TCPConn takes the
// frame reader's direct path).
func proxyTo(backend string) Handler {
	return func(r *Request) {
		s, up, ok := acceptTo(r, backend)
		if !ok {
			return
		}
		defer up.Close()
		defer s.Close()
		done := make(chan struct{})
		go func() {
			defer close(done)
			io.Copy(up, s) // stream -> TCP: WriteTo
			up.CloseWrite()
		}()
		io.Copy(s, up) // TCP -> stream: ReadFrom
		s.CloseWrite()
		<-done
	}
}

func TestProxyThroughTCPBackend(t *testing.T) {
	bothWays(t, &directDelivery, "direct", "buffered", func(t *testing.T) {
		leaktest.Check(t)
		backend, stop := tcpEcho(t)
		defer stop()
		e := newEnv(t, ServerConfig{}, proxyTo(backend))
		const size = 32 << 20
		s := e.dial(t, "10.0.0.1:80")
		defer s.Close()
		go func() {
			io.Copy(s, io.LimitReader(newPRNG(7), size))
			s.CloseWrite()
		}()
		h := sha256.New()
		n, err := io.Copy(h, s)
		if err != nil || n != size || !bytes.Equal(h.Sum(nil), hashOf(7, size)) {
			t.Fatalf("through the backend: %d of %d bytes, err %v", n, size, err)
		}
		// Small messages one at a time (the latency path).
		s2 := e.dial(t, "10.0.0.1:80")
		defer s2.Close()
		buf := make([]byte, 100)
		for i := range 50 {
			msg := bytes.Repeat([]byte{byte(i)}, 1+i)
			s2.Write(msg)
			if _, err := io.ReadFull(s2, buf[:len(msg)]); err != nil || !bytes.Equal(buf[:len(msg)], msg) {
				t.Fatalf("message %d: %q %v", i, buf[:len(msg)], err)
			}
		}
	})
}
