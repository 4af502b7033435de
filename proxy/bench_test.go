package proxy_test

import (
	"io"
	"net"
	"strconv"
	"syscall"
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

// BenchmarkDoubleHBONE sends 4 MiB one way through node A to a sink on its own network
// (single HBONE to node B) and to one on another network (double HBONE: HBONE inside
// HBONE through the east-west gateway to node C), alternately, on two long-lived
// connections. Every peer runs in this process, so the CPU figures (the process's
// user+system time per GB, getrusage) include the client, sink and, for double HBONE, the
// gateway's raw relay.
func BenchmarkDoubleHBONE(b *testing.B) {
	m := startMultinet(b)
	dial := func(vip string) *net.TCPConn {
		c, code, err := socksConnect(m.a.socks(b), vip, 80)
		if err != nil {
			b.Fatalf("socks5 %s: code %d: %v", vip, code, err)
		}
		return c
	}
	single, double := dial("127.10.9.7"), dial("127.10.9.8")
	defer single.Close()
	defer double.Close()
	buf := make([]byte, 256<<10)
	send := func(c *net.TCPConn) (time.Duration, time.Duration) {
		cpu0, t0 := processCPU(), time.Now()
		for off := 0; off < benchChunk; off += len(buf) {
			if _, err := c.Write(buf); err != nil {
				b.Fatal(err)
			}
		}
		var ack [1]byte
		if _, err := io.ReadFull(c, ack[:]); err != nil {
			b.Fatal(err)
		}
		return time.Since(t0), processCPU() - cpu0
	}
	send(single)
	send(double)
	var sWall, sCPU, dWall, dCPU time.Duration
	b.ResetTimer()
	for range b.N {
		w, c := send(single)
		sWall, sCPU = sWall+w, sCPU+c
		w, c = send(double)
		dWall, dCPU = dWall+w, dCPU+c
	}
	b.StopTimer()
	gb := float64(b.N) * benchChunk / 1e9
	b.ReportMetric(float64(dWall.Nanoseconds())/float64(b.N), "ns/op")
	b.ReportMetric(gb*1e3/sWall.Seconds(), "single_MB/s")
	b.ReportMetric(gb*1e3/dWall.Seconds(), "double_MB/s")
	b.ReportMetric(sCPU.Seconds()/gb, "single_CPU-s/GB")
	b.ReportMetric(dCPU.Seconds()/gb, "double_CPU-s/GB")
}

// processCPU is the process's user+system CPU time so far.
func processCPU() time.Duration {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// BenchmarkDoubleHBONEConnect opens and closes a connection through node A per iteration,
// to the single and the double HBONE sink alternately, timing until node A's SOCKS5 reply
// (sent once the tunnel is up). Single HBONE reuses its pooled connection to node B; double
// HBONE reuses the one to the gateway but makes a new inner TLS and HTTP/2 connection.
func BenchmarkDoubleHBONEConnect(b *testing.B) {
	m := startMultinet(b)
	open := func(vip string) (time.Duration, time.Duration) {
		cpu0, t0 := processCPU(), time.Now()
		c, code, err := socksConnect(m.a.socks(b), vip, 80)
		if err != nil {
			b.Fatalf("socks5 %s: code %d: %v", vip, code, err)
		}
		w, cpu := time.Since(t0), processCPU()-cpu0
		c.Close()
		return w, cpu
	}
	open("127.10.9.7")
	open("127.10.9.8")
	var sWall, sCPU, dWall, dCPU time.Duration
	b.ResetTimer()
	for range b.N {
		w, c := open("127.10.9.7")
		sWall, sCPU = sWall+w, sCPU+c
		w, c = open("127.10.9.8")
		dWall, dCPU = dWall+w, dCPU+c
	}
	b.StopTimer()
	n := float64(b.N)
	b.ReportMetric(float64(dWall.Nanoseconds())/n, "ns/op")
	b.ReportMetric(float64(sWall.Microseconds())/n, "single_us/connect")
	b.ReportMetric(float64(dWall.Microseconds())/n, "double_us/connect")
	b.ReportMetric(float64(sCPU.Microseconds())/n, "single_CPU-us/connect")
	b.ReportMetric(float64(dCPU.Microseconds())/n, "double_CPU-us/connect")
}
