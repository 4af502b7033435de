package main

import (
	"fmt"
	"os"
	"runtime"
	"strings"
	"syscall"
)

// The Go runtime's sysmon thread parks when every P is idle, and the next system call
// wakes it to poll every 20 µs for a millisecond or more before it backs off. A proxy goes
// idle between almost every message, so each request paid a futex wake of sysmon and a
// burst of its polls. On the 2-vCPU VMs measured here that was about half of both nodes'
// CPU at 1000 requests/s (ARCHITECTURE decision 10). With GODEBUG's schedtrace set,
// sysmon never parks: it polls, backing off to once per 10 ms while nothing needs it. The
// runtime reads GODEBUG only as it starts, so the node re-executes itself with it set.

// sysmonPolling is the GODEBUG setting that keeps sysmon polling. Its value is the
// scheduler-summary period in milliseconds, the longest the runtime accepts (24.8 days),
// so that summary line (to stderr) is printed at most that often.
const sysmonPolling = "schedtrace=2147483647"

// withSysmonPolling returns godebug with sysmonPolling added, and whether it changed.
// A schedtrace the operator set stays as it is: GODEBUG=schedtrace=0 turns this off.
func withSysmonPolling(godebug string) (string, bool) {
	for kv := range strings.SplitSeq(godebug, ",") {
		if key, _, _ := strings.Cut(kv, "="); strings.TrimSpace(key) == "schedtrace" {
			return godebug, false
		}
	}
	if strings.TrimSpace(godebug) == "" {
		return sysmonPolling, true
	}
	return godebug + "," + sysmonPolling, true
}

// reexecWithSysmonPolling replaces this process (same PID, arguments and environment)
// with itself run with withSysmonPolling's GODEBUG. It returns when there is nothing to
// change, off Linux, or when the exec failed; the node then runs with the runtime's
// default, which is correct, only costlier.
func reexecWithSysmonPolling() {
	godebug, changed := withSysmonPolling(os.Getenv("GODEBUG"))
	if !changed || runtime.GOOS != "linux" {
		return
	}
	env := []string{"GODEBUG=" + godebug}
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "GODEBUG=") {
			env = append(env, kv)
		}
	}
	// Not /proc/self/exe: the kernel names a process after the file it executes, and ps,
	// top and pkill would show "exe".
	exe, err := os.Executable()
	if err == nil {
		err = syscall.Exec(exe, os.Args, env)
	}
	fmt.Fprintf(os.Stderr, "ztunnel: warning: could not re-execute with GODEBUG=%s (%v); running with the runtime's default scheduler polling\n", godebug, err)
}
