package proxy

import "time"

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
