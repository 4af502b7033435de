//go:build !linux

package attack

// idleThread would lower the thread's priority; elsewhere the spin control runs as burn.
func idleThread() {}
