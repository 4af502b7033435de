package attack

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"runtime"
	"runtime/metrics"
	"runtime/trace"
	"slices"
	"sync"
	"time"
)

// Victim is what an honest client saw in a round: its round trips' latencies, and this
// process's goroutine peak, scheduler latency and CPU meanwhile.
type Victim struct {
	P50, P99   time.Duration
	SchedP99   time.Duration // how long runnable goroutines waited to run, p99
	Goroutines int           // the most this process had
	CPU        float64       // CPU this process used, seconds a second (Linux; else 0)
}

// RoundTrips makes n round trips of size bytes on c, rate a second, each timed from its
// write to the last byte of its echo, and returns what it saw. Each round trip is a
// runtime/trace region named "roundtrip", so that a trace of the round (-test.trace) shows
// what the slow ones waited for.
func RoundTrips(c net.Conn, n, rate, size int) (Victim, error) {
	msg := bytes.Repeat([]byte("v"), size)
	buf := make([]byte, size)
	sched0, cpu0, start := schedLatencies(), processCPU(), time.Now()
	stopPeak := GoroutinePeak()
	lat := make([]time.Duration, 0, n)
	next := time.Now()
	for range n {
		time.Sleep(time.Until(next))
		next = next.Add(time.Second / time.Duration(rate))
		t0 := time.Now()
		region := trace.StartRegion(context.Background(), "roundtrip")
		if _, err := c.Write(msg); err != nil {
			stopPeak()
			return Victim{}, fmt.Errorf("round trip %d: %w", len(lat), err)
		}
		if _, err := io.ReadFull(c, buf); err != nil {
			stopPeak()
			return Victim{}, fmt.Errorf("round trip %d: %w", len(lat), err)
		}
		region.End()
		lat = append(lat, time.Since(t0))
	}
	slices.Sort(lat)
	return Victim{
		P50: lat[len(lat)/2], P99: lat[len(lat)*99/100],
		SchedP99: quantile(sched0, schedLatencies(), 0.99), Goroutines: stopPeak(),
		CPU: (processCPU() - cpu0) / time.Since(start).Seconds(),
	}, nil
}

// GoroutinePeak samples this process's goroutines every 2 ms until the returned function
// is called, which returns the most seen.
func GoroutinePeak() (stop func() int) {
	done := make(chan struct{})
	peak := 0
	var wg sync.WaitGroup
	wg.Go(func() {
		tick := time.NewTicker(2 * time.Millisecond)
		defer tick.Stop()
		for {
			peak = max(peak, runtime.NumGoroutine())
			select {
			case <-done:
				return
			case <-tick.C:
			}
		}
	})
	return sync.OnceValue(func() int { close(done); wg.Wait(); return peak })
}

// schedLatencies is the Go scheduler's histogram of how long goroutines waited to run.
func schedLatencies() *metrics.Float64Histogram {
	s := []metrics.Sample{{Name: "/sched/latencies:seconds"}}
	metrics.Read(s)
	return s[0].Value.Float64Histogram()
}

// quantile is the q quantile of what after counted beyond before (the upper bound of the
// bucket it falls in).
func quantile(before, after *metrics.Float64Histogram, q float64) time.Duration {
	var total uint64
	for i := range after.Counts {
		total += after.Counts[i] - before.Counts[i]
	}
	want := uint64(float64(total) * q)
	var seen uint64
	for i := range after.Counts {
		if seen += after.Counts[i] - before.Counts[i]; seen > want {
			return time.Duration(after.Buckets[i+1] * float64(time.Second))
		}
	}
	return 0
}
