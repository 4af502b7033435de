//go:build unix

package sockopt

import (
	"fmt"
	"syscall"
)

// RaiseFileLimit raises the soft RLIMIT_NOFILE to the hard limit (istio/ztunnel#1585) and
// returns the new soft limit. The Go runtime already does this at start on most systems
// (Go 1.19+), so this mostly confirms it and reports the figure; it matters when something
// lowered the limit since.
func RaiseFileLimit() (uint64, error) {
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		return 0, fmt.Errorf("sockopt: get RLIMIT_NOFILE: %w", err)
	}
	if lim.Cur >= lim.Max {
		return uint64(lim.Cur), nil
	}
	lim.Cur = lim.Max
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		return 0, fmt.Errorf("sockopt: raise RLIMIT_NOFILE to %d: %w", lim.Max, err)
	}
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		return 0, fmt.Errorf("sockopt: get RLIMIT_NOFILE: %w", err)
	}
	return uint64(lim.Cur), nil
}
