package bench

import (
	"fmt"
	"path/filepath"
	"runtime"

	"golang.org/x/sys/unix"
)

// spinWhileParentLives is a shell busy loop that ends once its parent has exited: it
// compares its parent now (the fourth field of /proc/$$/stat) with the one it started
// under. kill -0 $PPID would not do, as it succeeds on a parent that is not yet reaped.
const spinWhileParentLives = `while read -r _ _ _ ppid _ </proc/$$/stat && [ "$ppid" = "$PPID" ]; do :; done`

// keepAwake starts one busy loop per CPU under SCHED_IDLE, so that no vCPU halts while the
// suite runs: on a host whose idle vCPUs halt without polling first (see haltNote), a
// message that finds a process asleep then need not wait for its vCPU to wake, and the
// latency rows measure the paths rather than the host's idle states. SCHED_IDLE runs a loop
// only when nothing else wants its CPU and gives way at once when something does, so the
// paths lose little CPU to it; the loops are not charged to any path. The caller stops
// the returned children; a loop also ends by itself once zbench is gone, killed or not.
func keepAwake(work string) ([]*child, error) {
	var loops []*child
	for i := range runtime.NumCPU() {
		c, err := startChild("awake", filepath.Join(work, fmt.Sprintf("awake-%d.log", i)), nil, work,
			"/bin/sh", "-c", spinWhileParentLives)
		if err == nil {
			loops = append(loops, c)
			err = unix.SchedSetAttr(c.pid(), &unix.SchedAttr{Size: unix.SizeofSchedAttr, Policy: unix.SCHED_IDLE}, 0)
		}
		if err != nil {
			stopAll(loops)
			return nil, fmt.Errorf("bench: keep vCPUs awake: %w", err)
		}
	}
	return loops, nil
}
