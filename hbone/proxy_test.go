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
				io.Copy(c, c)
				c.(*net.TCPConn).CloseWrite()
			}()
		}
	}()
	return ln.Addr().String(), func() { ln.Close(); wg.Wait() }
}

// proxyTo is an inbound-proxy-like handler: CONNECT to a TCP backend, copy both ways
// with half-close, as the proxy package does (WriteTo into *net.TCPConn takes the
// frame reader's direct path).
func proxyTo(backend string) Handler {
	return func(r *Request) {
		up, err := net.Dial("tcp", backend)
		if err != nil {
			r.Reject(503)
			return
		}
		defer up.Close()
		s, err := r.Accept(nil)
		if err != nil {
			return
		}
		defer s.Close()
		done := make(chan struct{})
		go func() {
			defer close(done)
			io.Copy(up, s) // stream -> TCP: WriteTo
			up.(*net.TCPConn).CloseWrite()
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
		e := newEnv(t, Config{}, proxyTo(backend))
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
