package proxy_test

import (
	"io"
	"net"
	"strconv"
	"testing"
	"time"
)

// Two-node benchmarks: one path goes SOCKS5 → node A → HBONE (mTLS, HTTP/2) → node B →
// backend, the baseline is a plain TCP connection straight to the same backend. Each
// iteration runs once on both, alternately, so load from elsewhere on a shared machine hits
// both alike; ns/op is the mesh path's and the baseline is reported beside it.

// chunkSink reads chunks of n bytes and acknowledges each with one byte.
func chunkSink(n int) func(*net.TCPConn) {
	return func(c *net.TCPConn) {
		buf := make([]byte, 256<<10)
		for {
			for left := n; left > 0; {
				m, err := c.Read(buf[:min(left, len(buf))])
				if err != nil {
					return
				}
				left -= m
			}
			if _, err := c.Write([]byte{1}); err != nil {
				return
			}
		}
	}
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

// alternate runs op on the direct and the mesh connection once per iteration, after one
// untimed warm-up each, and returns the total time each took.
func alternate(b *testing.B, m *mesh, be *backend, op func(*net.TCPConn)) (direct, mesh time.Duration) {
	dc, mc := benchDial(b, m, be, true), benchDial(b, m, be, false)
	defer dc.Close()
	defer mc.Close()
	op(dc)
	op(mc)
	b.ResetTimer()
	for range b.N {
		t0 := time.Now()
		op(dc)
		t1 := time.Now()
		op(mc)
		direct += t1.Sub(t0)
		mesh += time.Since(t1)
	}
	b.StopTimer()
	return direct, mesh
}

// BenchmarkThroughput sends 4 MiB one way over one long-lived connection and waits for the
// backend's acknowledgement of the whole chunk.
func BenchmarkThroughput(b *testing.B) {
	const chunk = 4 << 20
	m := startMesh(b)
	be := startBackend(b, m.serverIP+":0", chunkSink(chunk))
	buf := make([]byte, 256<<10)
	direct, mesh := alternate(b, m, be, func(c *net.TCPConn) {
		for off := 0; off < chunk; off += len(buf) {
			if _, err := c.Write(buf); err != nil {
				b.Fatal(err)
			}
		}
		var ack [1]byte
		if _, err := io.ReadFull(c, ack[:]); err != nil {
			b.Fatal(err)
		}
	})
	mb := float64(b.N) * chunk / 1e6
	b.ReportMetric(float64(mesh.Nanoseconds())/float64(b.N), "ns/op")
	b.ReportMetric(mb/direct.Seconds(), "direct_MB/s")
	b.ReportMetric(mb/mesh.Seconds(), "mesh_MB/s")
	b.ReportMetric(direct.Seconds()/mesh.Seconds(), "ratio_vs_direct")
}

// BenchmarkRequestResponse sends 1 KiB and waits for its 1 KiB echo on one long-lived
// connection: the latency two proxies and the HBONE hop add.
func BenchmarkRequestResponse(b *testing.B) {
	const size = 1 << 10
	m := startMesh(b)
	be := startBackend(b, m.serverIP+":0", echo)
	req, resp := make([]byte, size), make([]byte, size)
	direct, mesh := alternate(b, m, be, func(c *net.TCPConn) {
		if _, err := c.Write(req); err != nil {
			b.Fatal(err)
		}
		if _, err := io.ReadFull(c, resp); err != nil {
			b.Fatal(err)
		}
	})
	perOp := func(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e3 / float64(b.N) }
	b.ReportMetric(perOp(mesh)*1e3, "ns/op")
	b.ReportMetric(perOp(direct), "direct_us/rtt")
	b.ReportMetric(perOp(mesh), "mesh_us/rtt")
	b.ReportMetric(mesh.Seconds()/direct.Seconds(), "ratio_vs_direct")
}
