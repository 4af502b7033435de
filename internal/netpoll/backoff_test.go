package netpoll

import (
	"testing"
	"time"
)

func TestNextDelay(t *testing.T) {
	for _, tc := range []struct{ prev, want time.Duration }{
		{0, 5 * time.Millisecond},
		{5 * time.Millisecond, 10 * time.Millisecond},
		{640 * time.Millisecond, time.Second},
		{time.Second, time.Second},
	} {
		if got := nextDelay(tc.prev); got != tc.want {
			t.Errorf("nextDelay(%v) = %v; want %v", tc.prev, got, tc.want)
		}
	}
}

func TestWaitDelay(t *testing.T) {
	if !waitDelay(time.Millisecond, nil) {
		t.Error("waitDelay(1ms) with done open = false; want true")
	}
	done := make(chan struct{})
	close(done)
	if waitDelay(time.Hour, done) {
		t.Error("waitDelay(1h) with done closed = true; want false")
	}
}
