package hbone

// Per-node budgets (server): limits.go's are per connection, so a peer with N
// connections would get N times them, and a reconnect after each calm close would buy a
// fresh handshake (~0.7 ms of CPU) per cycle. These hold across a Server's connections
// (AdmissionConfig; the ztunnel binary sets them from its HBONE_* variables,
// docs/CONFIGURATION.md), and each refusal or wait goes to Config.OnDrop with its reason.
//
// Before the handshake, by source IP (a refused connection is read nothing: it gets an
// RST, no key exchange and no TIME_WAIT): SourceHandshakes in flight; SourceHandshakeRate
// new connections, past it one waits up to maxFairWait, then is refused;
// SourceFailedHandshakes failures (TLS error, wrong ALPN, no preface, handshake deadline,
// evicted), past it every connection from the source is refused (its burst lets a client
// retry through a certificate rotation). In Istio ambient's in-pod mode an HBONE
// connection comes from the client pod's address, so one pod's storm does not slow its
// node's other pods. But in node mode, or with many pods behind one address (NAT), every
// identity of a node comes from one IP, and a node that restarts reconnects them all at
// once: one connection per identity with traffic to us, up to the node's pods (Kubernetes'
// max-pods is 110 by default, 250 at most on most providers). So the in-flight cap and
// the rate's burst are a node's worth, 256, and a handshake that succeeds gives its rate
// token back: the rate binds a source whose handshakes fail, stall or end in a calm close
// (calmPenalty, a debt on the same bucket), never a node whose identities are all valid.
// (Measured: 200 identities from one IP, all at once, each get a connection and an
// answered stream in 0.65 s with the defaults; with 64 in flight, 127 to 135 of them were
// refused.) A network gateway's address is the exception: it relays many clients' double
// HBONE, so AdmissionConfig.SourceRelays exempts it from these and from PeerConnRate (the
// ztunnel binary names every network gateway its workload store knows).
//
// After the handshake, by peer identity (connections without one, h2c, are not counted):
// PeerConnRate new connections, past it one waits up to maxFairWait, then is closed: this
// is where a source with valid certificates that churns connections is slowed;
// PeerStreams open streams, past it a new one gets REFUSED_STREAM, sized for fan-in, not
// for one client (every pod of a deployment shares its identity, and thousands of them
// holding a few pooled connections each to one database pod is ordinary; the Rust ztunnel
// has no such limit), while 16384 proxied connections are a few percent of what a node's
// descriptors allow; PeerDials streams whose handler has not answered (a backend dial),
// past it a new one waits, so a peer that floods CONNECTs to a live backend holds that
// many dials at most, whatever its number of connections. A budget keyed by identity is
// shared by every client of that identity: an honest one of the same identity waits too,
// another identity never does.
//
// At most HandshakeWorkers ServeTLS handshakes compute at once: a handshake holds its
// place only between its reads, so one stalled by its peer holds none, and one P is always
// left to established connections. Per-source and per-identity entries are forgotten once
// idle with full buckets, swept when their number passes 4096.

import (
	"context"
	"net"
	"net/netip"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gozt/gozt/identity"
)

// maxFairWait is the longest a connection waits for a rate budget's next token; past it
// the connection is refused instead.
const maxFairWait = time.Second

// sweepAt is the number of tracked sources (or identities) at which idle entries whose
// buckets have refilled are forgotten.
const sweepAt = 4096

// admission holds a Server's per-source and per-identity budgets.
type admission struct {
	cfg *AdmissionConfig
	// gate: handshakes computing (not waiting for the network) at once.
	gate chan struct{}
	// room: the accept side's backpressure (admit.go), MaxHandshakes in their handshake
	// and as many again evicted and leaving.
	room acceptRoom
	// hold: connections refused as they were accepted, until their RST is due (hold.go).
	hold refusalHold

	mu        sync.Mutex
	sources   map[netip.Addr]*sourceState // guarded by mu
	peers     map[identity.ID]*peerState  // guarded by mu
	sweepSrc  int                         // guarded by mu: len(sources) that triggers the next sweep
	sweepPeer int                         // guarded by mu: len(peers) that triggers the next sweep
}

// sourceState is one source IP's budgets; its fields are guarded by admission.mu.
type sourceState struct {
	inFlight int        // connections from it in their handshake
	rate     rateBudget // new connections
	failed   rateBudget // failed handshakes; while empty the source's connections are refused
}

// peerState is one peer identity's budgets.
type peerState struct {
	conns int        // guarded by admission.mu: its connections serving HTTP/2
	rate  rateBudget // guarded by admission.mu: its new connections

	streams atomic.Int64  // its open streams, across its connections
	dials   chan struct{} // a semaphore: its streams whose handler has not answered
}

func newAdmission(cfg *ServerConfig) *admission {
	f := &admission{
		cfg:       &cfg.Admission,
		sources:   make(map[netip.Addr]*sourceState),
		peers:     make(map[identity.ID]*peerState),
		sweepSrc:  sweepAt,
		sweepPeer: sweepAt,
		room:      acceptRoom{limit: 2 * int64(cfg.MaxHandshakes)},
		hold:      refusalHold{wait: cfg.DialTimeout, limit: maxHeldPer * cfg.MaxHandshakes},
	}
	if cfg.Admission.HandshakeWorkers > 0 {
		f.gate = make(chan struct{}, cfg.Admission.HandshakeWorkers)
	}
	return f
}

// sourceOf is the IP a connection comes from (invalid if it is not IP).
func sourceOf(c net.Conn) netip.Addr {
	if a, ok := c.RemoteAddr().(*net.TCPAddr); ok {
		return a.AddrPort().Addr().Unmap()
	}
	return netip.Addr{}
}

// admitSource decides on a new connection from src before its handshake: refused (a
// reason), admitted at once, or admitted after wait. An admitted connection holds one
// of src's handshake places until the returned release is called (idempotent).
// A relay's connections (AdmissionConfig.SourceRelays) are admitted at once.
func (f *admission) admitSource(src netip.Addr, relay bool) (release func(failed bool), wait time.Duration, refused DropReason, ok bool) {
	cfg := f.cfg
	if !src.IsValid() || relay {
		return func(bool) {}, 0, 0, true
	}
	now := time.Now()
	f.mu.Lock()
	defer f.mu.Unlock()
	st := f.sources[src]
	if st == nil {
		if len(f.sources) >= f.sweepSrc {
			f.sweepSourcesLocked(now)
		}
		st = &sourceState{}
		f.sources[src] = st
	}
	if reason, no := f.refusalLocked(st, now); no {
		return nil, 0, reason, false
	}
	if cfg.SourceHandshakeRate > 0 {
		wait, _ = st.rate.reserve(now, cfg.SourceHandshakeRate*sourceBurst, cfg.SourceHandshakeRate, maxFairWait)
	}
	st.inFlight++
	var once atomic.Bool
	return func(failed bool) {
		if once.Swap(true) {
			return
		}
		now := time.Now()
		f.mu.Lock()
		st.inFlight--
		if failed && cfg.SourceFailedHandshakes > 0 {
			st.failed.take(now, cfg.SourceFailedHandshakes*failBurst, cfg.SourceFailedHandshakes)
		}
		if !failed && cfg.SourceHandshakeRate > 0 {
			// A handshake that succeeded gives its token back: the rate binds a source
			// whose handshakes fail or end in a calm close, not a node whose many
			// identities reconnect at once from its one IP (the file comment).
			st.rate.refund(now, cfg.SourceHandshakeRate*sourceBurst, cfg.SourceHandshakeRate)
		}
		f.mu.Unlock()
	}, wait, 0, true
}

// refusal is what admitSource would refuse a new connection from src for now, if
// anything, spending nothing. An accept loop asks it before it does anything else with the
// connection (AdmitListener), so that a source past its budgets, a flood of handshakes
// that stall, costs the node an accept and a close per connection rather than the socket
// setup, goroutine hand-off and TLS state the serving path gives a connection before
// admitSource.
func (f *admission) refusal(src netip.Addr, relay bool) (DropReason, bool) {
	if !src.IsValid() || relay {
		return 0, false
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	st := f.sources[src]
	if st == nil {
		return 0, false
	}
	return f.refusalLocked(st, time.Now())
}

// refusalLocked is refusal for a source's state (f.mu held).
func (f *admission) refusalLocked(st *sourceState, now time.Time) (DropReason, bool) {
	cfg := f.cfg
	switch {
	case cfg.SourceFailedHandshakes > 0 && !st.failed.peek(now, cfg.SourceFailedHandshakes*failBurst, cfg.SourceFailedHandshakes):
		return DropSourceFailures, true
	case cfg.SourceHandshakes > 0 && st.inFlight >= cfg.SourceHandshakes:
		return DropSourceHandshakes, true
	case cfg.SourceHandshakeRate > 0 && !st.rate.canReserve(now, cfg.SourceHandshakeRate*sourceBurst, cfg.SourceHandshakeRate, maxFairWait):
		return DropSourceRate, true
	}
	return 0, false
}

// admitPeer decides on a connection of identity id once its handshake is over, as
// admitSource does. An admitted connection is counted until leavePeer. One that came
// through a relay is not held to PeerConnRate: double HBONE makes a connection per
// proxied connection, which no pool amortises.
func (f *admission) admitPeer(id identity.ID, relay bool) (ps *peerState, wait time.Duration, ok bool) {
	cfg := f.cfg
	now := time.Now()
	f.mu.Lock()
	defer f.mu.Unlock()
	ps = f.peers[id]
	if ps == nil {
		if len(f.peers) >= f.sweepPeer {
			f.sweepPeersLocked(now)
		}
		ps = &peerState{}
		if cfg.PeerDials > 0 {
			ps.dials = make(chan struct{}, cfg.PeerDials)
		}
		f.peers[id] = ps
	}
	if cfg.PeerConnRate > 0 && !relay {
		w, ok := ps.rate.reserve(now, cfg.PeerConnRate*peerBurst, cfg.PeerConnRate, maxFairWait)
		if !ok {
			return nil, 0, false
		}
		wait = w
	}
	ps.conns++
	return ps, wait, true
}

// calmPenalty is how much later a source's and an identity's next new connection may
// come after one of their connections was closed with ENHANCE_YOUR_CALM, on top of their
// rates: a peer that reconnects at once after each would otherwise buy a fresh handshake
// and fresh per-connection budgets per cycle. Calms add up; past maxFairWait of them the
// next connections are refused until the rate pays them back.
const calmPenalty = 500 * time.Millisecond

// calmed charges calmPenalty to src and to ps (nil: no identity).
func (f *admission) calmed(src netip.Addr, ps *peerState) {
	cfg := f.cfg
	now := time.Now()
	f.mu.Lock()
	defer f.mu.Unlock()
	if st := f.sources[src]; st != nil && cfg.SourceHandshakeRate > 0 {
		st.rate.penalize(now, cfg.SourceHandshakeRate*sourceBurst, cfg.SourceHandshakeRate, calmPenalty)
	}
	if ps != nil && cfg.PeerConnRate > 0 {
		ps.rate.penalize(now, cfg.PeerConnRate*peerBurst, cfg.PeerConnRate, calmPenalty)
	}
}

// leavePeer ends what admitPeer began, taking the connection's remaining open streams
// (n) off the identity's count.
func (f *admission) leavePeer(ps *peerState, n int64) {
	ps.streams.Add(-n)
	f.mu.Lock()
	ps.conns--
	f.mu.Unlock()
}

// sweepSourcesLocked forgets sources with nothing in flight whose buckets have refilled
// (f.mu held), and sets the size that triggers the next sweep.
func (f *admission) sweepSourcesLocked(now time.Time) {
	cfg := f.cfg
	for a, st := range f.sources {
		if st.inFlight == 0 && st.rate.full(now, cfg.SourceHandshakeRate*sourceBurst, cfg.SourceHandshakeRate) &&
			st.failed.full(now, cfg.SourceFailedHandshakes*failBurst, cfg.SourceFailedHandshakes) {
			delete(f.sources, a)
		}
	}
	f.sweepSrc = max(sweepAt, 2*len(f.sources))
}

// sweepPeersLocked is sweepSourcesLocked for identities.
func (f *admission) sweepPeersLocked(now time.Time) {
	cfg := f.cfg
	for id, ps := range f.peers {
		if ps.conns == 0 && ps.rate.full(now, cfg.PeerConnRate*peerBurst, cfg.PeerConnRate) {
			delete(f.peers, id)
		}
	}
	f.sweepPeer = max(sweepAt, 2*len(f.peers))
}

// Bursts of the rate budgets, in seconds of their rate.
const (
	// sourceBurst: new connections of one source IP: a node's pods (up to 250, Kubernetes'
	// usual max-pods) each reconnecting at once from the node's IP after a restart.
	sourceBurst = 8
	peerBurst   = 4 // new connections of one identity: its pools reconnecting after a restart
	failBurst   = 8 // failed handshakes: a client retrying through a certificate rotation
)

// enterHandshake takes a place in the handshake gate, waiting while every place is
// taken; it fails only when ctx (the connection's: it ends when the connection is evicted
// past MaxHandshakes) ends first.
//
// A handshake that had to wait yields its P once it has the place. The handshake that
// gave the place up woke it, and Go's scheduler runs a woken goroutine next on the waker's
// P, in its time slice: handshakes queued at the gate ran one after another on one P
// (each gives its place up at its next read, waking the next) for as long as the queue
// lasted, up to the runtime's 10 ms time slice at a time, while goroutines the netpoller
// had made runnable there (established connections' readers) waited. A flood of stalled
// handshakes makes such queues (each read a ClientHello that needs a key exchange): 112
// handshake steps back to back, 35 ms, in one trace (docs/PERFORMANCE.md). After the
// yield the handshake runs behind them.
func (f *admission) enterHandshake(ctx context.Context) bool {
	select {
	case f.gate <- struct{}{}:
		return true
	default:
	}
	select {
	case f.gate <- struct{}{}:
		runtime.Gosched()
		return true
	case <-ctx.Done():
	}
	return false
}

func (f *admission) leaveHandshake() { <-f.gate }

// gatedConn is the raw connection under a server handshake: it holds a place in the
// handshake gate while the handshake computes and gives it up while it waits for the
// peer, so that at most HandshakeWorkers handshakes take CPU at once (below GOMAXPROCS,
// leaving a P to the established connections) while a handshake stalled by its peer
// holds none.
type gatedConn struct {
	net.Conn
	f    *admission
	ctx  context.Context
	held bool // a place is held; only the handshake's goroutine reads and writes it
	// over: the handshake is over and reads pass straight through. Set by the serving
	// goroutine, which then runs the frame reader, the only other reader. (The conn stays
	// under the bufConn rather than being swapped out: crypto/tls may still be closing it
	// from its context watcher.)
	over bool
}

func (g *gatedConn) Read(p []byte) (int, error) {
	if g.over {
		return g.Conn.Read(p)
	}
	g.leave()
	n, err := g.Conn.Read(p)
	if err == nil && !g.f.enterHandshake(g.ctx) {
		return n, net.ErrClosed
	}
	g.held = err == nil
	return n, err
}

// done ends the handshake's part: the place is given up and reads pass through.
func (g *gatedConn) done() {
	g.leave()
	g.over = true
}

// leave gives the place up, if held (the handshake's goroutine only).
func (g *gatedConn) leave() {
	if g.held {
		g.held = false
		g.f.leaveHandshake()
	}
}

// TCP makes gatedConn a ktls.TCPWrapper.
func (g *gatedConn) TCP() *net.TCPConn { return tcpOf(g.Conn) }

// refuse closes a connection refused before its handshake at the least cost: no TLS, and
// an RST rather than a FIN, so the server keeps no TIME_WAIT for it.
func refuse(c net.Conn) {
	if tc := tcpOf(c); tc != nil {
		tc.SetLinger(0)
	}
	c.Close()
}

// handshakeWorkers is the default AdmissionConfig.HandshakeWorkers: one less than the Ps, so
// handshakes never take every one of them.
func handshakeWorkers() int { return max(1, runtime.GOMAXPROCS(0)-1) }

// tryDial takes a place among the identity's streams that wait for their handler's
// answer (a backend dial, in a proxy) if one is free; waitDial waits for one, or for
// ctx to end.
func (ps *peerState) tryDial() bool {
	if ps == nil || ps.dials == nil {
		return true
	}
	select {
	case ps.dials <- struct{}{}:
		return true
	default:
		return false
	}
}

func (ps *peerState) waitDial(ctx context.Context) bool {
	select {
	case ps.dials <- struct{}{}:
		return true
	case <-ctx.Done():
		return false
	}
}

// dialHeld and leaveDial: a Request holds its place from before its handler runs until
// it is answered or its handler returns, whichever comes first.
func (r *Request) leaveDial() {
	if r.dialHeld.Swap(false) {
		<-r.s.c.peerBudget.dials
	}
}
