package proxy

import (
	"sync/atomic"
	"time"
)

// SetSetupIdle sets how long setup goroutines wait for the next connection until the test
// ends, for tests that must not depend on how fast the machine is.
func SetSetupIdle(tb interface{ Cleanup(func()) }, d time.Duration) {
	old := setupIdle
	setupIdle = d
	tb.Cleanup(func() { setupIdle = old })
}

// OnLocalWait makes f be called each time p starts waiting for a local workload the store
// does not have yet.
func (p *Proxy) OnLocalWait(f func()) { p.testHookLocalWait.Store(&f) }

// SetIdleSweep sets how often idle connections are looked for (they park after one to two
// sweeps with nothing read) until the test ends; off keeps every copy on its goroutine.
func SetIdleSweep(tb interface{ Cleanup(func()) }, d time.Duration, off bool) {
	oldSweep, oldPark := idleSweep, parkIdle
	idleSweep, parkIdle = d, !off
	tb.Cleanup(func() { idleSweep, parkIdle = oldSweep, oldPark })
}

// Parked counts p's copy directions parked in the poller: one per parked TCP socket ↔
// HBONE stream connection (socket → stream), up to two per TCP ↔ TCP connection.
func (p *Proxy) Parked() int {
	n := 0
	for _, c := range p.conns.snapshot() {
		if s := &c.copy; s.p != nil {
			s.mu.Lock()
			for _, pm := range []*pump{&s.up, &s.down} {
				if pm.state == copyParked {
					n++
				}
			}
			s.mu.Unlock()
		}
	}
	return n
}

// SetBurstRelease sets the parks that make a burst and the least time between releases
// until the test ends, and counts the releases (the runtime's memory is left alone).
func SetBurstRelease(tb interface{ Cleanup(func()) }, parks int, every time.Duration) (released func() int64) {
	var n atomic.Int64
	old := release.Swap(&releasePolicy{parks: parks, every: every, free: func() { n.Add(1) }})
	oldLast := lastRelease.Swap(0)
	tb.Cleanup(func() {
		release.Store(old)
		lastRelease.Store(oldLast)
	})
	return n.Load
}

// SweepQuiet reports whether p's idle sweep has stopped: nothing was running at its last
// visit.
func (p *Proxy) SweepQuiet() bool {
	p.runMu.Lock()
	defer p.runMu.Unlock()
	return !p.sweepArmed
}
