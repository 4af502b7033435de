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
// least and frees most. One per releaseEvery per process, whatever the proxies: the heap
// is the process's.

// burstParks is the fewest parks since the sweep last went quiet that make a burst; fewer
// leave too little behind to be worth a collection. releaseEvery bounds how often the
// process collects for it. Variables for tests.
var (
	burstParks   = 64
	releaseEvery = 10 * time.Second
	freeMemory   = debug.FreeOSMemory
)

// lastRelease is when the process last returned memory after a burst (Unix ns; 0: never).
var lastRelease atomic.Int64

// releaseAfterBurst returns the heap's garbage and free pages to the OS, unless the process
// did so less than releaseEvery ago. It blocks for one full collection: the sweep's
// goroutine calls it, with no lock held.
func releaseAfterBurst() {
	now := time.Now().UnixNano()
	last := lastRelease.Load()
	if last != 0 && now-last < int64(releaseEvery) || !lastRelease.CompareAndSwap(last, now) {
		return
	}
	freeMemory()
}
