package hbone

// The read side: the connection's single frame reader (readLoop) and what it does with
// each frame, including handing server streams to handlers.

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/gozt/gozt/internal/ktls"
	"github.com/gozt/gozt/internal/reuse"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// readLoop is the connection's single frame reader. It returns the error that ends it.
func (c *conn) readLoop() error {
	if c.kt.reader != nil {
		defer c.kt.reader.close()
	}
	for {
		f, err := c.rfr.ReadFrame()
		if err == errTrim {
			c.readMax.Store(0)
			c.newReadFramer()
			continue
		}
		if err != nil {
			var se http2.StreamError
			if errors.As(err, &se) {
				c.mu.Lock()
				c.resetLocked(c.streams[se.StreamID], se.StreamID, se.Code)
				c.mu.Unlock()
				continue
			}
			var ce http2.ConnectionError
			if errors.As(err, &ce) {
				return connError{http2.ErrCode(ce), err.Error()}
			}
			if errors.Is(err, http2.ErrFrameTooLarge) {
				return connError{http2.ErrCodeFrameSize, "frame too large"}
			}
			if errors.Is(err, ktls.ErrKeyUpdate) {
				c.keyEvent("peer_key_update")
			}
			return err
		}
		if err := c.handleFrame(f); err != nil && !c.calmDrain(err) {
			return err
		}
		if err := c.checkKeys(); err != nil {
			return err
		}
		if c.flooded.Load() {
			return calm("peer does not read the control frames it makes us send")
		}
	}
}

func (c *conn) handleFrame(f http2.Frame) error {
	if !c.gotSettings {
		if sf, ok := f.(*http2.SettingsFrame); !ok || sf.IsAck() {
			return connError{http2.ErrCodeProtocol, "first frame is not SETTINGS"}
		}
	}
	switch f := f.(type) {
	case *http2.DataFrame:
		return c.handleData(f)
	case *http2.MetaHeadersFrame:
		if c.server {
			return c.serverHeaders(f)
		}
		return c.clientHeaders(f)
	case *http2.SettingsFrame:
		return c.handleSettings(f)
	case *http2.PingFrame:
		c.mu.Lock()
		defer c.mu.Unlock()
		if f.IsAck() {
			c.pingOut = false
			c.calmAcked = c.calmAcked || c.calmErr != nil && f.Data == calmPing
			return nil
		}
		c.queueLocked(ctrlOp{kind: opPingAck, data: f.Data})
		return c.junkLocked()
	case *http2.WindowUpdateFrame:
		return c.handleWindowUpdate(f)
	case *http2.RSTStreamFrame:
		return c.handleRST(f)
	case *http2.GoAwayFrame:
		c.handleGoAway(f)
	case *http2.PushPromiseFrame:
		return connError{http2.ErrCodeProtocol, "PUSH_PROMISE not allowed"}
	}
	// PRIORITY and unknown frame types are ignored (RFC 9113 §5.5, §5.3.2), but counted.
	return c.junk()
}

// handleRST ends the stream the peer reset. A server stream reset before its handler
// answered is counted against the early-reset budget, and its Request context ends at
// once so the handler's dial stops.
func (c *conn) handleRST(f *http2.RSTStreamFrame) error {
	c.mu.Lock()
	if c.idleLocked(f.StreamID) {
		c.mu.Unlock()
		return connError{http2.ErrCodeProtocol, "RST_STREAM on idle stream"}
	}
	s := c.streams[f.StreamID]
	if s == nil {
		err := c.junkLocked() // a stream that already ended
		c.mu.Unlock()
		return err
	}
	var err error
	if s.pending {
		err = c.droppedLocked(DropResetUnanswered)
	}
	if s.cancel != nil {
		s.cancel(ErrPeerReset) // under c.mu, so Accept never sees the reset before the cause
	}
	s.peerResetLocked(f.ErrCode)
	c.mu.Unlock()
	return err
}

// idleLocked reports whether id names a stream that was never opened.
func (c *conn) idleLocked(id uint32) bool {
	if id == 0 {
		return false
	}
	ours := (id%2 == 0) == c.server
	if ours {
		return id >= c.nextID
	}
	return id > c.lastPeerID
}

func (c *conn) handleData(f *http2.DataFrame) error {
	c.mu.Lock()
	finish, err := c.handleDataLocked(f)
	if err == nil && f.Length == 0 && !f.StreamEnded() {
		err = c.junkLocked()
	}
	c.mu.Unlock()
	if finish != nil {
		finish.drain() // nothing to write: only ends DeliverTo and calls its done
	}
	return err
}

// handleDataLocked takes one DATA frame. It returns a stream whose DeliverTo the frame
// reader should end itself, after unlocking: at END_STREAM with nothing left to write, a
// goroutine started just to call done would cost more (a wakeup, often a futex) than
// the call.
func (c *conn) handleDataLocked(f *http2.DataFrame) (finish *Stream, err error) {
	id := f.StreamID
	n := int64(f.Length)
	data := f.Data()
	if n > c.recvConnAvail {
		return nil, connError{http2.ErrCodeFlowControl, "DATA exceeds the connection window"}
	}
	c.recvConnAvail -= n
	s := c.streams[id]
	if s == nil || s.recvEnd || s.localClosed || (!c.server && !s.gotResp) {
		if s == nil && c.idleLocked(id) {
			return nil, connError{http2.ErrCodeProtocol, "DATA on idle stream"}
		}
		c.releaseConnLocked(n)
		switch {
		case s == nil:
			// A stream we closed or reset: DATA may still be in flight; ignore it
			// (RFC 9113 §5.1) rather than answer every frame with RST_STREAM.
		case !s.gotResp && !c.server:
			c.resetLocked(s, id, http2.ErrCodeProtocol) // DATA before the response
		case s.recvEnd:
			c.resetLocked(s, id, http2.ErrCodeStreamClosed)
		}
		return nil, nil
	}
	if n > s.recvAvail {
		c.releaseConnLocked(n)
		c.resetLocked(s, id, http2.ErrCodeFlowControl)
		return nil, nil
	}
	s.recvAvail -= n
	if s.unearned && len(data) > 0 {
		c.earnedLocked(s)
	}
	if c.kt.conn != nil {
		c.kt.copiedIn.Add(int64(len(data)))
	}
	if pad := n - int64(len(data)); pad > 0 {
		s.unacked += pad
		c.releaseConnLocked(pad)
	}
	if len(data) > 0 && s.sink != nil && s.rb.n == 0 && !s.readBusy {
		data = c.writeDirectLocked(s, data)
		if s.localClosed { // closed during the write: drop the rest, release its window
			c.releaseConnLocked(int64(len(data)))
			s.rb.free()
			return nil, nil
		}
	}
	// Wake the stream's waiters only when there is something for them: a wakeup per
	// frame whose data already went straight to the socket costs a goroutine hand-off
	// (and often a futex) for nothing.
	wake := false
	if len(data) > 0 {
		s.rb.write(data)
		wake = true
	}
	if f.StreamEnded() {
		s.recvEnd = true
		c.maybeDoneLocked(s)
		wake = true
		if s.deliverDone != nil && !s.delivering && s.rb.n == 0 {
			s.delivering = true // so signalLocked starts no drain goroutine
			finish = s
		}
	}
	if wake {
		s.signalLocked()
	}
	return finish, nil
}

// writeDirectLocked hands DATA straight to the stream's TCP consumer (a WriteTo in
// progress) with one non-blocking write, saving a buffer copy and a goroutine hand-off.
// What the socket does not take is returned for the stream's buffer. c.mu is held on
// entry and exit but released around the syscall; readBusy keeps WriteTo out meanwhile.
func (c *conn) writeDirectLocked(s *Stream, data []byte) []byte {
	s.readBusy = true
	c.direct = data
	c.directN = 0
	c.mu.Unlock()
	err := s.sink.Write(c.sinkWrite)
	c.mu.Lock()
	s.readBusy = false
	n := c.directN
	c.direct = nil
	if err != nil || n <= 0 {
		n = 0
	}
	if n > 0 {
		s.directTotal += int64(n)
		c.consumedLocked(s, n)
	}
	if s.waitBusy { // a WriteTo on its way out waits for this write to finish
		s.waitBusy = false
		s.cond.Broadcast()
	}
	return data[n:]
}

// resetLocked sends RST_STREAM(code) for id and ends s (which may be nil).
func (c *conn) resetLocked(s *Stream, id uint32, code http2.ErrCode) {
	c.queueLocked(ctrlOp{kind: opRST, id: id, val: uint32(code), s: s})
	if s != nil && !s.done {
		s.rerr = fmt.Errorf("hbone: stream reset locally: %s", code)
		s.werr = s.rerr
		c.maybeDoneLocked(s)
		c.streamDoneLocked(s)
		s.signalLocked()
	}
}

func (c *conn) maybeDoneLocked(s *Stream) {
	if s.sentEnd && s.recvEnd {
		c.streamDoneLocked(s)
	}
}

// streamDoneLocked removes s from the live set; its buffered data stays readable.
func (c *conn) streamDoneLocked(s *Stream) {
	if s.done {
		return
	}
	s.done = true
	delete(c.streams, s.id)
	c.active--
	if s.unearned {
		// Ended before it carried a byte (a 5xx or a denial, a reset, an empty close):
		// it holds no handler's setup any more, so its start goes back as a byte's would.
		c.earnedLocked(s)
	}
	if c.peerBudget != nil && !c.budgetDone {
		c.budgetStreams--
		c.peerBudget.streams.Add(-1)
	}
	if c.active == 0 {
		c.idleSince = time.Now()
		if c.draining && c.server || ((c.goaway || c.single) && !c.server && c.reserved == 0) {
			c.queueLocked(ctrlOp{kind: opGoAwayEnd})
		}
	}
}

func (c *conn) handleGoAway(f *http2.GoAwayFrame) {
	c.mu.Lock()
	c.goaway = true
	gerr := &GoAwayError{Code: f.ErrCode, LastStreamID: f.LastStreamID}
	for id, s := range c.streams {
		if (id%2 == 0) == c.server && id > f.LastStreamID {
			s.rerr = fmt.Errorf("%w: %w", errRefused, gerr)
			s.werr = s.rerr
			c.streamDoneLocked(s)
			s.signalLocked()
		}
	}
	if c.active == 0 && c.reserved == 0 {
		c.queueLocked(ctrlOp{kind: opGoAwayEnd})
	}
	c.mu.Unlock()
	c.leavePool() // now; the connection closes when its streams end
}

func (c *conn) clientHeaders(f *http2.MetaHeadersFrame) error {
	id := f.StreamID
	c.mu.Lock()
	defer c.mu.Unlock()
	if id%2 == 0 || c.idleLocked(id) {
		return connError{http2.ErrCodeProtocol, "HEADERS on a stream we did not open"}
	}
	s := c.streams[id]
	if s == nil {
		return nil // we reset it already
	}
	if s.gotResp {
		c.trailersLocked(s, id, f)
		return nil
	}
	code, err := strconv.Atoi(f.PseudoValue("status"))
	if err != nil || code < 100 || code > 999 {
		c.resetLocked(s, id, http2.ErrCodeProtocol)
		return nil
	}
	if code >= 100 && code < 200 {
		return c.junkLocked() // informational: nothing for a tunnel
	}
	s.status = code
	s.respFields = append([]hpack.HeaderField{}, f.RegularFields()...)
	s.gotResp = true
	if f.StreamEnded() {
		s.recvEnd = true
		c.maybeDoneLocked(s)
	}
	s.signalLocked()
	return nil
}

// trailersLocked handles a HEADERS frame on a stream whose headers already arrived: only
// trailers that end the stream are allowed; anything else resets it.
func (c *conn) trailersLocked(s *Stream, id uint32, f *http2.MetaHeadersFrame) {
	if !f.StreamEnded() {
		c.resetLocked(s, id, http2.ErrCodeProtocol)
		return
	}
	s.recvEnd = true
	c.maybeDoneLocked(s)
	s.signalLocked()
}

func (c *conn) serverHeaders(f *http2.MetaHeadersFrame) error {
	id := f.StreamID
	c.mu.Lock()
	defer c.mu.Unlock()
	if id%2 == 0 {
		return connError{http2.ErrCodeProtocol, "client opened an even stream"}
	}
	if s := c.streams[id]; s != nil {
		c.trailersLocked(s, id, f)
		return nil
	}
	if id <= c.lastPeerID {
		// A stream that already ended (e.g. rejected): a stream error, not worth the
		// connection and its other streams.
		c.queueLocked(ctrlOp{kind: opRST, id: id, val: uint32(http2.ErrCodeStreamClosed)})
		return c.junkLocked()
	}
	c.lastPeerID = id
	if c.calmErr != nil {
		// Past the calm GOAWAY: a client may have sent a few streams before it read it;
		// one that goes on after that is closed.
		c.queueLocked(ctrlOp{kind: opRST, id: id, val: uint32(http2.ErrCodeRefusedStream)})
		c.notifyDrop(DropRefused)
		if c.calmRefused++; c.calmAcked || c.calmRefused > calmGrace {
			return calm("streams opened past GOAWAY(ENHANCE_YOUR_CALM)")
		}
		return nil
	}
	if c.draining || c.closed || c.active >= int(c.cfg.MaxConcurrentStreams) {
		c.queueLocked(ctrlOp{kind: opRST, id: id, val: uint32(http2.ErrCodeRefusedStream)})
		return c.droppedLocked(DropRefused)
	}
	if c.peerBudget != nil && c.cfg.PeerStreams > 0 && c.peerBudget.streams.Load() >= int64(c.cfg.PeerStreams) {
		// The peer identity's connections together hold PeerStreams (admission.go).
		c.queueLocked(ctrlOp{kind: opRST, id: id, val: uint32(http2.ErrCodeRefusedStream)})
		return c.droppedLocked(DropPeerStreams)
	}
	authority := f.PseudoValue("authority")
	if f.Truncated || f.PseudoValue("method") != "CONNECT" || f.PseudoValue("scheme") != "" ||
		f.PseudoValue("path") != "" || f.PseudoValue("protocol") != "" || !validAuthority(authority) {
		c.queueLocked(ctrlOp{kind: opStatus, id: id, val: http.StatusBadRequest})
		if !f.StreamEnded() {
			c.queueLocked(ctrlOp{kind: opRST, id: id, val: uint32(http2.ErrCodeNo)})
		}
		return nil
	}
	s := c.newStreamLocked(id)
	if c.peerBudget != nil && !c.budgetDone {
		c.budgetStreams++
		c.peerBudget.streams.Add(1)
	}
	s.gotResp = true
	s.recvEnd = f.StreamEnded()
	s.pending = true
	ctx, cancel := context.WithCancelCause(c.ctx)
	s.cancel = cancel
	hdr := make(http.Header, len(f.Fields))
	for _, hf := range f.RegularFields() {
		k := http.CanonicalHeaderKey(hf.Name)
		hdr[k] = append(hdr[k], hf.Value)
	}
	req := &Request{
		Authority:  authority,
		Header:     hdr,
		Peer:       c.peer,
		LocalAddr:  c.nc.LocalAddr(),
		RemoteAddr: c.nc.RemoteAddr(),
		s:          s,
		ctx:        ctx,
	}
	// Every handler may be busy, some of them for streams the peer has already reset,
	// or the connection past its stream starts: then the stream waits, without a
	// goroutine, for a handler to return or a start (limits.go). Waiting streams
	// are open ones, so there are never more than MaxConcurrentStreams.
	c.waiting = append(c.waiting, req)
	c.startWaitingLocked()
	return nil
}

// startWaitingLocked starts a handler for each waiting stream, in order, while one may
// start (takeWaitingLocked); when the connection's stream starts ran out it sets a timer
// to try again once one is back.
func (c *conn) startWaitingLocked() {
	for {
		r := c.takeWaitingLocked()
		if r == nil {
			return
		}
		select {
		case c.work <- r: // an idle handler goroutine takes it
		default:
			c.wg.Add(1)
			go c.handlerLoop(r)
		}
	}
}

// takeWaitingLocked takes the first waiting stream the peer has not reset meanwhile if a
// handler may start for it now, counting the handler and spending one of the
// connection's stream starts; nil if none may.
func (c *conn) takeWaitingLocked() *Request {
	c.dropResetWaitingLocked()
	if len(c.waiting) == 0 || c.closed || c.handlers >= int(c.cfg.MaxConcurrentStreams) {
		return nil
	}
	ok, wait := c.takeStartLocked()
	if !ok {
		if c.startTimer == nil {
			c.notifyDrop(DropStreamStarts)
			c.startTimer = time.AfterFunc(wait, c.startsBack)
		}
		return nil
	}
	r := c.waiting[0]
	c.waiting[0] = nil
	c.waiting = c.waiting[1:]
	r.s.unearned = c.cfg.StreamStarts > 0
	c.handlers++
	return r
}

// startsBack starts the streams that waited for the connection's stream starts.
func (c *conn) startsBack() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.startTimer = nil
	c.startWaitingLocked()
}

// earnedLocked gives s's stream start back once it has carried a byte, either way, or
// has ended, and starts what waited for it.
func (c *conn) earnedLocked(s *Stream) {
	s.unearned = false
	c.earnStartLocked()
	c.startWaitingLocked()
}

func (c *conn) newStreamLocked(id uint32) *Stream {
	s := &Stream{c: c, id: id, sendAvail: c.peerInitWindow, recvAvail: int64(c.cfg.StreamWindow)}
	s.cond.L = &c.mu
	c.streams[id] = s
	c.active++
	return s
}

// handlerIdle is how long a handler goroutine waits for the connection's next stream
// before it exits.
const handlerIdle = time.Second

// handlerLoop runs r's handler, then serves further streams of the connection until it
// has been idle for handlerIdle or the connection closes. Reusing the goroutine keeps the
// stack a proxy handler grows (dial, policy, access log) instead of growing a fresh one,
// copy by copy, for every stream.
func (c *conn) handlerLoop(r *Request) {
	defer c.wg.Done()
	reuse.Loop(r, c.runHandler, c.work, c.done, handlerIdle)
}

// runHandler runs the handler for r, then for each stream waiting for a handler: a
// handler's place passes on only when it returns, however early the peer reset its
// stream (limits.go).
func (c *conn) runHandler(r *Request) {
	for r != nil {
		c.mu.Lock()
		gone := r.s.done // reset before its handler could start: nothing to do for it
		c.mu.Unlock()
		if !gone {
			ok := c.peerBudget.tryDial()
			if !ok { // the identity has PeerDials unanswered (admission.go): wait for one
				c.notifyDrop(DropPeerDials)
				ok = c.peerBudget.waitDial(r.ctx)
			}
			if ok {
				r.dialHeld.Store(c.peerBudget != nil && c.peerBudget.dials != nil)
				c.handler(r)
				r.leaveDial()
			}
		}
		if !r.answered.Load() {
			r.Reject(http.StatusServiceUnavailable)
		}
		c.mu.Lock()
		cancel := r.s.cancel
		r.s.cancel = nil
		c.handlers--
		r = c.takeWaitingLocked() // on this goroutine: its stack has grown already
		c.mu.Unlock()
		cancel(nil)
	}
}

// dropResetWaitingLocked takes the waiting streams the peer has reset meanwhile off the
// front of the queue.
func (c *conn) dropResetWaitingLocked() {
	for len(c.waiting) > 0 && c.waiting[0].s.done {
		s := c.waiting[0].s
		c.waiting[0] = nil
		c.waiting = c.waiting[1:]
		if s.cancel != nil {
			s.cancel(nil)
			s.cancel = nil
		}
	}
}

// validAuthority accepts host:port where host is an IP (v6 in brackets) or a DNS name.
func validAuthority(a string) bool {
	host, port, err := net.SplitHostPort(a)
	if err != nil || host == "" {
		return false
	}
	if p, err := strconv.Atoi(port); err != nil || p < 1 || p > 65535 || port[0] == '+' {
		return false
	}
	if strings.HasPrefix(a, "[") {
		ip := net.ParseIP(host)
		return ip != nil && ip.To4() == nil
	}
	if net.ParseIP(host) != nil {
		return !strings.Contains(host, ":") // v6 must be bracketed
	}
	if len(host) > 253 {
		return false
	}
	for _, label := range strings.Split(strings.TrimSuffix(host, "."), ".") {
		if label == "" || len(label) > 63 || label[0] == '-' || label[len(label)-1] == '-' {
			return false
		}
		for i := 0; i < len(label); i++ {
			b := label[i]
			if !(b >= 'a' && b <= 'z' || b >= 'A' && b <= 'Z' || b >= '0' && b <= '9' || b == '-' || b == '_') {
				return false
			}
		}
	}
	return true
}
