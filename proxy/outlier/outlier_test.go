package outlier

import (
	"fmt"
	"testing"
	"testing/synctest"
	"time"

	"github.com/gozt/gozt/xds/state"
)

func TestEjection(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		d := New(Config{})
		w := &state.Workload{WorkloadMeta: &state.WorkloadMeta{Namespace: "ns"}, UID: "w1", Name: "w1"}
		e := Endpoint{w, 8080}
		other := &state.Workload{UID: "w2"}
		fail := func(wantEjected bool) {
			t.Helper()
			if got := d.Failed(e, "ns/svc"); got != wantEjected {
				t.Fatalf("Failed = %v; want %v", got, wantEjected)
			}
		}
		fail(false)
		fail(false)
		if d.Ejected(w, 8080) {
			t.Fatal("ejected after two failures")
		}
		fail(true) // the third in a row
		if !d.Ejected(w, 8080) || d.Ejected(other, 8080) {
			t.Fatalf("Ejected(w) = %v, Ejected(other) = %v; want true, false", d.Ejected(w, 8080), d.Ejected(other, 8080))
		}
		if got := d.Dump(); len(got) != 1 || got[0].Workload != "ns/w1" || got[0].Port != 8080 || got[0].Service != "ns/svc" || got[0].Ejections != 1 ||
			!got[0].Until.Equal(time.Now().Add(DefaultBase)) {
			t.Fatalf("Dump = %+v", got)
		}
		fail(false) // while ejected (nothing else was left): no longer ejection

		time.Sleep(DefaultBase)
		if d.Ejected(w, 8080) || len(d.Dump()) != 0 {
			t.Fatal("still ejected after Base")
		}
		fail(true) // probation: the first failure ejects again, twice as long
		time.Sleep(2*DefaultBase - time.Nanosecond)
		if !d.Ejected(w, 8080) {
			t.Fatal("second ejection shorter than 2×Base")
		}
		time.Sleep(time.Nanosecond)
		if d.Ejected(w, 8080) {
			t.Fatal("second ejection longer than 2×Base")
		}
		for n := 3; n < 10; n++ { // growing, capped
			fail(true)
			want := min(DefaultBase<<(n-1), DefaultMax)
			if got := time.Until(d.Dump()[0].Until); got != want {
				t.Fatalf("ejection %d lasts %v; want %v", n, got, want)
			}
			time.Sleep(want)
		}

		d.Succeeded(e) // a success forgets everything
		if d.Any() {
			t.Fatal("a record left after a success")
		}
		fail(false)
		fail(false)
		d.Succeeded(e)
		fail(false) // the count starts over
		fail(false)
		fail(true)
	})
}

// TestSweep: failures long past are forgotten, so removed workloads do not stay in the map.
func TestSweep(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		d := New(Config{})
		gone := Endpoint{&state.Workload{UID: "gone"}, 80}
		d.Failed(gone, "ns/svc")
		time.Sleep(DefaultMax + time.Second)
		d.Failed(Endpoint{&state.Workload{UID: "new"}, 80}, "ns/svc") // sweeps
		d.mu.Lock()
		_, kept := d.endpoints[gone]
		n := len(d.endpoints)
		d.mu.Unlock()
		if kept || n != 1 || len(*d.recorded.Load()) != 1 {
			t.Fatalf("after the sweep: gone kept %v, %d records, %d in the snapshot; want false, 1, 1", kept, n, len(*d.recorded.Load()))
		}
	})
}

// TestPortsApart: an endpoint is a workload and a port. Failures on one port (a service
// whose backend is gone) eject that port only: the pick still takes the workload for its
// other ports, and a success there leaves the failing port's ejection alone.
func TestPortsApart(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		d := New(Config{})
		w := &state.Workload{WorkloadMeta: &state.WorkloadMeta{Namespace: "ns"}, UID: "w1", Name: "w1"}
		dead, live := Endpoint{w, 9090}, Endpoint{w, 8080}
		for range DefaultFailures {
			d.Failed(dead, "ns/dead")
		}
		if !d.Ejected(w, 9090) || d.Ejected(w, 8080) {
			t.Fatalf("Ejected on 9090, 8080 = %v, %v; want true, false", d.Ejected(w, 9090), d.Ejected(w, 8080))
		}
		d.Succeeded(live)
		if !d.Ejected(w, 9090) {
			t.Fatal("a success on 8080 ended the ejection on 9090")
		}
		if got := d.Dump(); len(got) != 1 || got[0].Port != 9090 || got[0].Service != "ns/dead" {
			t.Fatalf("Dump = %+v; want w1 on 9090 only", got)
		}
		d.Failed(live, "ns/live")
		d.Failed(live, "ns/live")
		d.Succeeded(dead) // a success on 9090 ends its ejection and leaves 8080's count alone
		if d.Ejected(w, 9090) || len(d.Dump()) != 0 {
			t.Fatal("still ejected on 9090 after a success there")
		}
		if !d.Failed(live, "ns/live") {
			t.Fatal("the third failure on 8080 in a row did not eject it")
		}
	})
}

// TestEjectedTakesNoLock: the pick asks Ejected about every endpoint it weighs; with
// records present (an ejection, other failures) it answers while the detector's lock is
// held elsewhere, allocating nothing, and so does Succeeded for an endpoint with no record.
func TestEjectedTakesNoLock(t *testing.T) {
	d := New(Config{})
	w, v := &state.Workload{UID: "w"}, &state.Workload{UID: "v"}
	for range DefaultFailures {
		d.Failed(Endpoint{w, 80}, "ns/svc")
	}
	d.Failed(Endpoint{v, 80}, "ns/svc")
	d.mu.Lock()
	defer d.mu.Unlock()
	answered := make(chan [3]bool, 1)
	go func() {
		d.Succeeded(Endpoint{w, 81})
		answered <- [3]bool{d.Ejected(w, 80), d.Ejected(v, 80), d.Ejected(w, 81)}
	}()
	select {
	case got := <-answered:
		if got != [3]bool{true, false, false} {
			t.Errorf("Ejected(w:80, v:80, w:81) = %v; want true, false, false", got)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Succeeded or Ejected waited for the detector's lock")
	}
}

func TestEjectedAllocs(t *testing.T) {
	d := New(Config{})
	w, v := &state.Workload{UID: "w"}, &state.Workload{UID: "v"}
	for range DefaultFailures {
		d.Failed(Endpoint{w, 80}, "ns/svc")
	}
	if n := testing.AllocsPerRun(100, func() {
		d.Ejected(w, 80)
		d.Ejected(v, 80)
		d.Succeeded(Endpoint{v, 80})
	}); n != 0 {
		t.Errorf("%v allocations per pick question; want 0", n)
	}
}

// BenchmarkEjected is the pick's question with an ejection and 100 other failing endpoints
// on record, from every CPU at once.
func BenchmarkEjected(b *testing.B) {
	d := New(Config{})
	ws := make([]*state.Workload, 101)
	for i := range ws {
		ws[i] = &state.Workload{UID: fmt.Sprint(i)}
		d.Failed(Endpoint{ws[i], 80}, "ns/svc")
	}
	for range DefaultFailures {
		d.Failed(Endpoint{ws[0], 80}, "ns/svc")
	}
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		i := 0
		for pb.Next() {
			d.Ejected(ws[i%len(ws)], 80)
			i++
		}
	})
}
