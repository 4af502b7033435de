// Package testutil holds the small helpers the packages' tests share: waiting for an
// asynchronous effect without timing it, and reading metrics.
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
	if !poll(Timeout, cond) {
		tb.Fatalf("timed out waiting for %s", what)
	}
}

// EventuallyNil is Eventually for a condition that says what is still missing: it polls
// until check returns nil, or fails tb with check's last error.
func EventuallyNil(tb testing.TB, check func() error) {
	tb.Helper()
	if err := Poll(Timeout, check); err != nil {
		tb.Fatalf("timed out: %v", err)
	}
}

// Poll calls check every 10 ms until it returns nil, for at most within, and returns
// check's last error: nil once it held. It is EventuallyNil for a test that reports the
// failure itself (with t.Errorf, to go on to its other checks) or that waits longer than
// Timeout (a process starting under -race).
func Poll(within time.Duration, check func() error) error {
	var err error
	poll(within, func() bool { err = check(); return err == nil })
	return err
}

// poll calls cond every 10 ms until it holds (true) or within has passed (false).
func poll(within time.Duration, cond func() bool) bool {
	for deadline := time.Now().Add(within); !cond(); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			return false
		}
	}
	return true
}
