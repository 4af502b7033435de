//go:build linux

package proxy_test

import (
	"io"
	"net"
	"testing"
	"time"

	"github.com/gozt/gozt/proxy"
)

// BenchmarkIdleConnect opens a connection through both nodes, makes one round trip and
// closes it, with parking on and off alternately in one process: what the parkable copy
// costs a short connection (CPU of the whole process per connection, wall per connection).
func BenchmarkIdleConnect(b *testing.B) {
	m := startMesh(b)
	be := startBackend(b, m.serverIP+":0", echo)
	one := func() {
		c, _, err := socksConnect(m.a.socks(b), m.serverIP, be.port())
		if err != nil {
			b.Fatal(err)
		}
		buf := make([]byte, 64)
		c.Write(buf)
		if _, err := io.ReadFull(c, buf); err != nil {
			b.Fatal(err)
		}
		c.Close()
	}
	one()
	var wall, cpu [2]time.Duration
	b.ResetTimer()
	for i := range b.N {
		off := i%2 == 1
		proxy.SetIdleSweep(b, 100*time.Millisecond, off)
		c0, t0 := processCPU(), time.Now()
		for range 20 {
			one()
		}
		k := 0
		if off {
			k = 1
		}
		wall[k] += time.Since(t0)
		cpu[k] += processCPU() - c0
	}
	b.StopTimer()
	n := float64(b.N) / 2 * 20
	b.ReportMetric(float64(cpu[0].Microseconds())/n, "park_CPU-us/conn")
	b.ReportMetric(float64(cpu[1].Microseconds())/n, "nopark_CPU-us/conn")
	b.ReportMetric(float64(wall[0].Microseconds())/n, "park_us/conn")
	b.ReportMetric(float64(wall[1].Microseconds())/n, "nopark_us/conn")
}

// BenchmarkIdleRR makes 1 KiB request/response round trips, in blocks of 200 alternately on
// a connection opened with parking on and one opened with it off: what the sweep's wake-ups
// cost a busy connection (CPU of the whole process and wall per round trip).
func BenchmarkIdleRR(b *testing.B) {
	m := startMesh(b)
	be := startBackend(b, m.serverIP+":0", echo)
	dial := func(off bool) *net.TCPConn {
		proxy.SetIdleSweep(b, 100*time.Millisecond, off)
		c, _, err := socksConnect(m.a.socks(b), m.serverIP, be.port())
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { c.Close() })
		return c
	}
	conns := [2]*net.TCPConn{dial(false), dial(true)}
	req, resp := make([]byte, 1024), make([]byte, 1024)
	var wall, cpu [2]time.Duration
	b.ResetTimer()
	for i := range b.N {
		k := i % 2
		c0, t0 := processCPU(), time.Now()
		for range 200 {
			if _, err := conns[k].Write(req); err != nil {
				b.Fatal(err)
			}
			if _, err := io.ReadFull(conns[k], resp); err != nil {
				b.Fatal(err)
			}
		}
		wall[k] += time.Since(t0)
		cpu[k] += processCPU() - c0
	}
	b.StopTimer()
	n := float64(b.N) / 2 * 200
	b.ReportMetric(float64(cpu[0].Nanoseconds())/n/1e3, "park_CPU-us/rt")
	b.ReportMetric(float64(cpu[1].Nanoseconds())/n/1e3, "nopark_CPU-us/rt")
	b.ReportMetric(float64(wall[0].Nanoseconds())/n/1e3, "park_us/rt")
	b.ReportMetric(float64(wall[1].Nanoseconds())/n/1e3, "nopark_us/rt")
}
