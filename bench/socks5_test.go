package bench

import (
	"context"
	"encoding/binary"
	"io"
	"net"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gozt/gozt/internal/leaktest"
)

// socksServer is a minimal SOCKS5 CONNECT server: enough to check the client against the
// RFC 1928 byte layout. It resolves "localhost" itself and refuses the port in refuse.
type socksServer struct {
	ln     net.Listener
	refuse int
	wg     sync.WaitGroup

	mu    sync.Mutex
	seen  []string // target as the client sent it: "atyp host:port"
	conns []net.Conn
}

func startSOCKS(t *testing.T, refuse int) *socksServer {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &socksServer{ln: ln, refuse: refuse}
	s.wg.Add(1)
	go s.acceptLoop()
	t.Cleanup(func() {
		ln.Close()
		s.mu.Lock()
		for _, c := range s.conns {
			c.Close()
		}
		s.mu.Unlock()
		s.wg.Wait()
	})
	return s
}

func (s *socksServer) acceptLoop() {
	defer s.wg.Done()
	for {
		c, err := s.ln.Accept()
		if err != nil {
			return
		}
		s.mu.Lock()
		s.conns = append(s.conns, c)
		s.mu.Unlock()
		s.wg.Add(1)
		go s.serve(c)
	}
}

func (s *socksServer) serve(c net.Conn) {
	defer s.wg.Done()
	defer c.Close()
	hdr := make([]byte, 3)
	if _, err := io.ReadFull(c, hdr); err != nil || hdr[0] != 5 || hdr[1] != 1 || hdr[2] != 0 {
		return
	}
	c.Write([]byte{5, 0})
	req := make([]byte, 4)
	if _, err := io.ReadFull(c, req); err != nil || req[0] != 5 || req[1] != 1 {
		return
	}
	var host string
	switch req[3] {
	case 1, 4:
		ip := make([]byte, 4+12*int(req[3]/4))
		io.ReadFull(c, ip)
		host = net.IP(ip).String()
	case 3:
		l := make([]byte, 1)
		io.ReadFull(c, l)
		name := make([]byte, l[0])
		io.ReadFull(c, name)
		host = string(name)
	}
	pb := make([]byte, 2)
	io.ReadFull(c, pb)
	port := int(binary.BigEndian.Uint16(pb))
	s.mu.Lock()
	s.seen = append(s.seen, strconv.Itoa(int(req[3]))+" "+net.JoinHostPort(host, strconv.Itoa(port)))
	s.mu.Unlock()
	if port == s.refuse {
		c.Write([]byte{5, 5, 0, 1, 0, 0, 0, 0, 0, 0})
		return
	}
	if host == "localhost" {
		host = "127.0.0.1"
	}
	up, err := net.Dial("tcp", net.JoinHostPort(host, strconv.Itoa(port)))
	if err != nil {
		c.Write([]byte{5, 1, 0, 1, 0, 0, 0, 0, 0, 0})
		return
	}
	defer up.Close()
	// Reply with a domain-typed bound address, which the client must skip correctly.
	c.Write([]byte{5, 0, 0, 3, 4, 'h', 'o', 's', 't', 0x1f, 0x90})
	done := make(chan struct{})
	go func() { io.Copy(up, c); closeWrite(up); close(done) }()
	io.Copy(c, up)
	closeWrite(c)
	<-done
}

func TestSOCKS5Client(t *testing.T) {
	leaktest.Check(t)
	srv := startServer(t, ModeEcho)
	_, port, _ := net.SplitHostPort(srv.Addr().String())
	socks := startSOCKS(t, 1)

	for _, tc := range []struct{ addr, seen string }{
		{"127.0.0.1:" + port, "1 127.0.0.1:" + port},
		{"localhost:" + port, "3 localhost:" + port},
	} {
		res, err := Run(context.Background(), "pingpong", Target{Addr: tc.addr, SOCKS5: socks.ln.Addr().String()},
			Options{Count: 20})
		if err != nil {
			t.Fatalf("%s: %v", tc.addr, err)
		}
		if res.Ops != 20 {
			t.Errorf("%s: %d round trips; want 20", tc.addr, res.Ops)
		}
		socks.mu.Lock()
		last := socks.seen[len(socks.seen)-1]
		socks.mu.Unlock()
		if last != tc.seen {
			t.Errorf("proxy saw %q; want %q", last, tc.seen)
		}
	}
	// Half-close passes through the proxy, so bulk echo works too.
	if _, err := Run(context.Background(), "throughput", Target{Addr: "localhost:" + port, SOCKS5: socks.ln.Addr().String()},
		Options{Duration: 100 * time.Millisecond}); err != nil {
		t.Fatal(err)
	}
}

func TestSOCKS5ClientReportsRefusal(t *testing.T) {
	leaktest.Check(t)
	socks := startSOCKS(t, 9)
	_, err := Target{Addr: "127.0.0.1:9", SOCKS5: socks.ln.Addr().String()}.Dial(context.Background())
	if err == nil || !strings.Contains(err.Error(), "connection refused (5)") {
		t.Fatalf("err = %v; want the proxy's refusal", err)
	}
}

func TestSOCKS5ClientTimesOut(t *testing.T) {
	leaktest.Check(t)
	// A listener that accepts and never answers.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	start := time.Now()
	_, err = Target{Addr: "127.0.0.1:9", SOCKS5: ln.Addr().String(), DialTimeout: 100 * time.Millisecond}.Dial(context.Background())
	if err == nil {
		t.Fatal("dial through a silent proxy succeeded")
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("took %v; want about the 100ms timeout", d)
	}
}
