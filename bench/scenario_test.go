package bench

import (
	"context"
	"errors"
	"io"
	"testing"
	"time"

	"github.com/gozt/gozt/internal/leaktest"
)

func TestScenariosDirect(t *testing.T) {
	leaktest.Check(t)
	srv := startServer(t, ModeEcho)
	target := Target{Addr: srv.Addr().String()}
	for _, tc := range []struct {
		scenario string
		opts     Options
	}{
		{"throughput", Options{Duration: 200 * time.Millisecond, Conns: 2}},
		{"rr", Options{Duration: 200 * time.Millisecond, Conns: 2, Rate: 500}},
		{"pingpong", Options{Count: 300, Conns: 3}},
		{"connrate", Options{Count: 50, Conns: 2}},
		{"idle", Options{Duration: 10 * time.Millisecond, Conns: 20}},
	} {
		t.Run(tc.scenario, func(t *testing.T) {
			res, err := Run(context.Background(), tc.scenario, target, tc.opts)
			if err != nil {
				t.Fatal(err)
			}
			if res.Bytes <= 0 || res.Ops <= 0 || res.Elapsed <= 0 {
				t.Errorf("bytes %d ops %d elapsed %v; want all > 0", res.Bytes, res.Ops, res.Elapsed)
			}
			// Runs end when their work does, not at a drain timeout (that was a bug once).
			if res.Elapsed > tc.opts.Duration+drainGrace/2 {
				t.Errorf("run took %v for %v of load", res.Elapsed, tc.opts.Duration)
			}
			switch tc.scenario {
			case "rr":
				if want := int64(100); res.Ops != want || res.Missed != 0 {
					t.Errorf("rr answered %d, missed %d; want %d, 0", res.Ops, res.Missed, want)
				}
			case "pingpong":
				if res.Ops != 300 || res.Latency.Count() != 300 {
					t.Errorf("pingpong ops %d; want 300", res.Ops)
				}
			case "connrate":
				if res.Ops != 50 {
					t.Errorf("connrate ops %d; want 50", res.Ops)
				}
			case "idle":
				if res.IdleConns != 20 {
					t.Errorf("idle held %d; want 20", res.IdleConns)
				}
			}
			if res.Latency != nil && (res.Summary == nil || res.Summary.P50 <= 0 || res.Summary.Max < res.Summary.P99) {
				t.Errorf("latency summary %+v; want p50 > 0 and max >= p99", res.Summary)
			}
		})
	}
}

func TestEveryScenarioDetectsCorruption(t *testing.T) {
	leaktest.Check(t)
	bad := startManglingEcho(t, 10)
	target := Target{Addr: bad.addr()}
	for _, tc := range []struct {
		scenario string
		opts     Options
	}{
		{"throughput", Options{Duration: 100 * time.Millisecond}},
		{"rr", Options{Duration: 100 * time.Millisecond, Rate: 200}},
		{"pingpong", Options{Count: 10}},
		{"connrate", Options{Count: 5}},
		{"idle", Options{Duration: time.Millisecond, Conns: 3}},
	} {
		t.Run(tc.scenario, func(t *testing.T) {
			_, err := Run(context.Background(), tc.scenario, target, tc.opts)
			if !errors.Is(err, ErrCorrupt) {
				t.Fatalf("err = %v; want ErrCorrupt", err)
			}
		})
	}
}

func TestThroughputDirections(t *testing.T) {
	leaktest.Check(t)
	for _, tc := range []struct {
		dir  string
		mode Mode
	}{{"echo", ModeEcho}, {"up", ModeSink}, {"down", ModeSource}, {"down", ModeEcho}} {
		t.Run(tc.dir+"/"+string(tc.mode), func(t *testing.T) {
			srv := startServer(t, tc.mode)
			res, err := Run(context.Background(), "throughput", Target{Addr: srv.Addr().String()},
				Options{Duration: 150 * time.Millisecond, Conns: 2, Direction: tc.dir})
			if err != nil {
				t.Fatal(err)
			}
			if res.Bytes < 1<<20 {
				t.Errorf("moved %d bytes in 150ms on loopback; want at least 1 MiB", res.Bytes)
			}
		})
	}
}

// An echo server serves only a connection that opens with the whole SourceRequest as a
// source; bytes that merely start like it are echoed, also when the client half-closes
// before the request could be complete.
func TestEchoServesSourceOnlyOnTheWholeRequest(t *testing.T) {
	leaktest.Check(t)
	srv := startServer(t, ModeEcho)
	for _, sent := range []string{"Z", SourceRequest[:8], SourceRequest[:15] + "x", "hello"} {
		c, err := Target{Addr: srv.Addr().String()}.Dial(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		if _, err := io.WriteString(c, sent); err != nil {
			t.Fatal(err)
		}
		closeWrite(c)
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		got, err := io.ReadAll(c)
		c.Close()
		if err != nil || string(got) != sent {
			t.Errorf("sent %q and half-closed: got %q, %v; want the same bytes echoed, then EOF", sent, got, err)
		}
	}
}

func TestThroughputUpDetectsCorruptionAtSink(t *testing.T) {
	leaktest.Check(t)
	srv := startServer(t, ModeSink)
	c, err := Target{Addr: srv.Addr().String()}.Dial(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	data := append([]byte(nil), patternAt(0, 5000)...)
	data[4000] ^= 1
	if _, err := c.Write(data); err != nil {
		t.Fatal(err)
	}
	closeWrite(c)
	var reply [9]byte
	if _, err := c.Read(reply[:]); err != nil {
		t.Fatal(err)
	}
	if reply[8] != 1 {
		t.Errorf("sink status %d for a corrupted stream; want 1", reply[8])
	}
}

func TestRunStopsOnCancel(t *testing.T) {
	leaktest.Check(t)
	srv := startServer(t, ModeEcho)
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(100*time.Millisecond, cancel)
	start := time.Now()
	_, err := Run(ctx, "throughput", Target{Addr: srv.Addr().String()}, Options{Duration: time.Minute})
	if err == nil {
		t.Error("cancelled run returned no error")
	}
	if d := time.Since(start); d > 10*time.Second {
		t.Errorf("cancelled run took %v", d)
	}
}

func TestUnknownScenario(t *testing.T) {
	if _, err := Run(context.Background(), "nope", Target{}, Options{}); err == nil {
		t.Fatal("unknown scenario accepted")
	}
}
