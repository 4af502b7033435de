package attack

import (
	"fmt"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// idleThread puts the calling thread at SCHED_IDLE: it runs only when nothing else would.
func idleThread() { unix.SchedSetAttr(0, &unix.SchedAttr{Policy: unix.SCHED_IDLE}, 0) }

// scheduleThread gives the calling thread policy (Spec.Sched) and, if any, those CPUs.
func scheduleThread(policy string, cpus []int) error {
	switch policy {
	case "idle":
		if err := unix.SchedSetAttr(0, &unix.SchedAttr{Policy: unix.SCHED_IDLE}, 0); err != nil {
			return fmt.Errorf("SCHED_IDLE: %w", err)
		}
	case "nice":
		if err := unix.Setpriority(unix.PRIO_PROCESS, 0, 19); err != nil { // 0: this thread
			return fmt.Errorf("nice 19: %w", err)
		}
	case "", "normal":
	default:
		return fmt.Errorf("attack: scheduling %q: want idle, nice or normal", policy)
	}
	if len(cpus) > 0 {
		var set unix.CPUSet
		for _, c := range cpus {
			set.Set(c)
		}
		if err := unix.SchedSetaffinity(0, &set); err != nil {
			return fmt.Errorf("CPUs %v: %w", cpus, err)
		}
	}
	return nil
}

// processCPU is the CPU seconds this process has used.
func processCPU() float64 {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano()).Seconds()
}
