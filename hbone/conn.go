package hbone

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gozt/gozt/identity"
	"github.com/gozt/gozt/internal/reuse"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// conn is one HTTP/2 connection, client or server side. Its single frame reader
// (readLoop) never blocks on the socket's write side: the control frames it must answer
// with (SETTINGS/PING acks, WINDOW_UPDATE, RST_STREAM, rejections) are queued for
// writeLoop, so two peers that both write bulk data cannot deadlock each other.
type conn struct {
	cfg     Config
	server  bool
	handler Handler
	nc      net.Conn // what frames are read from and written to (usually *tls.Conn)
	bc      *bufConn // coalescing layer under TLS, nil when the caller built the TLS conn
	peer    identity.ID
	fr      *http2.Framer
	onClose func(*conn) // pool bookkeeping: the connection leaves the pool; see leavePool
	left    atomic.Bool // onClose has run
	extra   bool        // client: dialed because the key's other conns were congested; guarded by Pool.mu

	// Write side. wmu serialises frames; waiters counts goroutines queued for it so that
	// the last one out flushes bc (one write(2) for a batch of frames).
	wmu        sync.Mutex
	waiters    atomic.Int32
	henc       *hpack.Encoder
	hbuf       bytes.Buffer
	hencLimit  uint32
	goawaySent bool    // guarded by wmu
	dataHdr    [9]byte // guarded by wmu

	kick chan struct{} // wakes writeLoop; capacity 1
	work chan *Request // server: hands a new stream to an idle handler goroutine
	done chan struct{} // closed by closeWith
	wg   sync.WaitGroup
	// ctx is the parent of every server stream's Request context; cancelCtx ends it in
	// closeWith. Set before the frame reader starts (server only), then immutable.
	ctx       context.Context
	cancelCtx context.CancelCauseFunc
	flooded   atomic.Bool // more than maxQueuedControl control frames are queued

	mu             sync.Mutex
	streams        map[uint32]*Stream
	nextID         uint32     // client: next stream id to open
	lastPeerID     uint32     // highest peer-initiated stream id seen
	active         int        // open or half-closed streams
	handlers       int        // server: handlers running, at most ServerMaxStreams (limits.go)
	waiting        []*Request // server: open streams waiting for a handler, FIFO (limits.go)
	reserved       int        // client: slots promised by the pool, not yet opened
	peerMaxStreams uint32
	peerInitWindow int64
	peerMaxFrame   uint32
	peerHdrTable   uint32
	sendConnAvail  int64
	recvConnAvail  int64
	connUnacked    int64
	connWaiters    int
	gotSettings    bool
	settingsCh     chan struct{} // closed on the peer's first SETTINGS
	goaway         bool          // no new streams: peer sent GOAWAY or we are leaving
	draining       bool          // we sent (or queued) GOAWAY
	closed         bool
	err            error
	cause          error // what closeWith was called with (nil: deliberate clean close)
	idleSince      time.Time
	pingOut        bool
	pingSent       time.Time
	ops, opsSpare  []ctrlOp
	resetBudget    rateBudget // server: refused and early-reset streams (limits.go)
	junkBudget     rateBudget // frames that carry nothing (limits.go)
}

type opKind uint8

const (
	opSettingsAck opKind = iota
	opPing
	opPingAck
	opWindowUpdate
	opRST
	opStatus    // HEADERS :status val with END_STREAM (rejection before a handler)
	opGoAway    // GOAWAY(lastPeerID, val); the connection keeps running
	opGoAwayEnd // GOAWAY(lastPeerID, NO_ERROR) then close
)

type ctrlOp struct {
	kind opKind
	id   uint32
	val  uint32
	s    *Stream
	data [8]byte
}

func newConn(cfg Config, server bool, nc net.Conn, bc *bufConn) *conn {
	c := &conn{
		cfg:            cfg,
		server:         server,
		nc:             nc,
		bc:             bc,
		kick:           make(chan struct{}, 1),
		work:           make(chan *Request),
		done:           make(chan struct{}),
		streams:        make(map[uint32]*Stream),
		nextID:         1,
		peerMaxStreams: math.MaxUint32,
		peerInitWindow: 65535,
		peerMaxFrame:   minFrameSize,
		peerHdrTable:   4096,
		hencLimit:      4096,
		sendConnAvail:  65535,
		recvConnAvail:  int64(cfg.ConnWindow),
		settingsCh:     make(chan struct{}),
		idleSince:      time.Now(),
	}
	c.fr = http2.NewFramer(nc, nc)
	c.fr.SetMaxReadFrameSize(cfg.MaxFrameSize)
	c.fr.SetReuseFrames()
	c.fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	if server {
		c.fr.MaxHeaderListSize = serverMaxHeaders
	} else {
		c.fr.MaxHeaderListSize = clientMaxHeaders
	}
	c.henc = hpack.NewEncoder(&c.hbuf)
	if tc, ok := nc.(*tls.Conn); ok && len(tc.ConnectionState().PeerCertificates) > 0 {
		if id, err := identity.FromCert(tc.ConnectionState().PeerCertificates[0]); err == nil {
			c.peer = id
		}
	}
	return c
}

// writePreface sends our connection preface: (client magic), SETTINGS and the
// connection-window increase.
func (c *conn) writePreface() error {
	c.lockWrite()
	defer c.unlockWrite()
	if !c.server {
		if _, err := io.WriteString(c.nc, http2.ClientPreface); err != nil {
			return err
		}
	}
	st := []http2.Setting{
		{ID: http2.SettingInitialWindowSize, Val: c.cfg.StreamWindow},
		{ID: http2.SettingMaxFrameSize, Val: c.cfg.MaxFrameSize},
	}
	if c.server {
		st = append(st, http2.Setting{ID: http2.SettingMaxConcurrentStreams, Val: c.cfg.ServerMaxStreams},
			http2.Setting{ID: http2.SettingMaxHeaderListSize, Val: serverMaxHeaders})
	} else {
		st = append(st, http2.Setting{ID: http2.SettingEnablePush, Val: 0},
			http2.Setting{ID: http2.SettingMaxHeaderListSize, Val: clientMaxHeaders})
	}
	if err := c.fr.WriteSettings(st...); err != nil {
		return err
	}
	if inc := c.cfg.ConnWindow - 65535; inc > 0 {
		return c.fr.WriteWindowUpdate(0, inc)
	}
	return nil
}

func (c *conn) lockWrite() {
	c.waiters.Add(1)
	c.wmu.Lock()
	c.waiters.Add(-1)
}

// unlockWrite flushes the coalesced records if nobody else is queued to write.
func (c *conn) unlockWrite() error {
	var err error
	if c.bc != nil && c.waiters.Load() == 0 {
		err = c.bc.Flush()
	}
	c.wmu.Unlock()
	return err
}

// queueLocked adds a control frame for writeLoop. c.mu held.
func (c *conn) queueLocked(op ctrlOp) {
	if c.closed {
		return
	}
	if len(c.ops) >= maxQueuedControl {
		c.flooded.Store(true) // the frame reader ends the connection
		return
	}
	c.ops = append(c.ops, op)
	select {
	case c.kick <- struct{}{}:
	default:
	}
}

// writeLoop owns the control-frame queue, the PING keepalive and (client) the idle timer.
func (c *conn) writeLoop() {
	defer c.wg.Done()
	tick := c.cfg.PingInterval
	if !c.server {
		tick = min(tick, c.cfg.IdleTimeout)
	}
	t := time.NewTimer(tick)
	defer t.Stop()
	for {
		select {
		case <-c.kick:
		case <-t.C:
			c.onTick()
			t.Reset(tick)
		case <-c.done:
			return
		}
		if err := c.flushOps(); err != nil {
			c.closeWith(err)
			return
		}
	}
}

func (c *conn) onTick() {
	c.mu.Lock()
	now := time.Now()
	if c.pingOut && now.Sub(c.pingSent) >= c.cfg.PingTimeout {
		c.mu.Unlock()
		slog.Debug("hbone: dropping connection, no PING ack", "remote", c.nc.RemoteAddr(), "timeout", c.cfg.PingTimeout)
		c.closeWith(fmt.Errorf("%w (%v)", errPingTimeout, c.cfg.PingTimeout))
		return
	}
	if !c.pingOut {
		c.pingOut = true
		c.pingSent = now
		op := ctrlOp{kind: opPing}
		copy(op.data[:], "gozt-ka")
		c.queueLocked(op)
	}
	if !c.server && c.active == 0 && c.reserved == 0 && now.Sub(c.idleSince) >= c.cfg.IdleTimeout {
		c.goaway = true
		c.draining = true
		c.queueLocked(ctrlOp{kind: opGoAwayEnd})
	}
	c.mu.Unlock()
}

func (c *conn) flushOps() error {
	c.lockWrite()
	closeAfter, err := c.writeOpsWLocked()
	if ferr := c.unlockWrite(); err == nil {
		err = ferr
	}
	if err == nil && closeAfter {
		c.closeWith(nil)
	}
	return err
}

// writeOpsWLocked writes the queued control frames (wmu held) and reports whether the
// connection is to close after them (a final GOAWAY).
func (c *conn) writeOpsWLocked() (closeAfter bool, err error) {
	c.mu.Lock()
	ops := c.ops
	c.ops = c.opsSpare[:0]
	c.mu.Unlock()
	for i := range ops {
		op := &ops[i]
		switch op.kind {
		case opSettingsAck:
			err = c.fr.WriteSettingsAck()
		case opPing:
			err = c.fr.WritePing(false, op.data)
		case opPingAck:
			err = c.fr.WritePing(true, op.data)
		case opWindowUpdate:
			err = c.fr.WriteWindowUpdate(op.id, op.val)
		case opRST:
			if op.s != nil {
				op.s.rstWritten = true
			}
			err = c.fr.WriteRSTStream(op.id, http2.ErrCode(op.val))
		case opStatus:
			err = c.writeHeadersWLocked(op.id, true, int(op.val), "", nil)
		case opGoAway:
			err = c.writeGoAwayWLocked(http2.ErrCode(op.val))
		case opGoAwayEnd:
			err = c.writeGoAwayWLocked(http2.ErrCodeNo)
			closeAfter = true
		}
		op.s = nil
		if err != nil {
			break
		}
	}
	c.mu.Lock()
	c.opsSpare = ops[:0]
	c.mu.Unlock()
	return closeAfter, err
}

// writeDataWLocked writes one DATA frame without END_STREAM (wmu held). Over a coalescing
// TLS conn the 9-byte header goes out as its own tiny TLS record, which shares the batch's
// write(2), so the payload is encrypted straight from p instead of being copied into the
// Framer's buffer first.
//
// A small payload is instead copied behind its header into one record: the copy is
// cheaper than a second record's seal on this side and its open on the peer's.
func (c *conn) writeDataWLocked(id uint32, p []byte) error {
	if c.bc == nil || len(p) <= smallData {
		return c.fr.WriteData(id, false, p)
	}
	h := &c.dataHdr
	n := len(p)
	h[0], h[1], h[2] = byte(n>>16), byte(n>>8), byte(n)
	h[3], h[4] = byte(http2.FrameData), 0
	h[5], h[6], h[7], h[8] = byte(id>>24)&0x7f, byte(id>>16), byte(id>>8), byte(id)
	if _, err := c.nc.Write(h[:]); err != nil {
		return err
	}
	_, err := c.nc.Write(p)
	return err
}

// smallData is the largest DATA payload written as one TLS record with its header
// (a record carries at most 16 KiB).
const smallData = 16<<10 - 9

func (c *conn) writeGoAwayWLocked(code http2.ErrCode) error {
	if c.goawaySent && code == http2.ErrCodeNo {
		return nil
	}
	c.goawaySent = true
	c.mu.Lock()
	last := c.lastPeerID
	c.mu.Unlock()
	return c.fr.WriteGoAway(last, code, nil)
}

// writeHeadersWLocked encodes and writes a header block (wmu held). For a response, status
// is non-zero; for a request, authority is set.
func (c *conn) writeHeadersWLocked(id uint32, end bool, status int, authority string, h http.Header) error {
	c.mu.Lock()
	maxFrame, tbl := c.peerMaxFrame, c.peerHdrTable
	c.mu.Unlock()
	if tbl != c.hencLimit {
		c.henc.SetMaxDynamicTableSizeLimit(tbl)
		c.hencLimit = tbl
	}
	c.hbuf.Reset()
	if status != 0 {
		c.henc.WriteField(hpack.HeaderField{Name: ":status", Value: strconv.Itoa(status)})
	} else {
		c.henc.WriteField(hpack.HeaderField{Name: ":method", Value: "CONNECT"})
		c.henc.WriteField(hpack.HeaderField{Name: ":authority", Value: authority})
	}
	for k, vs := range h {
		name := strings.ToLower(k)
		if hopByHop(name) || strings.HasPrefix(name, ":") {
			continue
		}
		for _, v := range vs {
			c.henc.WriteField(hpack.HeaderField{Name: name, Value: v})
		}
	}
	block := c.hbuf.Bytes()
	first := true
	for first || len(block) > 0 {
		n := min(len(block), int(maxFrame))
		var err error
		if first {
			err = c.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: block[:n], EndStream: end, EndHeaders: n == len(block)})
		} else {
			err = c.fr.WriteContinuation(id, n == len(block), block[:n])
		}
		if err != nil {
			return err
		}
		first = false
		block = block[n:]
	}
	return nil
}

func hopByHop(name string) bool {
	switch name {
	case "connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade", "te", "host":
		return true
	}
	return false
}

// leavePool runs onClose once, without c.mu held: at GOAWAY or at close, whichever
// comes first.
func (c *conn) leavePool() {
	if c.onClose != nil && !c.left.Swap(true) {
		c.onClose(c)
	}
}

// startDrain sends GOAWAY and takes no new streams; the connection closes once its
// streams have ended (Server.Shutdown).
func (c *conn) startDrain() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.draining = true
	c.goaway = true
	c.queueLocked(ctrlOp{kind: opGoAway, val: uint32(http2.ErrCodeNo)})
	if c.active == 0 {
		c.queueLocked(ctrlOp{kind: opGoAwayEnd})
	}
}

// closeWith tears the connection down once; every stream still open sees err (wrapped in
// ErrConnClosed). A nil err is a clean close.
func (c *conn) closeWith(err error) {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return
	}
	c.closed = true
	c.goaway = true
	c.cause = err
	if err == nil {
		err = ErrConnClosed
	} else if !errors.Is(err, ErrConnClosed) {
		err = fmt.Errorf("%w: %w", ErrConnClosed, err)
	}
	c.err = err
	for _, s := range c.streams {
		s.signalLocked()
	}
	c.ops = nil
	c.mu.Unlock()
	if c.cancelCtx != nil {
		c.cancelCtx(err)
	}
	close(c.done)
	if c.bc != nil {
		c.bc.Conn.Close() // not tls.Conn.Close: its close_notify would bypass wmu
	} else {
		c.nc.Close()
	}
	c.leavePool()
}

// fail answers a connection error with GOAWAY (best effort, bounded by a write deadline)
// and closes.
func (c *conn) fail(err error) {
	var ce connError
	if errors.As(err, &ce) {
		if ce.Code == http2.ErrCodeEnhanceYourCalm {
			c.notifyDrop(DropConnCalm)
		}
		c.nc.SetWriteDeadline(time.Now().Add(time.Second))
		c.lockWrite()
		c.writeGoAwayWLocked(ce.Code)
		c.unlockWrite()
	}
	c.closeWith(err)
}

// readLoop is the connection's single frame reader. It returns the error that ends it.
func (c *conn) readLoop() error {
	for {
		f, err := c.fr.ReadFrame()
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
			return err
		}
		if err := c.handleFrame(f); err != nil {
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
	s.direct = data
	s.directN = 0
	c.mu.Unlock()
	err := s.sink.Write(s.sinkFn)
	c.mu.Lock()
	s.readBusy = false
	n := s.directN
	s.direct = nil
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

// releaseConnLocked returns n bytes of connection window to the peer, batched.
func (c *conn) releaseConnLocked(n int64) {
	c.connUnacked += n
	if c.connUnacked >= int64(c.cfg.ConnWindow/4) {
		c.queueLocked(ctrlOp{kind: opWindowUpdate, val: uint32(c.connUnacked)})
		c.recvConnAvail += c.connUnacked
		c.connUnacked = 0
	}
}

// consumedLocked returns window for n bytes handed to the stream's consumer, batched.
func (c *conn) consumedLocked(s *Stream, n int) {
	c.releaseConnLocked(int64(n))
	s.unacked += int64(n)
	if s.unacked >= int64(c.cfg.StreamWindow/4) && !s.recvEnd && !s.done {
		c.queueLocked(ctrlOp{kind: opWindowUpdate, id: s.id, val: uint32(s.unacked)})
		s.recvAvail += s.unacked
		s.unacked = 0
	}
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
	if c.active == 0 {
		c.idleSince = time.Now()
		if c.draining && c.server || (c.goaway && !c.server && c.reserved == 0) {
			c.queueLocked(ctrlOp{kind: opGoAwayEnd})
		}
	}
}

func (c *conn) handleSettings(f *http2.SettingsFrame) error {
	if f.IsAck() {
		return nil
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	err := f.ForeachSetting(func(st http2.Setting) error {
		if err := st.Valid(); err != nil {
			var ce http2.ConnectionError
			if errors.As(err, &ce) {
				return connError{http2.ErrCode(ce), "bad setting " + st.String()}
			}
			return connError{http2.ErrCodeProtocol, "bad setting " + st.String()}
		}
		switch st.ID {
		case http2.SettingInitialWindowSize:
			delta := int64(st.Val) - c.peerInitWindow
			c.peerInitWindow = int64(st.Val)
			for _, s := range c.streams {
				s.sendAvail += delta
				if s.sendAvail > maxWindow {
					return connError{http2.ErrCodeFlowControl, "stream window overflow"}
				}
				s.cond.Broadcast()
			}
		case http2.SettingMaxFrameSize:
			c.peerMaxFrame = st.Val
		case http2.SettingMaxConcurrentStreams:
			c.peerMaxStreams = st.Val
		case http2.SettingHeaderTableSize:
			c.peerHdrTable = min(st.Val, 4096)
		}
		return nil
	})
	if err != nil {
		return err
	}
	c.queueLocked(ctrlOp{kind: opSettingsAck})
	if !c.gotSettings {
		c.gotSettings = true
		close(c.settingsCh)
	}
	return c.junkLocked()
}

func (c *conn) handleWindowUpdate(f *http2.WindowUpdateFrame) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	inc := int64(f.Increment)
	if inc < minUsefulWindowUpdate {
		if err := c.junkLocked(); err != nil {
			return err
		}
	}
	if f.StreamID == 0 {
		c.sendConnAvail += inc
		if c.sendConnAvail > maxWindow {
			return connError{http2.ErrCodeFlowControl, "connection window overflow"}
		}
		c.wakeConnWaitersLocked()
		return nil
	}
	if c.idleLocked(f.StreamID) {
		return connError{http2.ErrCodeProtocol, "WINDOW_UPDATE on idle stream"}
	}
	s := c.streams[f.StreamID]
	if s == nil {
		return nil // closed stream: allowed (RFC 9113 §6.9)
	}
	s.sendAvail += inc
	if s.sendAvail > maxWindow {
		c.resetLocked(s, s.id, http2.ErrCodeFlowControl)
		return nil
	}
	s.cond.Broadcast()
	return nil
}

// wakeConnWaitersLocked wakes the streams waiting for connection window.
func (c *conn) wakeConnWaitersLocked() {
	if c.connWaiters == 0 {
		return
	}
	for _, s := range c.streams {
		if s.waitConn {
			s.cond.Broadcast()
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
	if c.draining || c.closed || c.active >= int(c.cfg.ServerMaxStreams) {
		c.queueLocked(ctrlOp{kind: opRST, id: id, val: uint32(http2.ErrCodeRefusedStream)})
		return c.droppedLocked(DropRefused)
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
	if c.handlers >= int(c.cfg.ServerMaxStreams) {
		// Every handler is busy, some of them for streams the peer has already reset:
		// the stream waits for one to return (limits.go). Waiting streams are open
		// ones, so there are never more than ServerMaxStreams.
		c.waiting = append(c.waiting, req)
		return nil
	}
	c.handlers++
	select {
	case c.work <- req: // an idle handler goroutine takes it
	default:
		c.wg.Add(1)
		go c.handlerLoop(req)
	}
	return nil
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
			c.handler(r)
		}
		if !r.answered.Load() {
			r.Reject(http.StatusServiceUnavailable)
		}
		c.mu.Lock()
		cancel := r.s.cancel
		r.s.cancel = nil
		r = c.nextWaitingLocked()
		if r == nil {
			c.handlers--
		}
		c.mu.Unlock()
		cancel(nil)
	}
}

// nextWaitingLocked takes the first waiting stream the peer has not reset meanwhile.
func (c *conn) nextWaitingLocked() *Request {
	for len(c.waiting) > 0 {
		r := c.waiting[0]
		c.waiting[0] = nil
		c.waiting = c.waiting[1:]
		if !r.s.done {
			return r
		}
		if r.s.cancel != nil {
			r.s.cancel(nil)
			r.s.cancel = nil
		}
	}
	return nil
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

// waitSettings waits for the peer's first SETTINGS so the pool knows its stream limit.
func (c *conn) waitSettings(ctx context.Context) error {
	select {
	case <-c.settingsCh:
		return nil
	case <-c.done:
		c.mu.Lock()
		defer c.mu.Unlock()
		return c.err
	case <-ctx.Done():
		return ctx.Err()
	}
}
