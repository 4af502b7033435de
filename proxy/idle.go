package proxy

// Idle proxied connections without a goroutine: the TCP ↔ HBONE stream copy and the TCP ↔
// TCP copy (parkCopy) give up a direction's goroutine while its socket is quiet and take a
// fresh one when the socket becomes readable. doc.go ("Goroutines and locks") has the
// design; this file the code.

import (
	"errors"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gozt/gozt/hbone"
)

// idleSweep is how often the sweep looks for quiet connections among the running ones; a
// connection whose socket has sent nothing for between one and two sweeps parks (two to
// three after it resumed). Short, so
// that a burst of new connections that go quiet does not hold a burst of goroutine stacks
// (freed stacks stay in the process's resident set, up to the GC's goal): the sweep visits
// only the copies running, and a busy one pays one woken read per sweep. parkIdle turns
// parking off (tests and benchmarks compare both). Both are variables for tests.
var (
	idleSweep = 100 * time.Millisecond
	parkIdle  = true
)

// aLongTimeAgo is a read deadline in the past: it wakes a reader at once.
var aLongTimeAgo = time.Unix(1, 0)

// A pump (one direction of a parkCopy that reads a TCP socket) is in one of these states.
const (
	copyRunning uint8 = iota // a goroutine reads the socket (or is about to)
	copyParked               // in the poller: no goroutine
	copyEnded                // the direction is over
)

// parkCopy is copyBoth that can park, for a TCP socket ↔ HBONE stream pair (in user-space
// or kernel TLS) and a TCP ↔ TCP pair. Each direction that reads a socket is a pump: it
// runs on a goroutine while bytes move and on none while its socket is quiet: the sweep
// wakes its read with a past deadline, the pump finds it read nothing since the last
// wake-up and registers the socket with the poller instead (park), and the poller's event
// starts a fresh goroutine that resumes it (ready). A stream pair has one pump (socket →
// stream); its other direction is the stream's frame reader's (DeliverTo), with no
// goroutine. A TCP pair has two, which park and resume each on its own. Whichever
// direction ends last completes the connection (complete), once.
type parkCopy struct {
	p      *Proxy
	resets bool
	flip   bool // a stream pair whose socket is the server leg: received and sent swap
	// finish is handOff's end of the connection: done, the closes, the tracker.
	finish func(received, sent int64, err error)

	// up copies the client's socket into the server leg, or (flip) the server's socket
	// into the stream; down the other way: a pump in a TCP pair, DeliverTo's in a stream
	// pair (only its results used).
	up, down pump
	st       *hbone.Stream // the stream of a stream pair; nil in a TCP pair

	// pending counts the directions not yet over; the one that takes it to 0 completes.
	pending atomic.Int32

	mu      sync.Mutex
	closing bool // guarded by mu: the sockets are being closed; never park again
}

// pump is one direction of a parkCopy that reads a TCP socket, into an HBONE stream
// (Stream.ReadFrom: user-space reads, or in kernel TLS a splice into the kernel TLS
// socket) or into the other socket (TCPConn.ReadFrom: a splice). A past read deadline ends
// either without losing a byte and with the bytes moved counted: the deadline is checked
// before a read or splice, or when one found nothing.
type pump struct {
	c   *parkCopy
	src *net.TCPConn // read; what parks in the poller
	dst halfCloser   // the stream or the other socket
	// The direction's results: written by the goroutine running it (one at a time: park
	// and ready hand it over under c.mu), or by DeliverTo's callback, read by complete
	// after pending.
	n   int64
	err error

	state  uint8       // guarded by c.mu: copyRunning, copyParked, copyEnded
	sweeps uint8       // guarded by c.mu: sweeps seen running since the last wake-up
	cancel func() bool // guarded by c.mu: the poller's, while parked
}

// parkable returns the parkCopy for handOff's pair, or nil if it cannot park: a TCP socket
// and an HBONE stream, in either TLS (in kernel TLS Stream.ReadFrom splices the socket into
// the stream, and the sweep's past read deadline ends the splice as it ends a read), or two
// TCP sockets.
func (p *Proxy) parkable(client, server halfCloser) *parkCopy {
	if !parkIdle || !p.cfg.Poller.Parks() { // a goroutine per socket would not save one
		return nil
	}
	ctc, _ := client.(*net.TCPConn)
	stc, _ := server.(*net.TCPConn)
	cst, _ := client.(*hbone.Stream)
	sst, _ := server.(*hbone.Stream)
	var up, down pump
	var st *hbone.Stream
	var flip bool
	switch {
	case ctc != nil && stc != nil:
		up, down = pump{src: ctc, dst: stc}, pump{src: stc, dst: ctc}
	case ctc != nil && sst != nil:
		st, up, down.state = sst, pump{src: ctc, dst: sst}, copyEnded // down is DeliverTo's
	case stc != nil && cst != nil:
		st, up, down.state, flip = cst, pump{src: stc, dst: cst}, copyEnded, true
	default:
		return nil
	}
	s := &parkCopy{p: p, resets: !p.cfg.DisableResetPropagation, flip: flip, up: up, down: down, st: st}
	s.up.c, s.down.c = s, s
	return s
}

// start runs the copy on the caller's goroutine (a tracked one handOff started) until
// the up direction ends or parks; a TCP pair's down direction starts on its own.
func (s *parkCopy) start() {
	s.pending.Store(2)
	if s.st != nil {
		if err := s.st.DeliverTo(s.up.src, s.downDone); err != nil {
			s.mu.Lock()
			s.up.state = copyEnded
			s.mu.Unlock()
			s.finish(0, 0, err)
			return
		}
	}
	s.mu.Lock()
	s.p.setRunning(&s.up, true)
	if s.st == nil {
		s.p.setRunning(&s.down, true)
	}
	s.mu.Unlock()
	if s.st == nil {
		go s.down.run()
	}
	s.up.run()
}

// run copies the socket into dst until the socket's data ends (end) or it parks.
func (pm *pump) run() {
	for {
		var n int64
		var err error
		if st := pm.c.st; st != nil {
			n, err = st.ReadFrom(pm.src)
		} else {
			n, err = pm.dst.(*net.TCPConn).ReadFrom(pm.src)
		}
		pm.n += n
		if err != nil && errors.Is(err, os.ErrDeadlineExceeded) {
			if pm.idle(n == 0) {
				return // parked: ready resumes on another goroutine
			}
			continue
		}
		pm.end(err)
		return
	}
}

// idle runs when the sweep has woken the reader: it clears the deadline and, if nothing was
// read since the last wake-up and the sockets are not being closed, parks; true if it did.
func (pm *pump) idle(quiet bool) bool {
	s := pm.c
	s.mu.Lock()
	defer s.mu.Unlock()
	pm.src.SetReadDeadline(time.Time{}) // under mu: a sweep cannot set it again in between
	if !quiet || s.closing {
		// Bytes moved since the last wake-up: look again at the next sweep, so that a
		// direction parks one to two sweeps after its last byte.
		pm.sweeps = 1
		return false
	}
	cancel, err := s.p.cfg.Poller.WatchReadable(pm.src, pm.ready)
	if err != nil {
		return false // keep the goroutine
	}
	// ready may already be waiting for mu: it finds the state parked.
	pm.state, pm.cancel = copyParked, cancel
	s.p.setRunning(pm, false)
	return true
}

// ready is the poller's callback: the socket is readable (or done); resume on a fresh
// goroutine. It does not block.
func (pm *pump) ready() {
	s := pm.c
	s.mu.Lock()
	if pm.state != copyParked {
		s.mu.Unlock() // unpark came first
		return
	}
	pm.state, pm.cancel, pm.sweeps = copyRunning, nil, 0
	s.p.setRunning(pm, true)
	s.mu.Unlock()
	go pm.run()
}

// Close is unpark, for liveConn.close (drain deadline, policy): a socket closed while in
// the poller gets no event, so whoever closes it resumes the parked directions, which then
// find their sockets closed and end as unparked ones would. It must be called after the
// close.
func (s *parkCopy) Close() error {
	s.unpark()
	return nil
}

// unpark marks the copy closing and resumes its parked directions.
func (s *parkCopy) unpark() {
	var resume [2]*pump
	var cancels [2]func() bool
	s.mu.Lock()
	s.closing = true
	for i, pm := range []*pump{&s.up, &s.down} {
		if pm.state != copyParked {
			continue
		}
		pm.state, pm.sweeps = copyRunning, 0
		resume[i], cancels[i] = pm, pm.cancel
		pm.cancel = nil
		s.p.setRunning(pm, true)
	}
	s.mu.Unlock()
	for i, pm := range resume {
		if pm != nil {
			cancels[i]() // if the event took the watch first, its ready finds the state running
			go pm.run()
		}
	}
}

// sweep is the sweep's visit: a direction seen running by two sweeps in a row since it
// started or resumed, and then by every sweep, has its read woken, so that run can see
// whether it read anything since the last wake-up.
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

// end ends the direction as copyStream and copyHalf do: a clean end half-closes dst; a
// TCP peer's reset (with resets) resets both legs, a failure aborts both, and either
// resumes the other direction if it is parked, to find its socket closed.
func (pm *pump) end(err error) {
	s := pm.c
	if s.resets && tcpReset(err) {
		resetBoth(pm.src, pm.dst)
		err = nil
		s.unpark()
	} else if err = endHalf(pm.dst, err); err != nil {
		abort(pm.src, pm.dst)
		s.unpark()
	}
	pm.err = err
	s.mu.Lock()
	pm.state = copyEnded
	s.p.setRunning(pm, false)
	s.mu.Unlock()
	if s.pending.Add(-1) == 0 {
		s.complete()
	}
}

// downDone is DeliverTo's callback, on the stream's frame reader (or DeliverTo's caller):
// the stream → socket direction is over. Closing the socket unparks the other direction.
func (s *parkCopy) downDone(n int64, err error) {
	tc := s.up.src
	if s.resets && tcpReset(err) {
		resetBoth(tc, s.st) // tc's peer reset it: so does the stream's
		err = nil
		s.unpark()
	} else if err = endHalf(tc, err); err != nil {
		abort(tc, s.st) // unblock the other direction
		s.unpark()
	}
	s.down.n, s.down.err = n, err
	if s.pending.Add(-1) == 0 {
		go s.complete() // not on the frame reader: done records metrics and logs
	}
}

// complete runs once, after both directions: handOff's done, closes and removal.
func (s *parkCopy) complete() {
	received, sent := s.up.n, s.down.n
	if s.flip {
		received, sent = sent, received
	}
	s.finish(received, sent, errors.Join(s.down.err, s.up.err))
}

// setRunning adds a pump to the set the sweep visits (on), or takes it out; called under
// its copy's mu at each change of state, so the set follows the state. The sweep runs while
// the set is not empty.
func (p *Proxy) setRunning(s *pump, on bool) {
	p.runMu.Lock()
	defer p.runMu.Unlock()
	if !on {
		delete(p.running, s)
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
	defer p.runMu.Unlock()
	p.sweepBuf = visit
	if len(p.running) > 0 && !p.sweepStopped {
		p.sweepTimer.Reset(idleSweep)
	} else {
		p.sweepArmed = false
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
