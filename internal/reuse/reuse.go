// Package reuse keeps a goroutine for the next piece of work. A goroutine's stack keeps
// the size its deepest call needed, and growing a fresh one (copying it, walking its
// frames) costs more than handing the work to a goroutine that has just done the same.
package reuse

import "time"

// Loop runs run(v), then run on each value from next, until none has come for idle or
// done is closed. Callers hand work over with a non-blocking send on next and start a new
// goroutine running Loop when no goroutine is waiting.
func Loop[T any](v T, run func(T), next <-chan T, done <-chan struct{}, idle time.Duration) {
	t := time.NewTimer(idle)
	defer t.Stop()
	for {
		run(v)
		t.Reset(idle)
		select {
		case v = <-next:
		case <-t.C:
			return
		case <-done:
			return
		}
	}
}
