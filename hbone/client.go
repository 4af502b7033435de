package hbone

import (
	"context"
	"crypto/fips140"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/gozt/gozt/internal/ktls"
	"golang.org/x/net/http2"
)

// Pool is the HBONE client: CONNECT streams over pooled mTLS HTTP/2 connections, one set
// of connections per Key. A key has one dial in flight at a time; a connection leaves the
// pool once idle for IdleTimeout, or at the peer's GOAWAY (never reused after it); a
// CONNECT left unanswered by a refusal, or by a pooled connection breaking under it, is
// retried on another (DialBy).
type Pool struct {
	cfg       ClientConfig
	tlsConfig func(ctx context.Context, k Key) (*tls.Config, error)
	wg        sync.WaitGroup // connection goroutines

	mu     sync.Mutex
	kernel kernelMemo

	keys   map[Key]*keyPool
	all    map[*conn]struct{} // every live connection, pooled or draining
	closed bool
}

type keyPool struct {
	conns   []*conn
	dialing chan struct{} // non-nil while the key's one dial is in flight; closed when it ends
	extra   int           // conns dialed only because the others were congested (see get)
}

// maxCongestionDials caps the connections per key that get dials only because every other
// one is congested. Past it new streams share a congested connection again, so stalled
// streams can hold at most (1 + maxCongestionDials) connection windows per key: 80 MiB
// with the defaults. A variable for tests.
var maxCongestionDials = 4

// NewPool returns a pool. tlsConfig is asked once per new connection for a client config
// (client certificate, peer verification against k.Expected()); ALPN h2 is added if missing.
func NewPool(cfg ClientConfig, tlsConfig func(ctx context.Context, k Key) (*tls.Config, error)) *Pool {
	return &Pool{cfg: cfg.withDefaults(), tlsConfig: tlsConfig, keys: make(map[Key]*keyPool), all: make(map[*conn]struct{})}
}

// Dial opens one CONNECT stream to authority on a pooled connection for k and returns
// once the peer answered 200. Any other status is a *StatusError. It returns within
// DialTimeout (or by ctx's deadline, if sooner) whatever the peer does: waiting for another
// caller's dial of k, the dial, TLS, SETTINGS and the CONNECT answer all end by then, and
// without a context of its own to allocate.
func (p *Pool) Dial(ctx context.Context, k Key, authority string, hdr http.Header) (*Stream, error) {
	return p.DialBy(ctx, time.Time{}, k, authority, hdr)
}

// DialBy is Dial ending by, if by is set and earlier than Dial's own deadline: one attempt of
// several that share a deadline (the proxy's retries on other endpoints), without a context
// to allocate.
func (p *Pool) DialBy(ctx context.Context, by time.Time, k Key, authority string, hdr http.Header) (*Stream, error) {
	deadline := p.deadline(ctx)
	if !by.IsZero() && by.Before(deadline) {
		deadline = by
	}
	var err error
	for range 3 {
		c, dialed, gerr := p.get(ctx, deadline, k)
		if gerr != nil {
			return nil, gerr
		}
		var s *Stream
		s, err = c.open(ctx, deadline, authority, hdr)
		if err == nil {
			return s, nil
		}
		// Retried: a stream the peer never processed (GOAWAY, REFUSED_STREAM), and one left
		// unanswered when a pooled connection broke under it. A pooled connection can be
		// stale (the peer gone and its IP reused, PINGs not yet missed) and only a write
		// finds out. No data was sent yet, so a new CONNECT loses nothing. A connection
		// this call dialed itself is not retried: a peer that breaks every connection
		// would have us dial in a loop.
		stale := !dialed && errors.Is(err, ErrConnClosed) && ctx.Err() == nil
		if !errors.Is(err, errRefused) && !stale {
			return nil, err
		}
	}
	return nil, err
}

// deadline is when a dial or CONNECT begun now must be done: DialTimeout from now, or
// ctx's deadline if sooner.
func (p *Pool) deadline(ctx context.Context) time.Time {
	d := time.Now().Add(p.cfg.DialTimeout)
	if cd, ok := ctx.Deadline(); ok && cd.Before(d) {
		return cd
	}
	return d
}

// get returns a connection for k with one stream slot reserved for the caller, and whether
// it dialed that connection itself, by deadline.
func (p *Pool) get(ctx context.Context, deadline time.Time, k Key) (*conn, bool, error) {
	for {
		p.mu.Lock()
		if p.closed {
			p.mu.Unlock()
			return nil, false, errClosed
		}
		kp := p.keys[k]
		if kp == nil {
			kp = &keyPool{}
			p.keys[k] = kp
		}
		// A congested connection (its receive window held by streams whose readers
		// stopped) would make a new stream wait behind them: head-of-line blocking, a
		// known complaint against the Rust ztunnel (istio/ztunnel#1945). Skip those,
		// unless the key has dialed its share of connections for congestion already.
		congested := false
		for _, c := range kp.conns {
			switch c.tryReserve(false) {
			case reserved:
				p.mu.Unlock()
				return c, false, nil
			case congestedConn:
				congested = true
			}
		}
		if congested && kp.extra >= maxCongestionDials {
			for _, c := range kp.conns {
				if c.tryReserve(true) == reserved {
					p.mu.Unlock()
					return c, false, nil
				}
			}
		}
		if ch := kp.dialing; ch != nil {
			p.mu.Unlock()
			if err := waitDial(ctx, deadline, ch); err != nil {
				return nil, false, fmt.Errorf("hbone: waiting for a connection to %s: %w", k.Addr, err)
			}
			continue
		}
		ch := make(chan struct{})
		kp.dialing = ch
		p.mu.Unlock()

		c, err := p.dial(ctx, deadline, k)

		p.mu.Lock()
		kp.dialing = nil
		close(ch)
		if err == nil && p.closed {
			err = errClosed
		}
		if err == nil && c.leaving() {
			// It broke or was sent GOAWAY before it joined the pool: its onClose found
			// nothing to remove then, so adding it now would keep it (and the key) for good.
			err = fmt.Errorf("hbone: dial %s: %w", k.Addr, ErrConnClosed)
		}
		if err != nil {
			p.dropKeyLocked(k, kp)
			p.mu.Unlock()
			if c != nil {
				c.closeWith(err)
			}
			return nil, false, err
		}
		kp.conns = append(kp.conns, c)
		if congested && kp.extra < maxCongestionDials {
			c.extra = true
			kp.extra++
		}
		ok := c.tryReserve(true) == reserved
		p.mu.Unlock()
		if ok {
			return c, true, nil
		}
		if c.limit() == 0 { // SETTINGS_MAX_CONCURRENT_STREAMS = 0: do not dial in a loop
			return nil, false, fmt.Errorf("hbone: %s: peer allows no streams", k.Addr)
		}
		// It closed or got GOAWAY after the check above (its onClose removes it): look again.
	}
}

// waitDial waits for another caller's dial to end (ch closed), until ctx ends or deadline.
func waitDial(ctx context.Context, deadline time.Time, ch chan struct{}) error {
	t := time.NewTimer(time.Until(deadline))
	defer t.Stop()
	select {
	case <-ch:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return context.DeadlineExceeded
	}
}

func (p *Pool) dropKeyLocked(k Key, kp *keyPool) {
	if len(kp.conns) == 0 && kp.dialing == nil && p.keys[k] == kp {
		delete(p.keys, k)
	}
}

// remove takes c out of the pool (GOAWAY or closed); its streams carry on.
func (p *Pool) remove(k Key, c *conn) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if kp := p.keys[k]; kp != nil && slices.Contains(kp.conns, c) {
		kp.conns = slices.DeleteFunc(kp.conns, func(x *conn) bool { return x == c })
		if c.extra {
			kp.extra--
		}
		p.dropKeyLocked(k, kp)
	}
}

func (p *Pool) dial(ctx context.Context, deadline time.Time, k Key) (*conn, error) {
	ctx, cancel := context.WithDeadline(ctx, deadline)
	defer cancel()
	tc, err := p.h2Config(ctx, k)
	if err != nil {
		return nil, err
	}
	d := net.Dialer{Control: p.cfg.Control}
	if k.SrcIP.IsValid() {
		d.LocalAddr = &net.TCPAddr{IP: k.SrcIP.AsSlice()}
	}
	var raw net.Conn
	if p.cfg.Dial != nil {
		raw, err = p.cfg.Dial(ctx, &d, "tcp", k.Addr.String())
	} else {
		raw, err = d.DialContext(ctx, "tcp", k.Addr.String())
	}
	if err != nil {
		return nil, dialErr(k, err, ctx)
	}
	c, err := p.handshakeOver(ctx, raw, tc, k, "tls handshake")
	if err != nil {
		return nil, err
	}
	if err := c.waitSettings(ctx); err != nil { // the pool needs the peer's stream limit
		c.closeWith(err)
		return nil, dialErr(k, fmt.Errorf("waiting for SETTINGS: %w", err), ctx)
	}
	return c, nil
}

// h2Config is k's TLS client config with h2 in its ALPN, after NextProtoNoKeyUpdate.
func (p *Pool) h2Config(ctx context.Context, k Key) (*tls.Config, error) {
	tc, err := p.tlsConfig(ctx, k)
	if err != nil {
		return nil, fmt.Errorf("hbone: tls config for %s: %w", k.Addr, err)
	}
	tc = tc.Clone()
	if !slices.Contains(tc.NextProtos, http2.NextProtoTLS) {
		tc.NextProtos = append(tc.NextProtos, http2.NextProtoTLS)
	}
	if !slices.Contains(tc.NextProtos, NextProtoNoKeyUpdate) {
		tc.NextProtos = append([]string{NextProtoNoKeyUpdate}, tc.NextProtos...)
	}
	return tc, nil
}

// fipsHint is what a client handshake the peer refused adds to its error in FIPS 140-3
// mode, where crypto/tls offers only approved parameters: the peer may accept none of them
// (X25519 alone, say), which its handshake_failure alert does not say.
func fipsHint(err error, tc *tls.Config) string {
	var op *net.OpError
	if !fips140.Enabled() || !errors.As(err, &op) || op.Op != "remote error" || !strings.HasSuffix(op.Err.Error(), "handshake failure") {
		return ""
	}
	return fmt.Sprintf(" (FIPS 140-3 mode: this node offered only approved parameters, key exchange %v and AES-GCM; the peer may accept none of them)", tc.CurvePreferences)
}

// handshakeOver runs the TLS client handshake over raw, checks the peer chose h2 and starts
// the HTTP/2 connection; on error raw is closed. what names the handshake in errors.
func (p *Pool) handshakeOver(ctx context.Context, raw net.Conn, tc *tls.Config, k Key, what string) (*conn, error) {
	ts := startTLS(raw, tc, false, &p.cfg.Config, &p.kernel)
	if err := ts.handshake(ctx); err != nil {
		raw.Close()
		return nil, dialErr(k, fmt.Errorf("%s: %w%s", what, err, fipsHint(err, tc)), ctx)
	}
	if h2, _ := negotiatedH2(ts.tc); !h2 {
		raw.Close()
		return nil, fmt.Errorf("hbone: dial %s: peer did not negotiate ALPN h2", k.Addr)
	}
	nc, bc, kc, err := ts.finish(&p.cfg.Config, &p.kernel)
	if err != nil {
		raw.Close()
		return nil, fmt.Errorf("hbone: dial %s: %w", k.Addr, err)
	}
	return p.startConn(ctx, k, nc, bc, kc)
}

// DialOver opens one CONNECT stream to authority on a new mTLS HTTP/2 connection run
// over raw, outside the pool: double HBONE's inner connection, raw being a CONNECT stream
// to a network gateway that carries its bytes to the destination (k.Addr names it in
// errors, k's identities are checked as Dial's). Pooling it would pin every later
// connection to whichever workload behind the gateway this one reached. The connection
// ends when the returned stream does, closing raw; on error raw is closed too. Its TLS
// stays in user space and its bytes are not spliced: raw is not a socket.
func (p *Pool) DialOver(ctx context.Context, raw net.Conn, k Key, authority string, hdr http.Header) (*Stream, error) {
	deadline := p.deadline(ctx)
	dctx, cancel := context.WithDeadline(ctx, deadline)
	defer cancel()
	tc, err := p.h2Config(dctx, k)
	if err != nil {
		raw.Close()
		return nil, err
	}
	c, err := p.handshakeOver(dctx, raw, tc, k, "inner tls handshake")
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	c.single = true
	c.reserved++
	c.mu.Unlock()
	// The CONNECT goes without waiting for the peer's SETTINGS (HTTP/2 allows it; the
	// defaults hold until they come): a round trip less through the gateway.
	s, err := c.open(ctx, deadline, authority, hdr)
	if err != nil {
		c.closeWith(err)
		return nil, err
	}
	return s, nil
}

// startConn runs HTTP/2 on an established connection: preface and the connection's two
// goroutines.
func (p *Pool) startConn(ctx context.Context, k Key, nc net.Conn, bc *bufConn, kc *ktls.Conn) (*conn, error) {
	c := newConn(p.cfg.conn(), false, nc, bc, kc)
	c.onClose = func(c *conn) { p.remove(k, c) }
	if err := c.writePreface(); err != nil {
		nc.Close()
		return nil, fmt.Errorf("hbone: dial %s: preface: %w", k.Addr, err)
	}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		nc.Close()
		return nil, errClosed
	}
	p.all[c] = struct{}{}
	p.wg.Add(2)
	p.mu.Unlock()
	c.wg.Add(1)
	go func() { defer p.wg.Done(); c.writeLoop() }()
	go func() {
		defer p.wg.Done()
		c.runClientReader()
		c.reportKernelEnd()
		p.mu.Lock()
		delete(p.all, c)
		p.mu.Unlock()
	}()
	return c, nil
}

func dialErr(k Key, err error, ctx context.Context) error {
	if errors.Is(ctx.Err(), context.DeadlineExceeded) {
		return fmt.Errorf("hbone: dial %s: connection timed out, maybe a NetworkPolicy is blocking HBONE port 15008: %w", k.Addr, err)
	}
	return fmt.Errorf("hbone: dial %s: %w", k.Addr, err)
}

// runClientReader is a pooled connection's frame reader; the connection ends with it.
func (c *conn) runClientReader() {
	err := c.readLoop()
	c.fail(err)
	c.wg.Wait()
}

// leaving reports whether c has closed or been sent GOAWAY: no new streams, out of the pool.
func (c *conn) leaving() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.closed || c.goaway
}

type reservation uint8

const (
	full          reservation = iota // closed, going away or at its stream limit
	congestedConn                    // has a slot, but congested and not allowed
	reserved
)

// tryReserve claims a stream slot if the connection can take another stream; a
// congested one only when allowCongested.
func (c *conn) tryReserve(allowCongested bool) reservation {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed || c.goaway || c.active+c.reserved >= c.limitLocked() {
		return full
	}
	if !allowCongested && c.congestedLocked() {
		return congestedConn
	}
	c.reserved++
	return reserved
}

// congestedLocked reports whether so much of the connection's receive window is held by
// data nobody has read that a new stream could not get going at full speed: less than a
// stream window of room left (or half the connection window, if that is smaller). Room
// comes back as the readers catch up.
func (c *conn) congestedLocked() bool {
	room := c.recvConnAvail + c.connUnacked
	return room < min(int64(c.cfg.StreamWindow), int64(c.cfg.ConnWindow)/2)
}

// limitLocked is the stream capacity: min(MaxStreamsPerConn, peer's MAX_CONCURRENT_STREAMS).
func (c *conn) limitLocked() int {
	return min(c.cfg.MaxStreamsPerConn, int(min(c.peerMaxStreams, 1<<30)))
}

func (c *conn) limit() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.limitLocked()
}

// errNoAnswer ends a CONNECT whose answer did not come by its deadline.
var errNoAnswer = fmt.Errorf("no answer in time: %w", context.DeadlineExceeded)

// open sends the CONNECT request on a reserved slot and waits for the response, until ctx
// ends or deadline.
func (c *conn) open(ctx context.Context, deadline time.Time, authority string, hdr http.Header) (*Stream, error) {
	c.lockWrite()
	// The RST_STREAMs that Close queued for writeLoop go out first: the peer frees their
	// slots only when it reads them, and a HEADERS that overtook them would find its
	// MAX_CONCURRENT_STREAMS still taken by streams we count as gone (REFUSED_STREAM).
	if closeAfter, err := c.writeOpsWLocked(); err != nil || closeAfter {
		c.unlockWrite()
		c.closeWith(err)
		c.mu.Lock()
		c.reserved--
		c.mu.Unlock()
		return nil, fmt.Errorf("hbone: CONNECT %s: %w", authority, errRefused)
	}
	c.mu.Lock()
	c.reserved--
	if c.closed || c.goaway || c.nextID > 1<<31-1 {
		c.goaway = true
		if c.active == 0 && c.reserved == 0 {
			c.queueLocked(ctrlOp{kind: opGoAwayEnd})
		}
		c.mu.Unlock()
		c.unlockWrite()
		return nil, errRefused
	}
	id := c.nextID
	c.nextID += 2
	s := c.newStreamLocked(id)
	c.mu.Unlock()
	err := c.writeHeadersWLocked(id, false, 0, authority, hdr)
	if ferr := c.unlockWrite(); err == nil {
		err = ferr
	}
	if err != nil {
		c.closeWith(err)
		return nil, fmt.Errorf("hbone: CONNECT %s: %w: %w", authority, ErrConnClosed, err)
	}
	stop := context.AfterFunc(ctx, s.wake)
	defer stop()
	c.mu.Lock()
	for !s.gotResp {
		err := s.rerr
		if err == nil {
			err = c.err
		}
		if err == nil && ctx.Err() != nil {
			err = ctx.Err()
		}
		if err == nil && !time.Now().Before(deadline) {
			err = errNoAnswer
		}
		if err != nil {
			c.mu.Unlock()
			s.Close()
			return nil, fmt.Errorf("hbone: CONNECT %s: %w", authority, err)
		}
		c.answerByLocked(deadline)
		s.cond.Wait()
	}
	code := s.status
	c.mu.Unlock()
	if code != http.StatusOK {
		s.Close()
		return nil, &StatusError{Code: code}
	}
	return s, nil
}

// answerByLocked has the connection's timer wake the CONNECTs waiting for their answer
// at deadline, if it is not set to wake them sooner (c.mu held). One timer a connection,
// made once and reset, so a CONNECT allocates none.
func (c *conn) answerByLocked(deadline time.Time) {
	if !c.answerAt.IsZero() && !deadline.Before(c.answerAt) {
		return
	}
	c.answerAt = deadline
	if c.answerTimer == nil {
		c.answerTimer = time.AfterFunc(time.Until(deadline), c.answersDue)
	} else {
		c.answerTimer.Reset(time.Until(deadline))
	}
}

// answersDue wakes every CONNECT waiting for its answer: each returns if its deadline has
// passed, or waits again and sets the timer for its own.
func (c *conn) answersDue() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.answerAt = time.Time{}
	for _, s := range c.streams {
		if !s.gotResp {
			s.cond.Broadcast()
		}
	}
}

// CloseMatching closes every connection, pooled or draining, whose TLS handshake match
// returns an error for (a peer certificate revoked since, say), with that error as the cause
// its streams see, and returns how many it closed. match must not block.
func (p *Pool) CloseMatching(match func(tls.ConnectionState) error) int {
	p.mu.Lock()
	conns := make([]*conn, 0, len(p.all))
	for c := range p.all {
		conns = append(conns, c)
	}
	p.mu.Unlock()
	return closeMatching(conns, match)
}

// Close closes every connection and waits for their goroutines. Idempotent.
func (p *Pool) Close() error {
	p.mu.Lock()
	p.closed = true
	conns := make([]*conn, 0, len(p.all))
	for c := range p.all {
		conns = append(conns, c)
	}
	p.mu.Unlock()
	for _, c := range conns {
		c.closeWith(errClosed)
	}
	p.wg.Wait()
	return nil
}
