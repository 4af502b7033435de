package main

import (
	"bytes"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"
)

// syncBuffer is a bytes.Buffer safe for the flusher and the test to share.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// Lines are held for at most one interval, and Close writes whatever is left.
func TestLogWriterFlushes(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var out syncBuffer
		l := newLogWriter(&out, 100*time.Millisecond)
		l.Write([]byte("first\n"))
		if got := out.String(); got != "" {
			t.Fatalf("written through before the interval: %q", got)
		}
		time.Sleep(150 * time.Millisecond)
		synctest.Wait()
		if got := out.String(); got != "first\n" {
			t.Fatalf("after one interval: %q; want the first line", got)
		}
		l.Write([]byte("last\n"))
		l.Close()
		if got := out.String(); !strings.HasSuffix(got, "last\n") {
			t.Fatalf("after Close: %q; want the last line flushed", got)
		}
	})
}
