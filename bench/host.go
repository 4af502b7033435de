package bench

import (
	"os"
	"path/filepath"
	"strings"
)

// haltNote returns a note for the suite's report when this machine's idle vCPUs halt
// without polling first (cpuidle's haltpoll driver with guest_halt_poll_ns=0), and "" when
// they do not or sysfs does not say. On such a host every message that finds a process
// asleep waits for its vCPU to wake: on the 2-vCPU VM this was written on, keeping both
// vCPUs awake halved ztunnel's ping-pong p50 (docs/PERFORMANCE.md, How to reproduce). sys is sysfs's root.
func haltNote(sys string) string {
	read := func(name string) string {
		b, err := os.ReadFile(filepath.Join(sys, name))
		if err != nil {
			return ""
		}
		return strings.TrimSpace(string(b))
	}
	if read("devices/system/cpu/cpuidle/current_driver") != "haltpoll" ||
		read("module/haltpoll/parameters/guest_halt_poll_ns") != "0" {
		return ""
	}
	return "idle vCPUs here halt without polling first (cpuidle haltpoll, guest_halt_poll_ns=0): " +
		"a message that finds a process asleep waits for its vCPU to wake, so the latency rows " +
		"measure the host's wake-ups about as much as the paths (docs/PERFORMANCE.md, How to reproduce)"
}
