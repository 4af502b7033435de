// Package backoff is how long a loop serving a socket waits after a failed accept or read
// before it tries again: 5 ms, doubling to 1 s while the failures go on, as Go's
// net/http.Server does. Out of file descriptors, an accept fails and leaves the connection
// queued, so trying again at once would spin. It does not retry anything itself.
package backoff

import "time"

// Next is the delay after a failure when the previous delay was prev (0 for the first).
func Next(prev time.Duration) time.Duration {
	return min(max(2*prev, 5*time.Millisecond), time.Second)
}

// Wait waits d, or until done is closed: false then.
func Wait(d time.Duration, done <-chan struct{}) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-done:
		return false
	}
}
