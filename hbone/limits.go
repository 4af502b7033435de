package hbone

// Limits on what one peer may make a connection do. Port 15008 is reachable by every
// workload in the mesh, so a peer with a valid certificate is not a trusted one: before
// these limits, one connection opening streams and resetting each at once (HTTP/2 rapid
// reset, CVE-2023-44487) had a node dial about 80,000 backends a second and grow to
// 500 MB. Each applies to both sides of a connection unless it says "server". What a peer
// may make a whole Server do is admission.go's (per source IP and per peer identity) and
// admit.go's (handshakes); every refusal or wait is told to Config.OnDrop, so the caller
// counts them rather than log each.
//
//   - Streams and handlers (server): at most MAX_CONCURRENT_STREAMS (200) streams are open;
//     a new one past that gets RST_STREAM(REFUSED_STREAM). At most as many handlers run,
//     however early the peer reset their streams: when all are busy a new stream waits for
//     one to return, as net/http does since that CVE (refusing it would refuse an honest
//     client whose closed streams' handlers are still finishing). So handler goroutines
//     and backend sockets stay within the limit per connection, whatever the peer resets.
//   - Early resets (server): a stream refused, or reset by the peer before its handler
//     answered, spends a token of a per-connection budget (earlyReset*, below); a peer that
//     runs out gets a calm close. The h2 crate, the Rust ztunnel's, counts the same
//     streams (max_pending_accept_reset_streams, 20 at a time); a rate also catches a peer
//     whose resets our handlers keep up with. The reset ends the Request's context at
//     once, so the handler's dial stops.
//   - Stream starts (server): StreamStarts handlers start on one connection (a burst of
//     startBurst), each start given back once its stream carries a byte either way or
//     ends; past it a new stream waits in the connection's queue, first in first out, with
//     no goroutine. A peer that opens streams to a live backend and never uses them is set
//     up no faster than that, while an honest client's streams carry bytes within a round
//     trip. Per connection, not per identity: a deployment's pods share an identity, and
//     one of them flooding must not hold its siblings back (each reconnect is held to
//     PeerConnRate instead). No other order is fairer: a ztunnel pools a connection per
//     client pod, so a burst and the streams behind it are one pod's; where a connection
//     carries many clients (a waypoint's), telling them apart means trusting a header the
//     peer writes, and newest-first or random starves the oldest.
//   - Junk frames, which make us work but carry nothing (PING, SETTINGS, PRIORITY, empty
//     DATA, a WINDOW_UPDATE under minUsefulWindowUpdate, RST_STREAM or HEADERS for a
//     stream already gone, unknown frame types, 1xx responses), spend a second budget;
//     past it, a calm close. Keepalive PINGs come every 10 s.
//   - Owed control frames (acks, RST_STREAM, WINDOW_UPDATE) queue for the writer up to
//     maxQueuedControl; past it the connection closes.
//   - Header blocks: 64 KiB decoded on the server, 16 KiB on the client (x/net's Framer
//     enforces it across CONTINUATION frames); frames up to MaxFrameSize.
//   - Calm close (server): a peer that runs out of a budget gets GOAWAY(ENHANCE_YOUR_CALM)
//     and its connection drains rather than closes (conn.go, calmDrain): a pooled
//     connection carries every client of one identity, so a close would cut the honest
//     streams beside the flood. Our Pool takes the connection out of the pool at the
//     GOAWAY, so new streams dial a fresh one while the old ones finish.
//   - A hostile server can do no more to the client: it gets the same frame budgets,
//     PUSH_PROMISE is a connection error, a refused CONNECT is retried at most twice, and
//     Dial's deadline bounds how long an unanswered CONNECT waits.

import (
	"context"
	"errors"
	"time"

	"golang.org/x/net/http2"
)

// The per-connection budgets (the file comment says why each exists).
const (
	// earlyResetBurstPerSlot × MaxConcurrentStreams early resets may come at once: a client
	// whose every pending CONNECT was cancelled together (its pod deleted), twice over.
	earlyResetBurstPerSlot = 2
	// earlyResetRate early resets a second are allowed after the burst: an app retrying
	// connects to a black-holed backend, each cancelled before our dial answers, stays
	// well under it; a rapid-reset flood runs at tens of thousands.
	earlyResetRate = 100
	// junkBurst junk frames at once, then junkRate a second: a keepalive PING comes every
	// 10 s or so, SETTINGS a few times per connection.
	junkBurst = 1000
	junkRate  = 100
	// minUsefulWindowUpdate: a WINDOW_UPDATE smaller than this counts as junk. Peers
	// return window in larger steps (x/net at least 4 KiB, the h2 crate half a window).
	minUsefulWindowUpdate = 1024
	// maxQueuedControl is Go's net/http and nghttp2's bound on control frames owed to a
	// peer that does not read them.
	maxQueuedControl = 10000
)

// ErrPeerReset is the cause (context.Cause) of a Request's context when the peer reset
// the stream.
var ErrPeerReset = errors.New("hbone: stream reset by peer")

// rateBudget is a token bucket: burst events at once, then rate a second.
type rateBudget struct {
	tokens float64
	last   time.Time
}

// take spends one token and reports whether there was one.
func (b *rateBudget) take(now time.Time, burst, rate float64) bool {
	if b.last.IsZero() {
		b.tokens = burst
	} else {
		b.tokens = min(burst, b.tokens+now.Sub(b.last).Seconds()*rate)
	}
	b.last = now
	if b.tokens < 1 {
		return false
	}
	b.tokens--
	return true
}

// refill brings the bucket up to now.
func (b *rateBudget) refill(now time.Time, burst, rate float64) {
	if b.last.IsZero() {
		b.tokens = burst
	} else if now.After(b.last) {
		b.tokens = min(burst, b.tokens+now.Sub(b.last).Seconds()*rate)
	}
	b.last = now
}

// peek reports whether a token is there, without spending it.
func (b *rateBudget) peek(now time.Time, burst, rate float64) bool {
	b.refill(now, burst, rate)
	return b.tokens >= 1
}

// full reports whether the bucket has refilled, so forgetting it changes nothing.
func (b *rateBudget) full(now time.Time, burst, rate float64) bool {
	if rate <= 0 || b.last.IsZero() {
		return true
	}
	b.refill(now, burst, rate)
	return b.tokens >= burst
}

// reserve spends a token now or, if there is none, the next one, and says how long to
// wait for it; it refuses (false, spending nothing) when that wait would pass maxWait.
// Waiting callers queue: each reservation pushes the next one a token further out.
func (b *rateBudget) reserve(now time.Time, burst, rate float64, maxWait time.Duration) (time.Duration, bool) {
	b.refill(now, burst, rate)
	if b.tokens >= 1 {
		b.tokens--
		return 0, true
	}
	wait := time.Duration((1 - b.tokens) / rate * float64(time.Second))
	if wait > maxWait {
		return 0, false
	}
	b.tokens--
	return wait, true
}

// canReserve reports whether reserve would succeed now, spending nothing.
func (b *rateBudget) canReserve(now time.Time, burst, rate float64, maxWait time.Duration) bool {
	b.refill(now, burst, rate)
	return b.tokens >= 1 || time.Duration((1-b.tokens)/rate*float64(time.Second)) <= maxWait
}

// refund gives back one token spent earlier.
func (b *rateBudget) refund(now time.Time, burst, rate float64) {
	b.refill(now, burst, rate)
	b.tokens = min(burst, b.tokens+1)
}

// penalize empties the bucket and puts it d of its rate in debt: the next reserve waits
// d more than it would have, and penalties add up.
func (b *rateBudget) penalize(now time.Time, burst, rate float64, d time.Duration) {
	b.refill(now, burst, rate)
	b.tokens = min(b.tokens, 1) - d.Seconds()*rate
}

// startBurst is the burst of a connection's stream starts, in seconds of StreamStarts (16
// at the default 64/s): the streams a pool opens at once, before it sends on them. Each is
// given back once its stream carries a byte, so an honest burst of new connections waits
// about a round trip per 16 at most; a peer that never sends gets 16 handlers, dials and
// copies per connection at once. It was 1 s (64): an open-streams flood on 4 connections
// then started 256 of them together, and the node's runnable goroutines waited 5–8 ms
// behind them (in-pod, the honest client's p99 2.2–4.8× its baseline; at 16: 1.4–2.6×,
// scheduler waits 0.8–2 ms; docs/PERFORMANCE.md).
const startBurst = 0.25

// startsBurst is the burst for a StreamStarts of rate: startBurst of it, at least one start.
func startsBurst(rate float64) float64 { return max(1, rate*startBurst) }

// takeStartLocked spends one of the connection's stream starts (StreamStarts), reporting
// whether there was one and, if not, how long until there is (c.mu held).
func (c *conn) takeStartLocked() (ok bool, wait time.Duration) {
	rate := c.cfg.StreamStarts
	if rate <= 0 {
		return true, 0
	}
	if c.starts.take(time.Now(), startsBurst(rate), rate) {
		return true, 0
	}
	return false, time.Duration((1 - c.starts.tokens) / rate * float64(time.Second))
}

// earnStartLocked gives the connection a stream start back: its stream carried a byte, so
// its handler was work for a client, not a setup the peer left unused; or it ended, and
// holds no setup any more (c.mu held).
func (c *conn) earnStartLocked() {
	rate := c.cfg.StreamStarts
	c.starts.refund(time.Now(), startsBurst(rate), rate)
}

// calm is the connection error for a peer that ran out of a budget.
func calm(reason string) error { return connError{http2.ErrCodeEnhanceYourCalm, reason} }

// droppedLocked tells the OnDrop hook about a dropped stream and spends a token of the
// early-reset budget (c.mu held).
func (c *conn) droppedLocked(r DropReason) error {
	c.notifyDrop(r)
	burst := float64(earlyResetBurstPerSlot * c.cfg.MaxConcurrentStreams)
	if !c.resetBudget.take(time.Now(), burst, earlyResetRate) {
		return calm("too many streams refused or reset before they were answered")
	}
	return nil
}

// junkLocked spends a token of the junk-frame budget (c.mu held).
func (c *conn) junkLocked() error {
	if !c.junkBudget.take(time.Now(), junkBurst, junkRate) {
		return calm("too many frames that carry nothing")
	}
	return nil
}

// junk is junkLocked for callers without c.mu.
func (c *conn) junk() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.junkLocked()
}

func (c *conn) notifyDrop(r DropReason) {
	if c.cfg.OnDrop != nil {
		c.cfg.OnDrop(r)
	}
}

// Context is the request's context: it ends when the peer resets the stream (cause
// ErrPeerReset), when the connection ends, or when the handler returns. Work the
// handler does for the stream (a dial, a wait for a workload) should use it, so a
// stream the peer gave up on costs nothing more.
func (r *Request) Context() context.Context {
	if r.ctx == nil {
		return context.Background()
	}
	return r.ctx
}
