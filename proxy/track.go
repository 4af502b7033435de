package proxy

import (
	"context"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"

	"github.com/gozt/gozt/hbone"
	"github.com/gozt/gozt/metrics"
	"github.com/gozt/gozt/proxy/rbac"
	"github.com/gozt/gozt/xds/state"
)

// tracker owns every connection goroutine, for drain (wait, then force-close) and for
// re-checking live inbound connections when policies change.
type tracker struct {
	mu       sync.Mutex
	draining bool
	live     map[*liveConn]struct{}
	wg       sync.WaitGroup
}

// liveConn is one proxied connection the tracker holds: its closable parts, its copy and
// record and, for inbound ones, what policy sees of it. Everything a held connection keeps
// of its own, beyond its sockets and stream, is in this one object.
type liveConn struct {
	closed  atomic.Bool // close has run
	denied  atomic.Bool // inbound: closed by a policy change
	inbound bool

	// dst is the destination workload of an inbound connection, nil outbound; policy
	// changes re-evaluate the inbound ones against attrs. attrs.DstIP and DstPort are
	// where the client was going, inbound and outbound (originalDst).
	dst   *state.Workload
	attrs rbac.Conn

	// What close closes and Connections shows, set before the connection is registered:
	// client alone while it is being set up (handleTracked's record), both once handOff
	// has it; formatted only when asked for, so a connection costs no strings for it.
	client, server net.Conn

	// copy is the connection's copy (copy.go), set up by handOff; its p is nil before, and
	// in handleTracked's record.
	copy parkCopy
	// rec is the connection's metrics and access-log record, opened before handOff.
	rec metrics.Conn
}

// originalDst is where the client was going.
func (c *liveConn) originalDst() netip.AddrPort {
	return netip.AddrPortFrom(c.attrs.DstIP, c.attrs.DstPort)
}

// ConnInfo describes one proxied connection, in the shape /config_dump's workloadState
// shows (the Rust ztunnel's, which istioctl reads).
type ConnInfo struct {
	Src         string `json:"src"`
	OriginalDst string `json:"originalDst"` // where the client was going
	ActualDst   string `json:"actualDst"`   // what the proxy connected to
	Protocol    string `json:"protocol"`    // HBONE or TCP
	// TLS says where an HBONE connection's TLS records are handled: "kernel" (kernel
	// TLS) or "user" (crypto/tls). A gozt field; empty for TCP.
	TLS string `json:"tls,omitempty"`
}

// Connections lists the connections the proxy carries now, inbound and outbound.
func (p *Proxy) Connections() (inbound, outbound []ConnInfo) {
	inbound, outbound = []ConnInfo{}, []ConnInfo{}
	for _, tc := range p.conns.snapshot() {
		if tc.server == nil {
			continue // still being set up
		}
		info := ConnInfo{
			Src:         tc.client.RemoteAddr().String(),
			OriginalDst: tc.originalDst().String(),
			ActualDst:   tc.server.RemoteAddr().String(),
			Protocol:    protocolOf(tc.client, tc.server),
			TLS:         tlsOf(tc.client, tc.server),
		}
		if tc.inbound {
			inbound = append(inbound, info)
		} else {
			outbound = append(outbound, info)
		}
	}
	return inbound, outbound
}

// protocolOf is HBONE when either end of a proxied connection is an HBONE stream.
func protocolOf(a, b net.Conn) string {
	for _, c := range []net.Conn{a, b} {
		if _, ok := c.(*hbone.Stream); ok {
			return "HBONE"
		}
	}
	return "TCP"
}

// tlsOf is where the HBONE leg's TLS records are handled, "" without one.
func tlsOf(a, b net.Conn) string {
	for _, c := range []net.Conn{a, b} {
		if st, ok := c.(*hbone.Stream); ok {
			if st.KernelTLS() {
				return "kernel"
			}
			return "user"
		}
	}
	return ""
}

func (t *tracker) init() {
	t.live = map[*liveConn]struct{}{}
}

// goTracked runs fn in a goroutine the tracker waits for; false if draining.
func (t *tracker) goTracked(fn func()) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.draining {
		return false
	}
	t.goEvenDraining(fn)
	return true
}

// goEvenDraining runs fn in a goroutine the tracker waits for, even while draining: a
// connection's own goroutine, already tracked, hands its copy over before it exits.
func (t *tracker) goEvenDraining(fn func()) {
	t.wg.Add(1)
	go func() {
		defer t.wg.Done()
		fn()
	}()
}

// add registers a live connection, for remove to unregister.
func (t *tracker) add(c *liveConn) {
	t.mu.Lock()
	t.live[c] = struct{}{}
	t.mu.Unlock()
}

func (t *tracker) remove(c *liveConn) {
	t.mu.Lock()
	delete(t.live, c)
	t.mu.Unlock()
}

// close closes the connection's parts (drain deadline, policy), once: its sockets or
// stream, then its copy, which unparks after the sockets' close (idle.go).
func (c *liveConn) close() {
	if c.closed.Swap(true) {
		return
	}
	if c.client != nil {
		c.client.Close()
	}
	if c.server != nil {
		c.server.Close()
	}
	if c.copy.p != nil {
		c.copy.unpark()
	}
}

func (t *tracker) stopAccepting() {
	t.mu.Lock()
	t.draining = true
	t.mu.Unlock()
}

// wait waits for every tracked goroutine to return, or ctx; it reports which.
func (t *tracker) wait(ctx context.Context) bool {
	done := make(chan struct{})
	go func() {
		t.wg.Wait()
		close(done)
	}()
	select {
	case <-done:
		return true
	case <-ctx.Done():
		return false
	}
}

func (t *tracker) snapshot() []*liveConn {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make([]*liveConn, 0, len(t.live))
	for c := range t.live {
		out = append(out, c)
	}
	return out
}

func (t *tracker) count() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.live)
}

func (t *tracker) closeAll() {
	for _, c := range t.snapshot() {
		c.close()
	}
}

// watchPolicies re-evaluates live inbound connections after every state change and closes
// the ones policy now denies, as ztunnel does.
func (p *Proxy) watchPolicies(ctx context.Context) {
	for range p.store.Subscribe(ctx) {
		for _, c := range p.conns.snapshot() {
			if c.dst == nil {
				continue
			}
			// The workload as it is now: an update may have changed the policies it selects.
			dst := c.dst
			if w := p.store.WorkloadByUID(dst.UID); w != nil {
				dst = w
			}
			d := rbac.Check(p.store.PoliciesFor(dst), c.attrs)
			if !d.Allow {
				p.log.Info("proxy: connection closed due to policy change", "src", c.attrs.SrcIP, "dst", c.attrs.DstIP, "policy", d.Policy, "reason", d.Reason)
				c.denied.Store(true)
				c.close()
			}
		}
	}
}
