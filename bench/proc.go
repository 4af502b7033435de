package bench

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"os"
	"strconv"
	"strings"
	"time"
)

// userHZ is the unit of utime/stime in /proc/PID/stat; Linux fixes it at 100 for user space.
const userHZ = 100

// Proc names a process whose resource use a scenario charges to the path under test. Its
// descendants count too (nginx's workers, a shell's child).
type Proc struct {
	Name string `json:"name"`
	PID  int    `json:"pid"`
}

// ProcStat is one reading of a process's /proc files.
type ProcStat struct {
	PID  int
	PPID int
	CPU  time.Duration // user + system time so far, all threads
	RSS  int64         // resident set size now, bytes (VmRSS)
	Anon int64         // its private anonymous part (RssAnon): heap and stacks, not mapped files
	HWM  int64         // peak resident set size since start, bytes (VmHWM)
}

// ReadProc reads /proc/PID/stat and /proc/PID/status.
func ReadProc(pid int) (ProcStat, error) {
	st := ProcStat{PID: pid}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return st, fmt.Errorf("bench: %w", err)
	}
	if st.PPID, st.CPU, err = parseStat(b); err != nil {
		return st, fmt.Errorf("bench: /proc/%d/stat: %w", pid, err)
	}

	b, err = os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return st, fmt.Errorf("bench: %w", err)
	}
	for line := range strings.SplitSeq(string(b), "\n") {
		k, v, ok := strings.Cut(line, ":")
		if !ok {
			continue
		}
		switch k {
		case "VmRSS":
			st.RSS = parseKB(v)
		case "RssAnon":
			st.Anon = parseKB(v)
		case "VmHWM":
			st.HWM = parseKB(v)
		}
	}
	return st, nil
}

// parseStat reads the parent pid and the CPU time (utime + stime) from /proc/PID/stat. The
// command name (field 2) is in parentheses and may hold spaces and parentheses; fields after
// the last ')' are plain: state ppid ... utime(14) stime(15).
func parseStat(b []byte) (ppid int, cpu time.Duration, err error) {
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, 0, errors.New("no command name")
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 13 {
		return 0, 0, fmt.Errorf("%d fields after the command name", len(f))
	}
	ppid, err = strconv.Atoi(f[1])
	if err != nil {
		return 0, 0, errors.New("bad parent pid")
	}
	utime, err1 := strconv.ParseUint(f[11], 10, 63)
	stime, err2 := strconv.ParseUint(f[12], 10, 63)
	if err1 != nil || err2 != nil || utime+stime > math.MaxInt64/uint64(time.Second) {
		return 0, 0, errors.New("bad cpu times")
	}
	return ppid, time.Duration(utime+stime) * time.Second / userHZ, nil
}

// parseKB parses "   1234 kB" into bytes.
func parseKB(v string) int64 {
	n, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
	return n << 10
}

// processTree returns pid followed by all of its living descendants.
func processTree(pid int) []int {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return []int{pid}
	}
	children := make(map[int][]int)
	for _, e := range ents {
		p, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue
		}
		pp, _, err := parseStat(b)
		if err != nil {
			continue
		}
		children[pp] = append(children[pp], p)
	}
	tree := []int{pid}
	for i := 0; i < len(tree); i++ {
		tree = append(tree, children[tree[i]]...)
	}
	return tree
}

// treeStat sums a process tree's readings; processes that vanished are skipped.
func treeStat(pids []int) ProcStat {
	var sum ProcStat
	for _, p := range pids {
		st, err := ReadProc(p)
		if err != nil {
			continue
		}
		sum.CPU += st.CPU
		sum.RSS += st.RSS
		sum.Anon += st.Anon
		sum.HWM += st.HWM
	}
	if len(pids) > 0 {
		sum.PID = pids[0]
	}
	return sum
}

// ProcUsage is what one named process tree used during a scenario.
type ProcUsage struct {
	Proc
	CPUSeconds float64 `json:"cpu_seconds"`     // user + system, whole tree
	PeakRSS    int64   `json:"peak_rss_bytes"`  // highest sampled VmRSS sum during the run
	PeakAnon   int64   `json:"peak_anon_bytes"` // highest sampled RssAnon sum: RSS less mapped files (binary, libraries)
	HWM        int64   `json:"hwm_bytes"`       // VmHWM sum at the end: peak since the process started
}
