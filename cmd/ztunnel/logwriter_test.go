package main

import (
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/gozt/gozt/internal/testutil"
)

// Lines are held for at most one interval; no flush timer is armed while nothing waits;
// Close writes whatever is left, and later lines go straight through.
func TestLogWriterFlushes(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var out testutil.SyncBuffer
		l := newLogWriter(&out, 100*time.Millisecond)
		if l.pending != nil {
			t.Fatal("flush timer armed before any line")
		}
		l.Write([]byte("first\n"))
		time.Sleep(50 * time.Millisecond)
		l.Write([]byte("second\n"))
		if got := out.String(); got != "" {
			t.Fatalf("written through before the interval: %q", got)
		}
		time.Sleep(60 * time.Millisecond) // 110 ms after the first line
		synctest.Wait()
		if got := out.String(); got != "first\nsecond\n" {
			t.Fatalf("one interval after the first line: %q; want both lines", got)
		}
		l.mu.Lock()
		idle := l.pending == nil
		l.mu.Unlock()
		if !idle {
			t.Fatal("flush timer still armed with an empty buffer: an idle node would keep waking")
		}
		l.Write([]byte("third\n"))
		l.Close()
		if got := out.String(); !strings.HasSuffix(got, "second\nthird\n") {
			t.Fatalf("after Close: %q; want the third line flushed", got)
		}
		l.Write([]byte("late\n"))
		if got := out.String(); !strings.HasSuffix(got, "third\nlate\n") {
			t.Fatalf("after Close: %q; want a late line written through", got)
		}
	})
}
