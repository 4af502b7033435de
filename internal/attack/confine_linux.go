package attack

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// confine puts process pid in a CPU cgroup of its own that may use cpus CPUs (cgroup v1's
// cpu controller, else v2's cpu.max), as if the attacker ran on a machine that size. On a
// mesh the attacker runs on another node, whose CPU is not the attacked node's; on a
// 2-core test machine an unconfined attacker takes its CPU from the node and the victim,
// which measures the machine's contention rather than the node's handling of the attack.
// release removes the cgroup once the process has exited.
func confine(pid int, cpus float64) (release func(), err error) {
	const period = 100000 // µs
	quota := strconv.Itoa(int(cpus * period))
	name := fmt.Sprintf("gozt-attack-%d", pid)
	var dir string
	var files [][2]string
	if v1 := "/sys/fs/cgroup/cpu"; exists(filepath.Join(v1, "cpu.cfs_quota_us")) {
		dir = filepath.Join(v1, name)
		files = [][2]string{{"cpu.cfs_period_us", strconv.Itoa(period)}, {"cpu.cfs_quota_us", quota}}
	} else if ctl, _ := os.ReadFile("/sys/fs/cgroup/cgroup.controllers"); strings.Contains(string(ctl), "cpu") {
		_ = os.WriteFile("/sys/fs/cgroup/cgroup.subtree_control", []byte("+cpu"), 0)
		dir = filepath.Join("/sys/fs/cgroup", name)
		files = [][2]string{{"cpu.max", quota + " " + strconv.Itoa(period)}}
	} else {
		return nil, fmt.Errorf("attack: no cgroup cpu controller to confine the attacker to %g CPUs", cpus)
	}
	if err := os.Mkdir(dir, 0o755); err != nil {
		return nil, fmt.Errorf("attack: confine: %w", err)
	}
	release = func() { os.Remove(dir) }
	for _, f := range append(files, [2]string{"cgroup.procs", strconv.Itoa(pid)}) {
		if err := os.WriteFile(filepath.Join(dir, f[0]), []byte(f[1]), 0); err != nil {
			release()
			return nil, fmt.Errorf("attack: confine: %s: %w", f[0], err)
		}
	}
	return release, nil
}

func exists(path string) bool {
	_, err := os.Stat(path)
	return err == nil
}
