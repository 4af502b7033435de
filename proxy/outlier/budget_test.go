package outlier

import (
	"testing"

	"github.com/gozt/gozt/xds/state"
)

// TestRetryBudget: retries in flight to a service are held to a fifth of its connects in
// flight, at least three; each service has its own; a retry that fails again asks anew;
// and a service's entry goes with its last connect.
func TestRetryBudget(t *testing.T) {
	b := NewRetryBudget()
	busy := &state.Service{Namespace: "ns", Hostname: "busy"}
	quiet := &state.Service{Namespace: "ns", Hostname: "quiet"}
	retries := func(fs []Flight) (granted int) {
		for i := range fs {
			if fs[i].Retry() {
				granted++
			}
		}
		return granted
	}
	many := make([]Flight, 30)
	for i := range many {
		many[i] = b.Begin(busy)
	}
	few := []Flight{b.Begin(quiet), b.Begin(quiet)}
	if got := retries(many); got != 6 {
		t.Errorf("30 connects in flight: %d retries granted; want 6 (20%%)", got)
	}
	if got := retries(few); got != 2 {
		t.Errorf("2 connects in flight: %d retries granted; want 2 (under the floor of 3)", got)
	}
	// The refused end; the six that retry now count against six connects: the floor, 3.
	held := many[:0]
	for i := range many {
		if many[i].retrying {
			held = append(held, many[i])
		} else {
			many[i].End()
		}
	}
	if got := retries(held); got != 3 {
		// Each gives its retry back before asking: the first three find 5, 4 and 3 in
		// flight, not under the floor; the last three find 2 and take one.
		t.Errorf("6 connects in flight, each asking again: %d granted; want 3", got)
	}
	for i := range held {
		held[i].End()
	}
	for i := range few {
		few[i].End()
		few[i].End() // a second End does nothing
	}
	if n := len(b.services); n != 0 {
		t.Errorf("%d services left in the budget after every connect ended; want none", n)
	}
	var none *RetryBudget
	f := none.Begin(busy)
	if !f.Retry() {
		t.Error("a nil budget refused a retry")
	}
	f.End()
}

func TestRetryBudgetAllocs(t *testing.T) {
	b := NewRetryBudget()
	svc := &state.Service{Namespace: "ns", Hostname: "svc"}
	if n := testing.AllocsPerRun(1000, func() {
		f := b.Begin(svc)
		f.Retry()
		f.End()
	}); n != 0 {
		t.Errorf("%v allocations per connect; want 0", n)
	}
}
