//go:build linux

package interop

import (
	"maps"
	"os"
	"slices"
	"strings"
	"testing"
)

// compareObserved returns one difference per case on which the pairs disagree:
// "CASE: gozt-gozt=X, gozt-rs=Y, ...".
func compareObserved(obs observed) []string {
	var diffs []string
	for _, kase := range slices.Sorted(maps.Keys(obs)) {
		byPair := obs[kase]
		var parts []string
		same := true
		for _, p := range pairs {
			name := pairName(p)
			out, ok := byPair[name]
			if !ok {
				continue
			}
			if len(parts) > 0 && out != byPair[pairName(pairs[0])] {
				same = false
			}
			parts = append(parts, name+"="+out)
		}
		if !same {
			diffs = append(diffs, kase+": "+strings.Join(parts, ", "))
		}
	}
	return diffs
}

// knownDifferences reads testdata/differences.txt: entries "TEST: DIFFERENCE" at the start
// of a line, each followed by indented lines saying why it is deliberate or not yet fixed.
// Lines starting with # are comments.
func knownDifferences(t *testing.T) map[string]string {
	t.Helper()
	b, err := os.ReadFile("testdata/differences.txt")
	if err != nil {
		t.Fatal(err)
	}
	known := map[string]string{}
	var last string
	for line := range strings.SplitSeq(string(b), "\n") {
		switch {
		case strings.HasPrefix(line, "#") || strings.TrimSpace(line) == "":
		case strings.HasPrefix(line, " ") || strings.HasPrefix(line, "\t"):
			if last == "" {
				t.Fatalf("testdata/differences.txt: reason before any entry: %q", line)
			}
			known[last] += strings.TrimSpace(line) + " "
		default:
			last = line
			known[last] = ""
		}
	}
	for entry, why := range known {
		if why == "" {
			t.Errorf("testdata/differences.txt: %q has no reason", entry)
		}
	}
	return known
}

// checkDifferences fails t for every difference of test not listed in
// testdata/differences.txt, and, when t has otherwise passed, for every listed one of test
// that no longer shows (so the list stays short and true).
func checkDifferences(t *testing.T, test string, diffs []string) {
	t.Helper()
	known := knownDifferences(t)
	seen := map[string]bool{}
	for _, d := range diffs {
		entry := test + ": " + d
		seen[entry] = true
		if _, ok := known[entry]; !ok {
			t.Errorf("a difference from the Rust ztunnel that testdata/differences.txt does not list (fix it, or list it with the reason):\n%s", entry)
		} else {
			t.Logf("known difference: %s", entry)
		}
	}
	if t.Failed() {
		return
	}
	for entry := range known {
		if strings.HasPrefix(entry, test+": ") && !seen[entry] {
			t.Errorf("testdata/differences.txt lists a difference that no longer shows; remove it:\n%s", entry)
		}
	}
}

func joinLines(l []string) string { return strings.Join(l, "\n") }
