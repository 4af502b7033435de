package outlier

import (
	"testing"
	"testing/synctest"
	"time"

	"github.com/gozt/gozt/xds/state"
)

func TestEjection(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		d := New(Config{})
		w := &state.Workload{WorkloadMeta: &state.WorkloadMeta{Namespace: "ns"}, UID: "w1", Name: "w1"}
		other := &state.Workload{UID: "w2"}
		fail := func(wantEjected bool) {
			t.Helper()
			if got := d.Failed(w, "ns/svc"); got != wantEjected {
				t.Fatalf("Failed = %v; want %v", got, wantEjected)
			}
		}
		fail(false)
		fail(false)
		if d.Ejected(w) {
			t.Fatal("ejected after two failures")
		}
		fail(true) // the third in a row
		if !d.Ejected(w) || d.Ejected(other) {
			t.Fatalf("Ejected(w) = %v, Ejected(other) = %v; want true, false", d.Ejected(w), d.Ejected(other))
		}
		if got := d.Dump(); len(got) != 1 || got[0].Workload != "ns/w1" || got[0].Service != "ns/svc" || got[0].Ejections != 1 ||
			!got[0].Until.Equal(time.Now().Add(DefaultBase)) {
			t.Fatalf("Dump = %+v", got)
		}
		fail(false) // while ejected (nothing else was left): no longer ejection

		time.Sleep(DefaultBase)
		if d.Ejected(w) || len(d.Dump()) != 0 {
			t.Fatal("still ejected after Base")
		}
		fail(true) // probation: the first failure ejects again, twice as long
		time.Sleep(2*DefaultBase - time.Nanosecond)
		if !d.Ejected(w) {
			t.Fatal("second ejection shorter than 2×Base")
		}
		time.Sleep(time.Nanosecond)
		if d.Ejected(w) {
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

		d.Succeeded(w) // a success forgets everything
		if d.Any() {
			t.Fatal("a record left after a success")
		}
		fail(false)
		fail(false)
		d.Succeeded(w)
		fail(false) // the count starts over
		fail(false)
		fail(true)
	})
}

// TestSweep: failures long past are forgotten, so removed workloads do not stay in the map.
func TestSweep(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		d := New(Config{})
		gone := &state.Workload{UID: "gone"}
		d.Failed(gone, "ns/svc")
		time.Sleep(DefaultMax + time.Second)
		d.Failed(&state.Workload{UID: "new"}, "ns/svc") // sweeps
		d.mu.Lock()
		_, kept := d.endpoints[gone]
		n := len(d.endpoints)
		d.mu.Unlock()
		if kept || n != 1 {
			t.Fatalf("after the sweep: gone kept %v, %d records; want false, 1", kept, n)
		}
	})
}
