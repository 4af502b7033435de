package netpoll

import "time"

// The delay after a failed accept or read before a socket is tried again: 5 ms, doubling
// to 1 s while the failures go on, as Go's net/http.Server backs off. Out of file
// descriptors, an accept fails and leaves the connection queued, so trying again at once
// would spin.

// nextDelay is the delay after a failure when the previous delay was prev (0 for the first).
func nextDelay(prev time.Duration) time.Duration {
	return min(max(2*prev, 5*time.Millisecond), time.Second)
}

// waitDelay waits d, or until done is closed: false then.
func waitDelay(d time.Duration, done <-chan struct{}) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-done:
		return false
	}
}
