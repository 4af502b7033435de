package reuse

import (
	"testing"
	"time"

	"github.com/gozt/gozt/internal/leaktest"
)

func TestLoop(t *testing.T) {
	leaktest.Check(t)
	next := make(chan int)
	done := make(chan struct{})
	ran := make(chan int, 10)
	ended := make(chan struct{})
	go func() {
		defer close(ended)
		Loop(1, func(v int) { ran <- v }, next, done, time.Minute)
	}()
	next <- 2 // taken by the waiting goroutine, not a new one
	next <- 3
	close(done)
	<-ended
	close(ran)
	var got []int
	for v := range ran {
		got = append(got, v)
	}
	if len(got) != 3 || got[0] != 1 || got[1] != 2 || got[2] != 3 {
		t.Errorf("ran %v, want [1 2 3] on one goroutine", got)
	}

	start := time.Now()
	Loop(0, func(int) {}, nil, nil, 20*time.Millisecond)
	if d := time.Since(start); d < 20*time.Millisecond {
		t.Errorf("Loop returned after %v with nothing to do; want it to wait the idle time", d)
	}
}
