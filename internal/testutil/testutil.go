// Package testutil holds the small helpers the packages' tests share: waiting for an
// asynchronous effect without timing it.
package testutil

import (
	"testing"
	"time"
)

// Timeout is how long Eventually and EventuallyNil wait: long enough for a loaded CI
// machine, short enough that a hang fails the test rather than the whole run.
const Timeout = 10 * time.Second

// Eventually polls cond every 10 ms until it holds, or fails tb after Timeout with
// "timed out waiting for <what>". It waits for effects that happen after a call returns
// (a record written after a connection's last byte); it measures nothing.
func Eventually(tb testing.TB, what string, cond func() bool) {
	tb.Helper()
	for deadline := time.Now().Add(Timeout); !cond(); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			tb.Fatalf("timed out waiting for %s", what)
		}
	}
}

// EventuallyNil is Eventually for a condition that says what is still missing: it polls
// until check returns nil, or fails tb with check's last error.
func EventuallyNil(tb testing.TB, check func() error) {
	tb.Helper()
	for deadline := time.Now().Add(Timeout); ; time.Sleep(10 * time.Millisecond) {
		err := check()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			tb.Fatalf("timed out: %v", err)
		}
	}
}
