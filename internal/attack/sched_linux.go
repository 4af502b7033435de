package attack

import "golang.org/x/sys/unix"

// idleThread puts the calling thread at SCHED_IDLE: it runs only when nothing else would.
func idleThread() { unix.SchedSetAttr(0, &unix.SchedAttr{Policy: unix.SCHED_IDLE}, 0) }
