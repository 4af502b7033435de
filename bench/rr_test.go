package bench

import (
	"context"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/gozt/gozt/internal/leaktest"
)

// arrivalEcho echoes 1 KiB requests and notes when each one arrived.
type arrivalEcho struct {
	ln net.Listener
	wg sync.WaitGroup

	mu       sync.Mutex
	arrivals []time.Time
}

func (a *arrivalEcho) serve() {
	defer a.wg.Done()
	c, err := a.ln.Accept()
	if err != nil {
		return
	}
	defer c.Close()
	buf := make([]byte, 1024)
	for {
		if _, err := io.ReadFull(c, buf); err != nil {
			return
		}
		now := time.Now()
		a.mu.Lock()
		a.arrivals = append(a.arrivals, now)
		a.mu.Unlock()
		if _, err := c.Write(buf); err != nil {
			return
		}
	}
}

func TestRRRateWithinTwoPercent(t *testing.T) {
	leaktest.Check(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	a := &arrivalEcho{ln: ln}
	a.wg.Add(1)
	go a.serve()
	defer func() { ln.Close(); a.wg.Wait() }()

	const rate, dur = 1000.0, 1500 * time.Millisecond
	res, err := Run(context.Background(), "rr", Target{Addr: ln.Addr().String()},
		Options{Duration: dur, Rate: rate, Payload: 1024})
	if err != nil {
		t.Fatal(err)
	}
	if want := int64(rate * dur.Seconds()); res.Ops != want || res.Missed != 0 {
		t.Errorf("answered %d, missed %d; want %d, 0", res.Ops, res.Missed, want)
	}
	a.mu.Lock()
	arr := a.arrivals
	a.mu.Unlock()
	if len(arr) < 2 {
		t.Fatalf("server saw %d requests", len(arr))
	}
	// The rate the server saw: the least-squares slope of arrival time against request
	// number, which one late arrival at either end cannot tilt the way first-to-last can.
	var sx, sy, sxx, sxy float64
	for i, at := range arr {
		x, y := float64(i), at.Sub(arr[0]).Seconds()
		sx, sy, sxx, sxy = sx+x, sy+y, sxx+x*x, sxy+x*y
	}
	n := float64(len(arr))
	got := 1 / ((n*sxy - sx*sy) / (n*sxx - sx*sx))
	if got < rate*0.98 || got > rate*1.02 {
		t.Errorf("server saw %.1f requests/s; want %.0f ± 2%%", got, rate)
	}
	// Steady, not bursts that average out: the median 100 ms window holds about 100
	// requests. (Single windows may not: a loaded machine stalls the sender for tens of ms.)
	var windows []float64
	for w := 1; w < 14; w++ {
		from, to := arr[0].Add(time.Duration(w)*100*time.Millisecond), arr[0].Add(time.Duration(w+1)*100*time.Millisecond)
		n := 0
		for _, at := range arr {
			if !at.Before(from) && at.Before(to) {
				n++
			}
		}
		windows = append(windows, float64(n))
	}
	if m := median(windows); m < 95 || m > 105 {
		t.Errorf("median 100ms window held %v requests (all: %v); want 100 ± 5", m, windows)
	}
}

// A stall in the path must show in rr's latencies even though the sender is blocked for
// its duration: latency is measured from the scheduled send time.
func TestRRIsCoordinatedOmissionSafe(t *testing.T) {
	leaktest.Check(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	wg.Go(func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		buf := make([]byte, 1024)
		for i := 0; ; i++ {
			if _, err := io.ReadFull(c, buf); err != nil {
				return
			}
			if i == 50 {
				time.Sleep(200 * time.Millisecond) // one stall, a fifth of the run
			}
			if _, err := c.Write(buf); err != nil {
				return
			}
		}
	})
	defer func() { ln.Close(); wg.Wait() }()
	res, err := Run(context.Background(), "rr", Target{Addr: ln.Addr().String()},
		Options{Duration: time.Second, Rate: 500})
	if err != nil {
		t.Fatal(err)
	}
	// The stall delays ~100 scheduled requests (200 ms at 500/s) by up to 200 ms: about 10%
	// of them wait at least 100 ms. A closed-loop measurement would show one slow request.
	if p90 := res.Latency.Percentile(90); p90 < 20*time.Millisecond {
		t.Errorf("p90 = %v after a 200ms stall; want the stall visible (>= 20ms)", p90)
	}
	if mx := res.Latency.Max(); mx < 190*time.Millisecond {
		t.Errorf("max = %v; want >= 190ms", mx)
	}
}
