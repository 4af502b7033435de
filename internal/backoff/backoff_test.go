package backoff

import (
	"testing"
	"time"
)

func TestNext(t *testing.T) {
	for _, tc := range []struct{ prev, want time.Duration }{
		{0, 5 * time.Millisecond},
		{5 * time.Millisecond, 10 * time.Millisecond},
		{640 * time.Millisecond, time.Second},
		{time.Second, time.Second},
	} {
		if got := Next(tc.prev); got != tc.want {
			t.Errorf("Next(%v) = %v; want %v", tc.prev, got, tc.want)
		}
	}
}

func TestWait(t *testing.T) {
	if !Wait(time.Millisecond, nil) {
		t.Error("Wait(1ms) with done open = false; want true")
	}
	done := make(chan struct{})
	close(done)
	if Wait(time.Hour, done) {
		t.Error("Wait(1h) with done closed = true; want false")
	}
}
