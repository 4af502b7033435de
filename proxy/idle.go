package proxy

// Idle proxied connections without a goroutine: the TCP ↔ HBONE stream copy (streamCopy)
// gives up its goroutine while its socket is quiet and takes a fresh one when the socket
// becomes readable. doc.go ("Goroutines and locks") has the design; this file the code.

import (
	"errors"
	"net"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/gozt/gozt/hbone"
	"github.com/gozt/gozt/internal/podpoll"
)

// IdlePoller watches the sockets of idle proxied connections for readability, so that no
// goroutine waits on them. internal/podpoll's Poller implements it; in-pod mode passes the
// node's, which its pod listeners share.
type IdlePoller interface {
	// WatchReadable calls ready once, not blocking, when sc is readable, half-closed by its
	// peer or failed, unless cancel is called first; cancel reports whether it was.
	WatchReadable(sc syscall.Conn, ready func()) (cancel func() bool, err error)
}

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

// A streamCopy's up direction (socket → stream) is in one of these states.
const (
	copyRunning uint8 = iota // a goroutine reads the socket (or is about to)
	copyParked               // in the poller: no goroutine
	copyEnded                // the direction is over
)

// streamCopy is copyStream that can park: one TCP socket ↔ HBONE stream pair, in
// user-space or kernel TLS. The stream's frame reader delivers stream → socket (DeliverTo;
// in kernel TLS it splices each DATA payload into the socket) with no goroutine;
// socket → stream runs on a goroutine while bytes move, and while the socket is quiet on
// none: the sweep wakes its read with a past deadline, the reader finds it read nothing
// since the last wake-up and registers the socket with the poller instead (park), and the
// poller's event starts a fresh goroutine that resumes the copy (ready). Whichever direction
// ends last completes the connection (complete), once.
type streamCopy struct {
	p      *Proxy
	tc     *net.TCPConn
	st     *hbone.Stream
	resets bool
	flip   bool // tc is the server leg: received and sent swap
	// finish is handOff's end of the connection: done, the closes, the tracker.
	finish func(received, sent int64, err error)

	// pending counts the directions not yet over; the one that takes it to 0 completes.
	pending atomic.Int32
	// The up direction's results: written by the goroutine running it (one at a time:
	// park and ready hand it over under mu), read by complete after pending.
	up    int64
	upErr error
	// The down direction's: written by DeliverTo's callback before pending.
	down    int64
	downErr error

	mu      sync.Mutex
	state   uint8       // guarded by mu: copyRunning, copyParked, copyEnded
	closing bool        // guarded by mu: the socket is being closed; never park again
	sweeps  uint8       // guarded by mu: sweeps seen running since the last wake-up
	cancel  func() bool // guarded by mu: the poller's, while parked
}

// parkable reports whether handOff's pair can use streamCopy: a TCP socket and an HBONE
// stream. In kernel TLS too: there Stream.ReadFrom splices the socket into the stream
// (readFromSplice), and the sweep's past read deadline ends the splice as it ends a read,
// between frames, with the pipe empty and every byte moved counted.
func (p *Proxy) parkable(client, server halfCloser) (tc *net.TCPConn, st *hbone.Stream, flip bool) {
	if !parkIdle || runtime.GOOS != "linux" { // podpoll is epoll
		return nil, nil, false
	}
	var ok bool
	if st, ok = server.(*hbone.Stream); ok {
		tc, ok = client.(*net.TCPConn)
	} else if st, ok = client.(*hbone.Stream); ok {
		tc, ok = server.(*net.TCPConn)
		flip = true
	}
	if !ok {
		return nil, nil, false
	}
	return tc, st, flip
}

// start runs the copy on the caller's goroutine (a tracked one handOff started) until it
// ends or parks.
func (s *streamCopy) start() {
	s.pending.Store(2)
	if err := s.st.DeliverTo(s.tc, s.downDone); err != nil {
		s.mu.Lock()
		s.state = copyEnded
		s.mu.Unlock()
		s.finish(0, 0, err)
		return
	}
	s.mu.Lock()
	s.p.setRunning(s, true)
	s.mu.Unlock()
	s.run()
}

// run copies the socket into the stream until the socket's data ends (endUp) or it parks.
func (s *streamCopy) run() {
	for {
		n, err := s.st.ReadFrom(s.tc)
		s.up += n
		if err != nil && errors.Is(err, os.ErrDeadlineExceeded) {
			if s.idle(n == 0) {
				return // parked: ready resumes on another goroutine
			}
			continue
		}
		s.endUp(err)
		return
	}
}

// idle runs when the sweep has woken the reader: it clears the deadline and, if nothing was
// read since the last wake-up and the socket is not being closed, parks; true if it did.
func (s *streamCopy) idle(quiet bool) bool {
	var poller IdlePoller
	if quiet {
		poller = s.p.idlePoller()
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.tc.SetReadDeadline(time.Time{}) // under mu: a sweep cannot set it again in between
	if poller == nil || s.closing {
		// Bytes moved since the last wake-up: look again at the next sweep, so that a
		// connection parks one to two sweeps after its last byte.
		s.sweeps = 1
		return false
	}
	cancel, err := poller.WatchReadable(s.tc, s.ready)
	if err != nil {
		return false // keep the goroutine
	}
	// ready may already be waiting for mu: it finds the state parked.
	s.state, s.cancel = copyParked, cancel
	s.p.setRunning(s, false)
	return true
}

// ready is the poller's callback: the socket is readable (or done); resume on a fresh
// goroutine. It does not block.
func (s *streamCopy) ready() {
	s.mu.Lock()
	if s.state != copyParked {
		s.mu.Unlock() // unpark came first
		return
	}
	s.state, s.cancel, s.sweeps = copyRunning, nil, 0
	s.p.setRunning(s, true)
	s.mu.Unlock()
	go s.run()
}

// Close is unpark, for liveConn.close (drain deadline, policy): the socket closed while in
// the poller gets no event, so whoever closes it resumes a parked copy, which then finds the
// socket closed and ends as an unparked one would. It must be called after the close.
func (s *streamCopy) Close() error {
	s.unpark()
	return nil
}

func (s *streamCopy) unpark() {
	s.mu.Lock()
	s.closing = true
	if s.state != copyParked {
		s.mu.Unlock()
		return
	}
	s.state, s.sweeps = copyRunning, 0
	cancel := s.cancel
	s.cancel = nil
	s.p.setRunning(s, true)
	s.mu.Unlock()
	cancel() // if the event took the watch first, its ready finds the state running
	go s.run()
}

// sweep is the sweep's visit: a copy seen running by two sweeps in a row since it started
// or resumed, and then by every sweep, has its read woken, so that run can see whether it
// read anything since the last wake-up.
func (s *streamCopy) sweep() {
	s.mu.Lock()
	if s.state == copyRunning && !s.closing {
		if s.sweeps++; s.sweeps >= 2 {
			s.tc.SetReadDeadline(aLongTimeAgo)
		}
	}
	s.mu.Unlock()
}

// endUp ends the socket → stream direction as copyStream does.
func (s *streamCopy) endUp(err error) {
	if s.resets && tcpReset(err) {
		resetBoth(s.tc, s.st)
		err = nil
	} else if err = endHalf(s.st, err); err != nil {
		abort(s.tc, s.st)
	}
	s.upErr = err
	s.mu.Lock()
	s.state = copyEnded
	s.p.setRunning(s, false)
	s.mu.Unlock()
	if s.pending.Add(-1) == 0 {
		s.complete()
	}
}

// downDone is DeliverTo's callback, on the stream's frame reader (or DeliverTo's caller):
// the stream → socket direction is over. Closing the socket unparks the other direction.
func (s *streamCopy) downDone(n int64, err error) {
	if s.resets && tcpReset(err) {
		resetBoth(s.tc, s.st) // tc's peer reset it: so does the stream's
		err = nil
		s.unpark()
	} else if err = endHalf(s.tc, err); err != nil {
		abort(s.tc, s.st) // unblock the other direction
		s.unpark()
	}
	s.down, s.downErr = n, err
	if s.pending.Add(-1) == 0 {
		go s.complete() // not on the frame reader: done records metrics and logs
	}
}

// complete runs once, after both directions: handOff's done, closes and removal.
func (s *streamCopy) complete() {
	received, sent := s.up, s.down
	if s.flip {
		received, sent = sent, received
	}
	s.finish(received, sent, errors.Join(s.downErr, s.upErr))
}

// idlePoller is the poller idle connections park in: Config.IdlePoller, else the proxy's
// own, started at the first park; nil once Shutdown has closed it, or if none can start.
func (p *Proxy) idlePoller() IdlePoller {
	if p.cfg.IdlePoller != nil {
		return p.cfg.IdlePoller
	}
	p.idleMu.Lock()
	defer p.idleMu.Unlock()
	if p.ownPoller == nil && !p.idleClosed && !p.pollerFailed {
		pp, err := podpoll.New()
		if err != nil {
			p.pollerFailed = true
			p.log.Debug("proxy: idle connections keep their goroutines", "err", err)
			return nil
		}
		p.ownPoller = pp
	}
	if p.ownPoller == nil || p.idleClosed {
		return nil
	}
	return p.ownPoller
}

// setRunning adds a copy to the set the sweep visits (on), or takes it out; called under
// s.mu at each change of state, so the set follows the state. The sweep runs while the set
// is not empty.
func (p *Proxy) setRunning(s *streamCopy, on bool) {
	p.runMu.Lock()
	defer p.runMu.Unlock()
	if !on {
		delete(p.running, s)
		return
	}
	if p.running == nil {
		p.running = map[*streamCopy]struct{}{}
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

// sweepIdle visits every running copy (see streamCopy.sweep), then sets itself to run again
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

// closeIdle stops the sweep and closes the proxy's own poller: Shutdown calls it once every
// connection has ended, so nothing is parked.
func (p *Proxy) closeIdle() {
	p.runMu.Lock()
	p.sweepStopped = true
	if p.sweepTimer != nil {
		p.sweepTimer.Stop()
	}
	p.runMu.Unlock()
	p.idleMu.Lock()
	p.idleClosed = true
	pp := p.ownPoller
	p.ownPoller = nil
	p.idleMu.Unlock()
	if pp != nil {
		pp.Close()
	}
}

// Compile-time check that the node's poller is an IdlePoller.
var _ IdlePoller = (*podpoll.Poller)(nil)
