package proxy

import (
	"runtime/debug"
	"sync/atomic"
	"time"
)

// Returning memory after a burst. A burst of connection setups leaves the heap at the GC's
// goal, about twice what the connections keep: handshake and frame garbage not yet
// collected, and the stacks of the goroutines that set them up, freed but still resident.
// The runtime returns that to the OS only over minutes, so a node that took 1,000
// connections and went quiet held several MB more than they need (zbench's idle figure
// was 1.2× the Rust ztunnel's at 1,000: docs/PERFORMANCE.md, "Idle connections").
// When a sweep finds nothing left running after at least burstParks copies parked, the
// burst is over and every connection in it is idle: that is when a full collection costs
// least and frees most. One per every per process, whatever the proxies: the heap is the
// process's.

// releasePolicy says when the process returns memory after a burst.
type releasePolicy struct {
	parks int           // the fewest parks since the sweep last went quiet that make a burst; fewer leave too little behind
	every time.Duration // the least time between releases: each costs a full collection
	free  func()        // returns the memory (debug.FreeOSMemory)
}

// release is the process's policy: one pointer, swapped whole by tests, so that a sweep
// still running in another proxy reads either the old policy or the new one.
var release atomic.Pointer[releasePolicy]

func init() {
	release.Store(&releasePolicy{parks: 64, every: 10 * time.Second, free: debug.FreeOSMemory})
}

// lastRelease is when the process last returned memory after a burst (Unix ns; 0: never).
var lastRelease atomic.Int64

// releaseAfterBurst returns the heap's garbage and free pages to the OS, unless the process
// did so less than the policy's every ago. It blocks for one full collection: the sweep's
// goroutine calls it, with no lock held.
func releaseAfterBurst(pol *releasePolicy) {
	now := time.Now().UnixNano()
	last := lastRelease.Load()
	if last != 0 && now-last < int64(pol.every) || !lastRelease.CompareAndSwap(last, now) {
		return
	}
	pol.free()
}
