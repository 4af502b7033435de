package main

import (
	"errors"
	"strconv"
	"strings"
)

// workerThreads is ZTUNNEL_WORKER_THREADS: how many threads run Go code at once
// (GOMAXPROCS), sized as Rust ztunnel sizes its data-plane worker pool. A per-node proxy
// shares the node with the workloads it serves, and every extra P is another thread the
// scheduler wakes to look for work, so by default it does not spread over every core.
type workerThreads struct {
	set     bool // false: the default rule in threads
	n       int  // threads (0: every core), or a percentage of the cores when percent is set
	percent bool
}

func parseWorkerThreads(v string) (workerThreads, error) {
	if v == "" {
		return workerThreads{}, nil
	}
	num, percent := strings.CutSuffix(v, "%")
	n, err := strconv.Atoi(num)
	switch {
	case err != nil:
		return workerThreads{}, errors.New("not a number")
	case n < 0 || (percent && (n == 0 || n > 100)):
		return workerThreads{}, errors.New("out of range")
	}
	return workerThreads{set: true, n: n, percent: percent}, nil
}

// threads returns the GOMAXPROCS to run with on a machine with cores usable cores, where
// the Go runtime chose goDefault (it follows the container's CPU limit) and limit is the CPU
// limit the chart passes in ZTUNNEL_CPU_LIMIT (0: none). A limit below cores counts as the
// cores, as in the Rust ztunnel. Unset, it keeps goDefault when GOMAXPROCS was given or a CPU
// limit lowered it, and is otherwise a quarter of the cores, at least 2, as Rust ztunnel's
// default is.
func (w workerThreads) threads(cores, limit, goDefault int, gomaxprocsSet bool) int {
	limited := goDefault < cores
	if limit > 0 && limit < cores {
		cores, limited = limit, true
		if !gomaxprocsSet {
			goDefault = min(goDefault, limit)
		}
	}
	switch {
	case !w.set && (gomaxprocsSet || limited):
		return goDefault
	case !w.set:
		return min(cores, max(2, (cores+3)/4))
	case w.percent:
		return max(1, (cores*w.n+99)/100)
	case w.n == 0:
		return cores
	}
	return w.n
}
