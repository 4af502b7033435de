package proxy_test

import (
	"encoding/binary"
	"io"
	"net"
	"strconv"
	"testing"
	"time"
)

// Two-node benchmarks: the timed part goes SOCKS5 → node A → HBONE (mTLS, HTTP/2) → node B
// → backend; a plain TCP connection straight to the same backend is measured in the same
// run (timer stopped) and reported beside it, since absolute figures on a shared machine
// mean little.

// sink reads everything, then answers the byte count (8 bytes, big endian).
func sink(c *net.TCPConn) {
	n, err := io.Copy(io.Discard, c)
	if err != nil {
		return
	}
	_, _ = c.Write(binary.BigEndian.AppendUint64(nil, uint64(n)))
	_ = c.CloseWrite()
}

func benchDial(b *testing.B, m *mesh, be *backend, direct bool) *net.TCPConn {
	b.Helper()
	if direct {
		c, err := net.Dial("tcp", net.JoinHostPort(m.serverIP, strconv.Itoa(int(be.port()))))
		if err != nil {
			b.Fatal(err)
		}
		return c.(*net.TCPConn)
	}
	c, code, err := socksConnect(m.a.socks(b), m.serverIP, be.port())
	if err != nil {
		b.Fatalf("socks5: code %d: %v", code, err)
	}
	return c
}

// BenchmarkThroughput streams b.N chunks of 4 MiB one way over one connection and waits
// for the backend to confirm it read them all.
func BenchmarkThroughput(b *testing.B) {
	const chunk = 4 << 20
	m := startMesh(b)
	be := startBackend(b, m.serverIP+":0", sink)
	buf := make([]byte, 256<<10)
	stream := func(direct bool) time.Duration {
		c := benchDial(b, m, be, direct)
		defer c.Close()
		start := time.Now()
		for range b.N {
			for off := 0; off < chunk; off += len(buf) {
				if _, err := c.Write(buf); err != nil {
					b.Fatal(err)
				}
			}
		}
		if err := c.CloseWrite(); err != nil {
			b.Fatal(err)
		}
		var got [8]byte
		if _, err := io.ReadFull(c, got[:]); err != nil {
			b.Fatal(err)
		}
		if n := binary.BigEndian.Uint64(got[:]); n != uint64(b.N)*chunk {
			b.Fatalf("backend read %d bytes, want %d", n, uint64(b.N)*chunk)
		}
		return time.Since(start)
	}
	b.StopTimer()
	direct := stream(true)
	b.StartTimer()
	mesh := stream(false)
	b.StopTimer()
	mb := float64(b.N) * chunk / 1e6
	b.SetBytes(chunk)
	b.ReportMetric(mb/direct.Seconds(), "direct_MB/s")
	b.ReportMetric(mb/mesh.Seconds(), "mesh_MB/s")
	b.ReportMetric(direct.Seconds()/mesh.Seconds(), "ratio_vs_direct")
}

// BenchmarkRequestResponse sends 1 KiB and waits for its 1 KiB echo, b.N times on one
// connection: the added latency of two proxies and the HBONE hop.
func BenchmarkRequestResponse(b *testing.B) {
	const size = 1 << 10
	m := startMesh(b)
	be := startBackend(b, m.serverIP+":0", echo)
	req, resp := make([]byte, size), make([]byte, size)
	pingPong := func(direct bool) time.Duration {
		c := benchDial(b, m, be, direct)
		defer c.Close()
		// One warm-up round trip: connection set-up is not what this measures.
		roundTrip := func() {
			if _, err := c.Write(req); err != nil {
				b.Fatal(err)
			}
			if _, err := io.ReadFull(c, resp); err != nil {
				b.Fatal(err)
			}
		}
		roundTrip()
		start := time.Now()
		for range b.N {
			roundTrip()
		}
		return time.Since(start)
	}
	b.StopTimer()
	direct := pingPong(true)
	b.StartTimer()
	mesh := pingPong(false)
	b.StopTimer()
	perOp := func(d time.Duration) float64 { return float64(d.Microseconds()) / float64(b.N) }
	b.ReportMetric(perOp(direct), "direct_us/rtt")
	b.ReportMetric(perOp(mesh), "mesh_us/rtt")
	b.ReportMetric(mesh.Seconds()/direct.Seconds(), "ratio_vs_direct")
}
