//go:build linux

package hbone

import (
	"context"
	"crypto/tls"
	"io"
	"net"
	"net/netip"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/gozt/gozt/internal/leaktest"
)

// A connection whose handshake went through internal/ktls but stays in user space (its
// peer negotiated plain "h2": the Rust ztunnel, every mixed pair of a migration) must
// read as a crypto/tls connection does, not one record per read(2).

// readCounter is a TCP connection (a ktls.TCPWrapper, so the handshake can go through
// internal/ktls over it) that counts its reads, and those that returned no more than a
// TLS record header.
type readCounter struct {
	*net.TCPConn
	reads, tiny atomic.Int64
}

func (r *readCounter) Read(p []byte) (int, error) {
	n, err := r.TCPConn.Read(p)
	r.reads.Add(1)
	if n > 0 && n <= 5 {
		r.tiny.Add(1)
	}
	return n, err
}

func (r *readCounter) TCP() *net.TCPConn { return r.TCPConn }

// h2Peer is an HBONE server offering only "h2" and a pool dialing it, both allowed
// kernel TLS (asked of the kernel as always where it has TLS; elsewhere the question is
// skipped, so the handshake goes through internal/ktls all the same), their sockets
// counting reads: the client's and the server's are sent on client and server.
type h2Peer struct {
	pool           *Pool
	key            Key
	client, server chan *readCounter
}

func newH2Peer(t testing.TB, h Handler) *h2Peer {
	t.Helper()
	if !kernelHasTLS(t) {
		old := kernelAvailable
		kernelAvailable = func(*net.TCPConn) error { return nil }
		t.Cleanup(func() { kernelAvailable = old })
	}
	testCA()
	h2Only := srvTLS.Clone()
	h2Only.NextProtos = []string{"h2"}
	p := &h2Peer{client: make(chan *readCounter, 1), server: make(chan *readCounter, 1)}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := NewServer(ServerConfig{}, h)
	serveEach(t, ln, srv, func(ctx context.Context, raw net.Conn) {
		rc := &readCounter{TCPConn: raw.(*net.TCPConn)}
		offer(p.server, rc)
		srv.ServeTLS(ctx, rc, h2Only)
	})
	dial := func(ctx context.Context, d *net.Dialer, network, address string) (net.Conn, error) {
		c, err := d.DialContext(ctx, network, address)
		if err != nil {
			return nil, err
		}
		rc := &readCounter{TCPConn: c.(*net.TCPConn)}
		offer(p.client, rc)
		return rc, nil
	}
	p.pool = NewPool(ClientConfig{Dial: dial}, func(context.Context, Key) (*tls.Config, error) { return cliTLS, nil })
	t.Cleanup(func() { p.pool.Close() })
	p.key = NewKey(mustID(clientID), ids(serverID), netip.MustParseAddrPort(ln.Addr().String()), z0)
	return p
}

// offer sends rc on ch unless ch is full (a test looks at the first connection only).
func offer(ch chan *readCounter, rc *readCounter) {
	select {
	case ch <- rc:
	default:
	}
}

func (p *h2Peer) dial(t testing.TB) *Stream {
	t.Helper()
	s, err := p.pool.Dial(context.Background(), p.key, "10.0.0.1:80", nil)
	if err != nil {
		t.Fatalf("Dial: %v", err)
	}
	return s
}

// TestKernelTLSH2PeerReadsInBulk: with an "h2" peer both ends stay in crypto/tls after a
// handshake through internal/ktls, and from then on read as plain crypto/tls does, many
// bytes a read, not a record header and then its body (one read(2) each).
func TestKernelTLSH2PeerReadsInBulk(t *testing.T) {
	leaktest.Check(t)
	serverConn := make(chan *conn, 1)
	p := newH2Peer(t, func(r *Request) {
		s, err := r.Accept(nil)
		if err != nil {
			return
		}
		serverConn <- s.c
		defer s.Close()
		io.Copy(s, s)
		s.CloseWrite()
	})
	s := p.dial(t)
	defer s.Close()
	hashEcho(t, s, 5, 4<<20)
	sc := <-serverConn
	for _, side := range []struct {
		name string
		rc   *readCounter
		c    *conn
	}{{"client", <-p.client, s.c}, {"server", <-p.server, sc}} {
		if side.c.kt.conn != nil || side.c.bc == nil {
			t.Fatalf("%s: not on the user-space path", side.name)
		}
		records := int64(side.c.bc.rx.n.Load())
		reads, tiny := side.rc.reads.Load(), side.rc.tiny.Load()
		t.Logf("%s: %d records received in %d reads, %d of them of a header's size or less", side.name, records, reads, tiny)
		if records < 200 {
			t.Fatalf("%s: %d records for 4 MiB", side.name, records)
		}
		if tiny*4 > records {
			t.Errorf("%s: %d of %d reads returned a record header or less, for %d records: still record by record", side.name, tiny, reads, records)
		}
	}
}

// BenchmarkH2PeerRatio compares two HBONE connections in one run, taking turns: one to
// an "h2" peer with kernel TLS allowed at both ends (its handshake through internal/ktls,
// then kept in user space), one with kernel TLS disabled (crypto/tls from the start).
// h2/plain is the plain connection's time over the h2 peer's (1: the handshake through
// internal/ktls costs nothing after it); CPU is the process's, user and system, both
// ends. bulk: 8 MiB client to server per op and side; rr1k: 100 round trips of 1 KiB.
func BenchmarkH2PeerRatio(b *testing.B) {
	if !kernelHasTLS(b) {
		b.Log("no kernel TLS here: the h2 peer's handshake goes through internal/ktls, without the TLS ULP")
	}
	b.Run("bulk", func(b *testing.B) {
		const burst = 8 << 20
		got := make(chan int64)
		sink := func(r *Request) {
			s, err := r.Accept(nil)
			if err != nil {
				return
			}
			defer s.Close()
			for {
				n, err := io.CopyN(io.Discard, s, burst)
				if err != nil {
					return
				}
				got <- n
			}
		}
		buf := make([]byte, benchChunk)
		send := func(s *Stream) {
			for range burst / benchChunk {
				if _, err := s.Write(buf); err != nil {
					b.Fatal(err)
				}
			}
			<-got
		}
		b.SetBytes(2 * burst)
		h2, plain := h2PeerTurns(b, sink, send)
		gb := float64(b.N) * burst / 1e9
		b.ReportMetric(gb*8/h2.wall.Seconds(), "h2-Gbit/s")
		b.ReportMetric(gb*8/plain.wall.Seconds(), "plain-Gbit/s")
		b.ReportMetric(h2.cpu.Seconds()/gb, "h2-cpu-s/GB")
		b.ReportMetric(plain.cpu.Seconds()/gb, "plain-cpu-s/GB")
	})
	b.Run("rr1k", func(b *testing.B) {
		const trips = 100
		out, in := make([]byte, 1024), make([]byte, 1024)
		rt := func(s *Stream) {
			for range trips {
				if _, err := s.Write(out); err != nil {
					b.Fatal(err)
				}
				if _, err := io.ReadFull(s, in); err != nil {
					b.Fatal(err)
				}
			}
		}
		h2, plain := h2PeerTurns(b, echo, rt)
		n := float64(b.N * trips)
		b.ReportMetric(float64(h2.wall.Microseconds())/n, "h2-µs/rt")
		b.ReportMetric(float64(plain.wall.Microseconds())/n, "plain-µs/rt")
		b.ReportMetric(float64(h2.cpu.Microseconds())/n, "h2-cpu-µs/rt")
		b.ReportMetric(float64(plain.cpu.Microseconds())/n, "plain-cpu-µs/rt")
	})
}

// turns is the time one side of BenchmarkH2PeerRatio took.
type turns struct{ wall, cpu time.Duration }

// h2PeerTurns runs op b.N times on a stream to an h2 peer and on a plain one, taking
// turns, and reports h2/plain.
func h2PeerTurns(b *testing.B, h Handler, op func(*Stream)) (h2, plain turns) {
	hs := newH2Peer(b, h).dial(b)
	defer hs.Close()
	ps := newEnv(b, ServerConfig{Config: Config{DisableKernelTLS: true}}, h).dial(b, "10.0.0.1:80")
	defer ps.Close()
	if hs.KernelTLS() || ps.KernelTLS() {
		b.Fatal("a connection went to kernel TLS")
	}
	run := func(s *Stream, t *turns) {
		c0, start := cpuTime(b), time.Now()
		op(s)
		t.wall += time.Since(start)
		t.cpu += cpuTime(b) - c0
	}
	b.ResetTimer()
	for i := range b.N {
		if i%2 == 0 {
			run(hs, &h2)
			run(ps, &plain)
		} else {
			run(ps, &plain)
			run(hs, &h2)
		}
	}
	b.StopTimer()
	b.ReportMetric(float64(plain.wall)/float64(h2.wall), "h2/plain")
	b.ReportMetric(float64(plain.cpu)/float64(h2.cpu), "h2/plain-cpu")
	return h2, plain
}

// cpuTime is the process's CPU time so far, user and system.
func cpuTime(t testing.TB) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		t.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
