package testutil

import (
	"errors"
	"sync/atomic"
	"testing"
)

func TestEventuallyWaits(t *testing.T) {
	var n atomic.Int32
	Eventually(t, "three polls", func() bool { return n.Add(1) >= 3 })
	if n.Load() != 3 {
		t.Errorf("cond called %d times, want 3", n.Load())
	}
	n.Store(0)
	EventuallyNil(t, func() error {
		if n.Add(1) < 3 {
			return errors.New("not yet")
		}
		return nil
	})
	if n.Load() != 3 {
		t.Errorf("check called %d times, want 3", n.Load())
	}
}
