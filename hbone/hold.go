package hbone

import (
	"sync"
	"time"
)

// A connection refused as it is accepted, its source past its budgets (AdmitListener), is
// held before its RST: kept open, unread, with no goroutine, until the handshake deadline
// (DialTimeout) it would have had if let in. Refusing it at once invited it back: a
// client that holds stalled handshakes, as the cluster's noisy-stall drill does, dials
// again as soon as one ends, so each refusal bought another accept, another refusal and
// the kernel's handshake and reset on both ends, thousands a second from one source; the
// Rust ztunnel holds every such connection (it has neither the budgets nor a handshake
// deadline), so the same client costs it nothing once it holds its connections. Held,
// a refused connection costs a socket (an fd and a few KiB of kernel memory) until its
// deadline and no CPU, and the client gets back each of them once per deadline.
//
// Only connections the budgets refuse are held, and they bind only a source whose
// handshakes fail or stall (admission.go: a successful handshake gives its rate token
// back, and 256 in flight is a node's worth), so what an honest client behind such a
// source loses is the time to learn of its refusal, the deadline a stalled handshake let
// in would have had. At most maxHeldPer × MaxHandshakes (4,096 by default) are held by a
// server (per pod in in-pod mode); past that the oldest is reset at once. Server.Close
// and Shutdown reset them all.

// maxHeldPer is how many refused connections a server holds per MaxHandshakes.
const maxHeldPer = 4

// refusalHold keeps refused connections until their refusal is due.
type refusalHold struct {
	wait  time.Duration // how long a refused connection is held
	limit int           // most held at once

	mu     sync.Mutex
	q      []heldRefusal // guarded by mu: oldest first; one wait for all, so due in order
	timer  *time.Timer   // guarded by mu: runs expire when q[0] is due; nil while q is empty
	closed bool          // guarded by mu: close has run; refusals go out at once
}

// heldRefusal is one held connection: reset sends its RST and closes it.
type heldRefusal struct {
	due   time.Time
	reset func()
}

// hold keeps a refused connection until its refusal is due; reset sends its RST and
// closes it, and is called once, from another goroutine (or at once, while closed).
func (h *refusalHold) hold(reset func()) {
	h.mu.Lock()
	if h.closed || h.limit <= 0 {
		h.mu.Unlock()
		reset()
		return
	}
	var evicted func()
	if len(h.q) >= h.limit {
		evicted = h.q[0].reset
		h.q[0] = heldRefusal{}
		h.q = h.q[1:]
	}
	h.q = append(h.q, heldRefusal{due: time.Now().Add(h.wait), reset: reset})
	if h.timer == nil {
		h.timer = time.AfterFunc(h.wait, h.expire)
	}
	h.mu.Unlock()
	if evicted != nil {
		evicted()
	}
}

// expire refuses the held connections that are due and sets the timer for the next.
func (h *refusalHold) expire() {
	h.mu.Lock()
	now := time.Now()
	n := 0
	for n < len(h.q) && !h.q[n].due.After(now) {
		n++
	}
	due := h.take(n)
	if len(h.q) > 0 && !h.closed {
		h.timer.Reset(h.q[0].due.Sub(now))
	} else {
		h.timer = nil
	}
	h.mu.Unlock()
	for _, r := range due {
		r.reset()
	}
}

// take removes the n oldest from the queue and returns them (h.mu held).
func (h *refusalHold) take(n int) []heldRefusal {
	taken := append([]heldRefusal(nil), h.q[:n]...)
	clear(h.q[:n])
	h.q = h.q[n:]
	if len(h.q) == 0 {
		h.q = nil
	}
	return taken
}

// close refuses every held connection now, and those held later at once.
func (h *refusalHold) close() {
	h.mu.Lock()
	h.closed = true
	if h.timer != nil {
		h.timer.Stop()
		h.timer = nil
	}
	all := h.take(len(h.q))
	h.mu.Unlock()
	for _, r := range all {
		r.reset()
	}
}

// held is how many connections are held.
func (h *refusalHold) held() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.q)
}
