package certs

import (
	"context"
	"slices"
	"sync"
)

// slots hands out the MaxInflight CSR slots. A connection waiting for a certificate goes
// before prefetches and rotations (ztunnel's RealTime over Warmup/Background), so a node
// prefetching hundreds of identities still serves a new connection promptly.
type slots struct {
	mu         sync.Mutex
	free       int
	urgent     []*waiter // FIFO
	background []*waiter // FIFO
}

// waiter is one fetch waiting for a slot.
type waiter struct {
	ch      chan struct{} // closed when granted
	urgent  bool
	granted bool
}

func newSlots(n int) *slots { return &slots{free: n} }

func newWaiter(urgent bool) *waiter { return &waiter{ch: make(chan struct{}), urgent: urgent} }

// acquire takes a slot for w, waiting in its priority's queue.
func (s *slots) acquire(ctx context.Context, w *waiter) error {
	s.mu.Lock()
	if s.free > 0 {
		s.free--
		w.granted = true
		s.mu.Unlock()
		return nil
	}
	if w.urgent {
		s.urgent = append(s.urgent, w)
	} else {
		s.background = append(s.background, w)
	}
	s.mu.Unlock()
	select {
	case <-w.ch:
		return nil
	case <-ctx.Done():
		s.mu.Lock()
		granted := w.granted
		if !granted {
			s.urgent = slices.DeleteFunc(s.urgent, func(x *waiter) bool { return x == w })
			s.background = slices.DeleteFunc(s.background, func(x *waiter) bool { return x == w })
		}
		s.mu.Unlock()
		if granted {
			s.release() // pass it on
		}
		return ctx.Err()
	}
}

// release returns a slot, handing it to the first urgent waiter, else the first background one.
func (s *slots) release() {
	s.mu.Lock()
	defer s.mu.Unlock()
	var w *waiter
	switch {
	case len(s.urgent) > 0:
		w, s.urgent = s.urgent[0], s.urgent[1:]
	case len(s.background) > 0:
		w, s.background = s.background[0], s.background[1:]
	default:
		s.free++
		return
	}
	w.granted = true
	close(w.ch)
}

// promote moves a queued background waiter to the end of the urgent queue (a caller now
// waits for that identity).
func (s *slots) promote(w *waiter) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if w.granted || w.urgent {
		return
	}
	s.background = slices.DeleteFunc(s.background, func(x *waiter) bool { return x == w })
	w.urgent = true
	s.urgent = append(s.urgent, w)
}
