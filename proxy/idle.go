package proxy

// Parking: a proxied connection idle on a node holds no goroutine there. Each pump of its
// parkCopy (copy.go) gives up its goroutine while its socket is quiet and takes a fresh one
// when the socket becomes readable, watched by the proxy's poller (netpoll's epoll
// WatchReadable); with a poller that does not park (netpoll.PerSocket) none of this runs.
// doc.go ("Goroutines and locks") has the design; this file the code.

import (
	"syscall"
	"time"
)

// idleSweep is how often the sweep looks for quiet connections among the running ones; a
// connection whose socket has sent nothing for between one and two sweeps parks (two to
// three after it resumed; within one of its start if it sends nothing). Short, so
// that a burst of new connections that go quiet does not hold a burst of goroutine stacks
// (freed stacks stay in the process's resident set, up to the GC's goal): the sweep visits
// only the copies running, and a busy one pays one woken read per sweep. parkIdle false
// keeps every copy on its goroutine whatever the poller (tests and benchmarks compare both
// in one process). Both are variables for tests.
var (
	idleSweep = 100 * time.Millisecond
	parkIdle  = true
)

// aLongTimeAgo is a read deadline in the past: it wakes a reader at once.
var aLongTimeAgo = time.Unix(1, 0)

// idle runs when the sweep has woken the reader: it clears the deadline and, if nothing was
// read since the last wake-up and the sockets are not being closed, parks; true if it did.
func (pm *pump) idle(quiet bool) bool {
	s := pm.c
	s.mu.Lock()
	defer s.mu.Unlock()
	pm.src.SetReadDeadline(time.Time{}) // under mu: a sweep cannot set it again in between
	if !quiet || !s.parks || s.closing {
		// Bytes moved since the last wake-up: look again at the next sweep, so that a
		// direction parks one to two sweeps after its last byte. (A copy that does not
		// park is never swept; tests may turn parking off while it runs.)
		pm.sweeps = 1
		return false
	}
	token, err := s.p.cfg.Poller.WatchReadable(pm)
	if err != nil {
		return false // keep the goroutine
	}
	// Ready may already be waiting for mu: it finds the state parked.
	pm.state, pm.token = copyParked, token
	s.p.setRunning(pm, false)
	return true
}

// SyscallConn is the socket the poller watches while the pump is parked.
func (pm *pump) SyscallConn() (syscall.RawConn, error) { return pm.src.SyscallConn() }

// Ready is the poller's callback: the socket is readable (or done); resume on a fresh
// goroutine. It does not block.
func (pm *pump) Ready() {
	s := pm.c
	s.mu.Lock()
	if pm.state != copyParked {
		s.mu.Unlock() // unpark came first
		return
	}
	pm.state, pm.token, pm.sweeps = copyRunning, 0, 0
	s.p.setRunning(pm, true)
	s.mu.Unlock()
	go pm.run()
}

// unpark marks the copy closing and resumes its parked directions.
func (s *parkCopy) unpark() {
	var resume [2]*pump
	var tokens [2]uint64
	s.mu.Lock()
	s.closing = true
	for i, pm := range []*pump{&s.up, &s.down} {
		if pm.state != copyParked {
			continue
		}
		pm.state, pm.sweeps = copyRunning, 0
		resume[i], tokens[i] = pm, pm.token
		pm.token = 0
		s.p.setRunning(pm, true)
	}
	s.mu.Unlock()
	for i, pm := range resume {
		if pm != nil {
			s.p.cfg.Poller.CancelReadable(tokens[i]) // if the event took the watch first, its Ready finds the state running
			go pm.run()
		}
	}
}

// sweep is the sweep's visit: a direction seen running by a sweep since it started, or by
// two in a row since it resumed, and then by every sweep, has its read woken, so that run
// can see whether it read anything since the last wake-up.
func (pm *pump) sweep() {
	s := pm.c
	s.mu.Lock()
	if pm.state == copyRunning && !s.closing {
		if pm.sweeps++; pm.sweeps >= 2 {
			pm.src.SetReadDeadline(aLongTimeAgo)
		}
	}
	s.mu.Unlock()
}

// setRunning adds a pump to the set the sweep visits (on), or takes it out; called under
// its copy's mu at each change of state, so the set follows the state. The sweep runs while
// the set is not empty.
func (p *Proxy) setRunning(s *pump, on bool) {
	p.runMu.Lock()
	defer p.runMu.Unlock()
	if !on {
		delete(p.running, s)
		if s.state == copyParked {
			p.parksSinceQuiet++
		}
		return
	}
	if p.running == nil {
		p.running = map[*pump]struct{}{}
	}
	p.running[s] = struct{}{}
	if !p.sweepArmed && !p.sweepStopped {
		p.sweepArmed = true
		if p.sweepTimer == nil {
			p.sweepTimer = time.AfterFunc(idleSweep, p.sweepIdle)
		} else {
			p.sweepTimer.Reset(idleSweep)
		}
	}
}

// sweepIdle visits every running pump (see pump.sweep), then sets itself to run again
// while any is left. One runs at a time: only its own end re-arms the timer.
func (p *Proxy) sweepIdle() {
	p.runMu.Lock()
	visit := p.sweepBuf[:0]
	for s := range p.running {
		visit = append(visit, s)
	}
	p.runMu.Unlock()
	for _, s := range visit {
		s.sweep()
	}
	clear(visit) // keep no ended copy alive
	p.runMu.Lock()
	p.sweepBuf = visit
	burst := false
	if len(p.running) > 0 && !p.sweepStopped {
		p.sweepTimer.Reset(idleSweep)
	} else {
		p.sweepArmed = false
		burst = p.parksSinceQuiet >= release.Load().parks
		p.parksSinceQuiet = 0
	}
	p.runMu.Unlock()
	if burst {
		// After the unlock: a sweep armed meanwhile may run beside this call, which
		// touches no sweep state.
		releaseAfterBurst(release.Load()) // release.go
	}
}

// stopSweep stops the sweep: Shutdown calls it once every connection has ended, so nothing
// is parked or running.
func (p *Proxy) stopSweep() {
	p.runMu.Lock()
	defer p.runMu.Unlock()
	p.sweepStopped = true
	if p.sweepTimer != nil {
		p.sweepTimer.Stop()
	}
}
