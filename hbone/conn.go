package hbone

// One HTTP/2 connection, client or server side: its lifecycle (newConn, closeWith) and its
// fields, grouped by the lock or goroutine that owns them.
//
// It is our own loop on golang.org/x/net/http2's Framer and hpack because net/http's
// HTTP/2 server cannot send END_STREAM while still reading the request body, so it cannot
// half-close a CONNECT tunnel, and its layering cost about 2.4 CPU-seconds per GB more
// than Go's TLS alone (docs/ARCHITECTURE.md, decision 1). The loop:
//
//   - One frame reader (read.go) delivers DATA: to a stream whose consumer is a WriteTo
//     into a *net.TCPConn with nothing queued, straight to that socket with one
//     non-blocking write(2); otherwise into the stream's queue of pooled chunks
//     (deliver.go). Neither allocates. It never blocks on the socket's write side: the
//     control frames it owes are queued for the writer goroutine (writeLoop, which also
//     runs PING and idle timers), so two peers sending bulk data at each other cannot
//     deadlock.
//   - Writers, the goroutines that read the TCP sockets, write their own DATA frames, large
//     ones (reads grow to 1 MiB), under the write lock (write.go). Where this package runs
//     the TLS (Pool, ServeTLS) a buffering layer under crypto/tls (buf.go) collects the
//     records and is flushed when the last queued writer releases the lock, so a batch of
//     frames costs one write(2); a DATA frame's 9-byte header is its own record, so the
//     payload is encrypted straight from the caller's buffer. A caller-made *tls.Conn
//     (ServeConn) cannot be wrapped.
//   - WINDOW_UPDATEs (flow.go) go out once a quarter of a window has been consumed, and
//     capacity returns as the consumer takes the data, so a reader that stops reading
//     stops its peer after one stream window. Data dropped by a Close, a reset or a
//     rejection gives its window back, as does a DATA frame that loses the race to its
//     stream's RST_STREAM: a window leaked per aborted stream would stall the connection
//     in the end (TestAbortsKeepWindowsWhole).
//
// Locks, taken in this order, never the other way: Pool.mu → conn.mu; Stream.wmu →
// conn.wmu → conn.mu; Stream.rmu → conn.mu. Server.mu is never held with a conn's lock,
// nor admission.mu with any other. conn.wmu (the write lock: the Framer's write side, the
// HPACK encoder, the coalescing buffer) is held by whoever writes frames; functions that
// need it end in WLocked. conn.mu (the state lock: streams, windows, settings, the
// control-frame queue) guards the rest of conn and Stream's fields marked so; functions
// that need it end in Locked. The frame reader owns the Framer's read side alone.
//
// Goroutines: per connection one frame reader and one writer, owned by the Pool or by the
// ServeConn call, plus one per server stream running the Handler, which waits up to a
// second to run the connection's next stream so its grown stack is reused. A stream
// under DeliverTo has no goroutine of its own: the frame reader's direct writes carry its
// data, and a short-lived goroutine starts only when the socket is full (or the stream
// ends with data still queued). Pool.Close and ServeConn return only after all of theirs,
// drains included, have exited.

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gozt/gozt/identity"
	"github.com/gozt/gozt/internal/ktls"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// conn is one HTTP/2 connection, client or server side (see the file comment).
type conn struct {
	// Set by newConn (handler and onClose before the goroutines start), then read-only.
	cfg        connConfig
	server     bool
	handler    Handler
	nc         net.Conn // what frames are written to (and read from, but in kernel TLS): *tls.Conn, or bc over kt.conn
	bc         *bufConn // coalescing layer (under crypto/tls, or over kt.conn), nil when the caller built the TLS conn
	peer       identity.ID
	tls        tls.ConnectionState // the handshake's; zero for h2c (CloseMatching)
	fr         *http2.Framer       // the write side's, under wmu (replaced by trimIfIdle)
	onClose    func(*conn)         // pool bookkeeping: the connection leaves the pool; see leavePool
	peerBudget *peerState          // server: its peer identity's budgets (admission.go), nil without an identity
	onCalm     func()              // server: charges the calm to the source and identity (admission.go); set before the reader starts
	// ctx is the parent of every server stream's Request context; cancelCtx ends it in
	// closeWith. Set before the frame reader starts (server only).
	ctx       context.Context
	cancelCtx context.CancelCauseFunc

	// Kernel TLS's part of the connection, all of it (ktls.go, ksend.go, kread.go): kt.conn
	// is nil on the user-space path; kernelTLS says who owns each of its fields.
	kt kernelTLS

	// Channels and counters: safe from any goroutine.
	kick    chan struct{}  // wakes writeLoop; capacity 1
	work    chan *Request  // server: hands a new stream to an idle handler goroutine
	done    chan struct{}  // closed by closeWith
	wg      sync.WaitGroup // writeLoop, handlers, DeliverTo's drains
	left    atomic.Bool    // onClose has run
	flooded atomic.Bool    // more than maxQueuedControl control frames are queued
	waiters atomic.Int32   // goroutines queued for wmu: the last one out flushes bc
	extra   bool           // client: dialed because the key's other conns were congested; guarded by Pool.mu

	// Idle trimming (trim.go): set by the frame reader and writers, read by writeLoop.
	activity   atomic.Uint64 // frames read and write-lock holds
	readGrown  atomic.Bool   // the read Framer read a frame past trimKeep
	writeGrown atomic.Bool   // a write-side buffer grew past trimKeep
	trimRead   atomic.Bool   // the frame reader is to start a fresh read Framer at the next frame
	readMax    atomic.Int64  // the largest frame the current read Framer read

	// The frame reader's alone.
	keys keyLimits     // keylimit.go
	rfr  *http2.Framer // replaced when trimmed
	src  io.Reader     // what rfr reads: frameReader over nc, or kt.reader
	hdec *hpack.Decoder
	// A direct write to a stream's TCP consumer (writeDirectLocked): the payload and what
	// the write took, here rather than in each Stream since only the frame reader writes;
	// sinkWrite is c.writeSink, made once.
	direct    []byte
	directN   int
	sinkWrite func(fd uintptr) bool

	// The write lock: wmu serialises frames and guards the fields after it.
	wmu        sync.Mutex
	henc       *hpack.Encoder
	hbuf       bytes.Buffer
	hencLimit  uint32
	goawaySent bool
	dataHdr    [9]byte
	bigWrites  bool // fr wrote a DATA frame past trimKeep, so its buffer is that large

	// The state lock: mu guards every field after it and Stream's fields marked so.
	mu             sync.Mutex
	streams        map[uint32]*Stream
	nextID         uint32      // client: next stream id to open
	lastPeerID     uint32      // highest peer-initiated stream id seen
	active         int         // open or half-closed streams
	handlers       int         // server: handlers running, at most MaxConcurrentStreams (limits.go)
	waiting        []*Request  // server: open streams waiting for a handler, FIFO (limits.go)
	startTimer     *time.Timer // server: starts the waiting streams once a stream start is back (limits.go)
	reserved       int         // client: slots promised by the pool, not yet opened
	answerTimer    *time.Timer // client: wakes the CONNECTs waiting for an answer past their deadline (client.go)
	answerAt       time.Time   // client: when answerTimer fires; zero while it is not set
	single         bool        // client: DialOver's one-stream connection, closed when it ends
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
	resetBudget    rateBudget  // server: refused and early-reset streams (limits.go)
	starts         rateBudget  // server: handler starts not yet earned (StreamStarts, limits.go)
	junkBudget     rateBudget  // frames that carry nothing (limits.go)
	budgetStreams  int64       // server: its streams counted in peerBudget.streams (admission.go)
	budgetDone     bool        // server: serve has taken budgetStreams off peerBudget.streams
	calmErr        error       // server: the budget the peer ran out of; GOAWAY(ENHANCE_YOUR_CALM) sent, draining
	calmRefused    int         // server: streams refused after the calm GOAWAY
	calmAcked      bool        // server: the peer acked the PING sent after the calm GOAWAY: it has read the GOAWAY
	calmTimer      *time.Timer // server: closes the connection at the end of the calm drain
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

func newConn(cfg connConfig, server bool, nc net.Conn, bc *bufConn, kc *ktls.Conn) *conn {
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
	c.src = &frameReader{c: c, r: nc}
	if kc != nil {
		c.kt.conn = kc
		c.kt.reader = newKernelReader(c)
		c.src = c.kt.reader
		c.kt.rc, _ = kc.SyscallConn()
		c.kt.spliceFn = c.spliceWrite
	}
	c.fr = http2.NewFramer(nc, nil)
	c.hdec = hpack.NewDecoder(4096, nil)
	c.sinkWrite = c.writeSink
	c.newReadFramer()
	c.henc = hpack.NewEncoder(&c.hbuf)
	var st tls.ConnectionState
	if kc != nil {
		st = kc.ConnectionState() // the handshake's
	} else if tc, ok := nc.(*tls.Conn); ok {
		st = tc.ConnectionState()
	}
	c.tls = st
	if len(st.PeerCertificates) > 0 {
		if id, err := identity.FromCert(st.PeerCertificates[0]); err == nil {
			c.peer = id
		}
	}
	c.setKeyLimits()
	return c
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

// writeFailed ends the connection after a stream's write to its socket failed, and returns
// the stream's error: wrapping ErrConnClosed, as every error of a stream whose connection
// broke does, so that a proxy never takes the socket's reset or broken pipe for the TCP
// peer's reset of a stream it carries.
func (c *conn) writeFailed(op string, err error) error {
	c.closeWith(err)
	if errors.Is(err, ErrConnClosed) {
		return fmt.Errorf("hbone: %s: %w", op, err)
	}
	return fmt.Errorf("hbone: %s: %w: %w", op, ErrConnClosed, err)
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
	if c.startTimer != nil {
		c.startTimer.Stop()
		c.startTimer = nil
	}
	if c.answerTimer != nil {
		c.answerTimer.Stop()
	}
	c.mu.Unlock()
	if c.cancelCtx != nil {
		c.cancelCtx(err)
	}
	close(c.done)
	if c.kt.conn != nil {
		c.kt.conn.NetConn().Close() // not ktls.Conn.Close: its close_notify would bypass wmu
	} else if c.bc != nil {
		c.bc.Conn.Close() // not tls.Conn.Close: its close_notify would bypass wmu
	} else {
		c.nc.Close()
	}
	c.leavePool()
}

// calmPing is the payload of the PING sent after a calm GOAWAY.
var calmPing = [8]byte{'g', 'o', 'z', 't', '-', 'c', 'm'}

// calmGrace is how many new streams a peer may open past a calm GOAWAY before it has
// read it (acked calmPing): what an honest client sent meanwhile. Once it has read it,
// none.
const calmGrace = 8

// calmDrainTimeout is how long a connection calmed with GOAWAY(ENHANCE_YOUR_CALM) lets
// its open streams finish before it is closed anyway.
const calmDrainTimeout = 10 * time.Second

// calmDrain answers a server connection's first ENHANCE_YOUR_CALM (err) with a drain
// rather than a close: GOAWAY(ENHANCE_YOUR_CALM) names the last stream processed, new
// streams are refused, and the streams open finish within calmDrainTimeout. A pooled
// connection carries every client of its identity, so a close would cut the honest
// streams beside the flood. It reports false (close now) for any other error, on the
// client side, for a peer that does not read (the control-frame queue is full), and once
// the connection is already draining for a calm: a peer that keeps going after the
// GOAWAY (another budget's worth, or new streams past the GOAWAY once it has read it, or
// more than calmGrace before) is closed.
func (c *conn) calmDrain(err error) bool {
	var ce connError
	if !c.server || !errors.As(err, &ce) || ce.Code != http2.ErrCodeEnhanceYourCalm || c.flooded.Load() {
		return false
	}
	c.mu.Lock()
	if c.calmErr != nil || c.closed {
		c.mu.Unlock()
		return false
	}
	c.calmErr = err
	c.draining = true
	c.goaway = true
	// The peer may have sent more of the same before it reads the GOAWAY: one more burst
	// of each budget, then the second overrun closes the connection.
	c.junkBudget, c.resetBudget = rateBudget{}, rateBudget{}
	c.mu.Unlock()
	c.charged() // before the GOAWAY, which the peer may answer with a reconnect
	c.mu.Lock()
	c.queueLocked(ctrlOp{kind: opGoAway, val: uint32(http2.ErrCodeEnhanceYourCalm)})
	c.queueLocked(ctrlOp{kind: opPing, data: calmPing}) // its ack says the GOAWAY was read
	if c.active == 0 {
		c.queueLocked(ctrlOp{kind: opGoAwayEnd})
	}
	c.calmTimer = time.AfterFunc(calmDrainTimeout, func() { c.closeWith(err) })
	c.mu.Unlock()
	return true
}

// charged counts a calm and charges it to the peer's source and identity.
func (c *conn) charged() {
	c.notifyDrop(DropConnCalm)
	if c.onCalm != nil {
		c.onCalm()
	}
}

// fail answers a connection error with GOAWAY (best effort, bounded by a write deadline)
// and closes.
func (c *conn) fail(err error) {
	c.mu.Lock()
	calmed, timer := c.calmErr != nil, c.calmTimer
	c.mu.Unlock()
	if timer != nil {
		timer.Stop()
	}
	var ce connError
	if errors.As(err, &ce) {
		if ce.Code == http2.ErrCodeEnhanceYourCalm && !calmed {
			c.charged()
		}
		c.nc.SetWriteDeadline(time.Now().Add(time.Second))
		c.lockWrite()
		c.writeGoAwayWLocked(ce.Code)
		c.unlockWrite()
	}
	c.closeWith(err)
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

// closeMatching closes every connection of conns whose handshake match returns an error for,
// with that error as the cause its streams see, and returns how many it closed.
func closeMatching(conns []*conn, match func(tls.ConnectionState) error) int {
	n := 0
	for _, c := range conns {
		if err := match(c.tls); err != nil {
			c.closeWith(err)
			n++
		}
	}
	return n
}
