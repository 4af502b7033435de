package bench

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestHaltNote(t *testing.T) {
	for _, tc := range []struct {
		name           string
		driver, pollNS string // "" leaves the file out
		want           bool
	}{
		{"haltpoll without polling", "haltpoll", "0", true},
		{"haltpoll that polls", "haltpoll", "200000", false},
		{"bare metal", "intel_idle", "", false},
		{"no cpuidle in sysfs", "", "", false},
		{"haltpoll, parameter unreadable", "haltpoll", "", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sys := t.TempDir()
			write := func(name, v string) {
				if v == "" {
					return
				}
				p := filepath.Join(sys, name)
				if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
					t.Fatal(err)
				}
				if err := os.WriteFile(p, []byte(v+"\n"), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			write("devices/system/cpu/cpuidle/current_driver", tc.driver)
			write("module/haltpoll/parameters/guest_halt_poll_ns", tc.pollNS)
			got := haltNote(sys)
			if (got != "") != tc.want {
				t.Fatalf("haltNote = %q, want a note: %v", got, tc.want)
			}
			if tc.want && !strings.Contains(got, "guest_halt_poll_ns=0") {
				t.Fatalf("note %q does not name the setting", got)
			}
		})
	}
}
