package proxy

import (
	"context"
	"io"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"

	"github.com/gozt/gozt/hbone"
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

// liveConn is one proxied connection the tracker holds: its closable parts and, for
// inbound ones, what policy sees of it.
type liveConn struct {
	mu      sync.Mutex
	closers []io.Closer
	closed  bool

	// inbound only: re-evaluated on policy change.
	dst    *state.Workload
	attrs  rbac.Conn
	denied atomic.Bool // closed by a policy change

	// What Connections shows, set by handOff before the connection is registered (client
	// is nil while a connection is still being set up); formatted only when asked for, so a
	// connection costs no strings for it.
	client, server net.Conn
	originalDst    netip.AddrPort // where the client was going
	inbound        bool

	// copy is the connection's parkable copy (idle.go), set before it is registered; nil
	// for the others.
	copy *parkCopy
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
		if tc.client == nil {
			continue
		}
		info := ConnInfo{
			Src:         tc.client.RemoteAddr().String(),
			OriginalDst: tc.originalDst.String(),
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

// add registers a live connection; the returned func unregisters it.
func (t *tracker) add(c *liveConn) (remove func()) {
	t.mu.Lock()
	t.live[c] = struct{}{}
	t.mu.Unlock()
	return func() {
		t.mu.Lock()
		delete(t.live, c)
		t.mu.Unlock()
	}
}

// closeWith adds closers that closeAll (drain deadline, policy) will close. If the
// connection was already closed they are closed at once.
func (c *liveConn) closeWith(cs ...io.Closer) {
	c.mu.Lock()
	closed := c.closed
	if !closed {
		c.closers = append(c.closers, cs...)
	}
	c.mu.Unlock()
	if closed {
		for _, x := range cs {
			x.Close()
		}
	}
}

func (c *liveConn) close() {
	c.mu.Lock()
	cs := c.closers
	c.closers, c.closed = nil, true
	c.mu.Unlock()
	for _, x := range cs {
		x.Close()
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
