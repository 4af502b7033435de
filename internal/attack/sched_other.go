//go:build !linux

package attack

import "errors"

// idleThread would lower the thread's priority; elsewhere the spin control runs as burn.
func idleThread() {}

func scheduleThread(policy string, cpus []int) error {
	if (policy == "" || policy == "normal") && len(cpus) == 0 {
		return nil
	}
	return errors.New("attack: an attacker's scheduling and CPUs are set on Linux only")
}

// processCPU would be the process's CPU seconds; elsewhere it is not measured.
func processCPU() float64 { return 0 }
