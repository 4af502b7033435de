package proxy

import (
	"testing"
	"time"
)

// TestReleaseAfterBurstRateLimited: the process returns memory at most once per
// releaseEvery, however many sweeps find a burst over.
func TestReleaseAfterBurstRateLimited(t *testing.T) {
	n := 0
	oldEvery, oldFree, oldLast := releaseEvery, freeMemory, lastRelease.Load()
	t.Cleanup(func() { releaseEvery, freeMemory = oldEvery, oldFree; lastRelease.Store(oldLast) })
	releaseEvery, freeMemory = time.Hour, func() { n++ }
	lastRelease.Store(0)
	for range 3 {
		releaseAfterBurst()
	}
	if n != 1 {
		t.Fatalf("3 bursts within releaseEvery released %d times; want 1", n)
	}
	lastRelease.Store(time.Now().Add(-2 * time.Hour).UnixNano())
	releaseAfterBurst()
	if n != 2 {
		t.Fatalf("a burst releaseEvery after the last release: %d releases in all; want 2", n)
	}
}
