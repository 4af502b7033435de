package proxy

import (
	"testing"
	"time"
)

// TestReleaseAfterBurstRateLimited: the process returns memory at most once per the
// policy's every, however many sweeps find a burst over.
func TestReleaseAfterBurstRateLimited(t *testing.T) {
	n := 0
	pol := &releasePolicy{parks: 1, every: time.Hour, free: func() { n++ }}
	oldLast := lastRelease.Swap(0)
	t.Cleanup(func() { lastRelease.Store(oldLast) })
	for range 3 {
		releaseAfterBurst(pol)
	}
	if n != 1 {
		t.Fatalf("3 bursts within an hour released %d times; want 1", n)
	}
	lastRelease.Store(time.Now().Add(-2 * time.Hour).UnixNano())
	releaseAfterBurst(pol)
	if n != 2 {
		t.Fatalf("a burst two hours after the last release: %d releases in all; want 2", n)
	}
}
